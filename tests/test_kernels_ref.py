"""Every NumPy kernel pair: backward against central finite differences, in float64.

Sizes are deliberately not powers of two (B=2, T=7, C=12, NH=3, V=37). Each check defines the
scalar objective L = sum(R * out) for a fixed random R, runs the backward kernel with dout = R into
gradient buffers pre-filled with random values (so the ADD contract is checked too), and compares
the added part with (L(x + h) - L(x - h)) / 2h on every element. Tolerance 1e-6 relative: with
h = 1e-5 in float64 the central difference's truncation error is O(h^2) ~ 1e-10 and its rounding
error ~ 1e-16 / h ~ 1e-11, both far below it.
"""
import numpy as np
import pytest

from andrea.backends import numpy_ref as K

B, T, C, NH, V = 2, 7, 12, 3, 37
H = 1e-5
TOL = 1e-6


def rnd(rng, *shape, scale=1.0):
    return rng.normal(0, scale, shape).astype(np.float64)


def fd_grad(objective, x):
    """Central finite differences of objective() w.r.t. every element of x (perturbed in place)."""
    g = np.zeros_like(x)
    flat, gf = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + H
        lp = objective()
        flat[i] = orig - H
        lm = objective()
        flat[i] = orig
        gf[i] = (lp - lm) / (2 * H)
    return g


def check(name, analytic, numeric):
    err = np.linalg.norm(analytic - numeric) / max(np.linalg.norm(numeric), 1e-30)
    worst = np.argmax(np.abs(analytic - numeric))
    msg = (f"{name}: relative error {err:.3e} (tol {TOL}); first pairs "
           f"{list(zip(analytic.reshape(-1)[:3], numeric.reshape(-1)[:3]))}, worst at {worst}: "
           f"{analytic.reshape(-1)[worst]} vs {numeric.reshape(-1)[worst]}")
    assert np.all(np.isfinite(analytic)), msg
    assert err < TOL, msg


def run_pair(rng, fwd, bwd, inputs, out_shape, wrt, extra_out=()):
    """Generic: fwd(out, *extra_out, **inputs); bwd(grads..., dout, inputs) -> compare."""
    R = rnd(rng, *out_shape)
    out = np.zeros(out_shape)

    def objective():
        fwd(out, *[np.zeros(s) for s in extra_out], **inputs)
        return float((R * out).sum())

    objective()
    pre = {k: rnd(rng, *inputs[k].shape) for k in wrt}  # random pre-fill: backward must ADD
    grads = {k: pre[k].copy() for k in wrt}
    bwd(grads, R)
    for k in wrt:
        check(f"{fwd.__name__} d{k}", grads[k] - pre[k], fd_grad(objective, inputs[k]))


def test_embed(rng=np.random.default_rng(1)):
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[0, :3] = 5  # repeated tokens must accumulate
    inp = {"tokens": tokens, "wte": rnd(rng, V, C), "wpe": rnd(rng, T + 3, C)}
    run_pair(rng, K.k_embed_fwd,
             lambda g, R: K.k_embed_bwd(g["wte"], g["wpe"], R, tokens),
             inp, (B, T, C), ["wte", "wpe"])


def test_layernorm(rng=np.random.default_rng(2)):
    inp = {"inp": rnd(rng, B, T, C), "weight": rnd(rng, C), "bias": rnd(rng, C)}
    mean, rstd = np.zeros((B, T)), np.zeros((B, T))

    def fwd(out, **kw):
        K.k_layernorm_fwd(out, mean, rstd, **kw)

    fwd.__name__ = "k_layernorm_fwd"
    run_pair(rng, fwd,
             lambda g, R: K.k_layernorm_bwd(g["inp"], g["weight"], g["bias"], R, inp["inp"],
                                            inp["weight"], mean, rstd),
             inp, (B, T, C), ["inp", "weight", "bias"])


@pytest.mark.parametrize("fwd,bwd,oc", [(K.k_attn_qkv_fwd, K.k_attn_qkv_bwd, 3 * C),
                                        (K.k_attn_out_fwd, K.k_attn_out_bwd, C)])
def test_linear_pairs(fwd, bwd, oc, rng=np.random.default_rng(3)):
    inp = {"inp": rnd(rng, B, T, C), "w": rnd(rng, oc, C), "b": rnd(rng, oc)}
    run_pair(rng, fwd,
             lambda g, R: bwd(g["inp"], g["w"], g["b"], R, inp["inp"], inp["w"]),
             inp, (B, T, oc), ["inp", "w", "b"])


def test_attention(rng=np.random.default_rng(4)):
    inp = {"qkv": rnd(rng, B, T, 3 * C)}
    lse = np.zeros((B, NH, T))
    out_saved = np.zeros((B, T, C))

    def fwd(out, qkv):
        K.k_attn_fwd(out, lse, qkv, NH)
        out_saved[...] = out

    fwd.__name__ = "k_attn_fwd"
    run_pair(rng, fwd,
             lambda g, R: K.k_attn_bwd(g["qkv"], R, inp["qkv"], out_saved, lse, NH),
             inp, (B, T, C), ["qkv"])


def test_attention_is_causal(rng=np.random.default_rng(5)):
    """Changing a later token's q, k or v must not change any earlier output."""
    qkv = rnd(rng, B, T, 3 * C)
    out1, out2, lse = np.zeros((B, T, C)), np.zeros((B, T, C)), np.zeros((B, NH, T))
    K.k_attn_fwd(out1, lse, qkv, NH)
    qkv[:, 4:] += 1.0
    K.k_attn_fwd(out2, lse, qkv, NH)
    assert np.array_equal(out1[:, :4], out2[:, :4])
    assert not np.allclose(out1[:, 4:], out2[:, 4:])


def test_mlp(rng=np.random.default_rng(6)):
    inp = {"inp": rnd(rng, B, T, C), "w1": rnd(rng, 4 * C, C, scale=0.5), "b1": rnd(rng, 4 * C),
           "w2": rnd(rng, C, 4 * C, scale=0.5), "b2": rnd(rng, C)}
    pre, act, dact = (np.zeros((B, T, 4 * C)) for _ in range(3))

    def fwd(out, **kw):
        K.k_mlp_fwd(out, pre, act, **kw)

    fwd.__name__ = "k_mlp_fwd"
    run_pair(rng, fwd,
             lambda g, R: K.k_mlp_bwd(g["inp"], g["w1"], g["b1"], g["w2"], g["b2"], R, inp["inp"],
                                      pre, inp["w1"], inp["w2"], act, dact),
             inp, (B, T, C), ["inp", "w1", "b1", "w2", "b2"])


def test_residual(rng=np.random.default_rng(7)):
    inp = {"a": rnd(rng, B, T, C), "b": rnd(rng, B, T, C)}
    run_pair(rng, K.k_residual_add,
             lambda g, R: K.k_residual_add_bwd(g["a"], g["b"], R),
             inp, (B, T, C), ["a", "b"])


def test_residual_layernorm(rng=np.random.default_rng(13)):
    """The fused residual + layer norm against finite differences of L = sum(R1 * res) +
    sum(R2 * out); its backward is the residual gradient with k_layernorm_bwd added in place."""
    inp = {"a": rnd(rng, B, T, C), "b": rnd(rng, B, T, C), "weight": 1 + rnd(rng, C, scale=0.1),
           "bias": rnd(rng, C, scale=0.1)}
    R1, R2 = rnd(rng, B, T, C), rnd(rng, B, T, C)
    res, out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))

    def objective():
        K.k_residual_layernorm_fwd(res, out, mean, rstd, **inp)
        return float((R1 * res).sum() + (R2 * out).sum())

    objective()
    want_res, want_out = np.zeros_like(res), np.zeros_like(out)
    K.k_residual_add(want_res, inp["a"], inp["b"])
    K.k_layernorm_fwd(want_out, np.zeros((B, T)), np.zeros((B, T)), want_res, inp["weight"], inp["bias"])
    np.testing.assert_array_equal(res, want_res)
    np.testing.assert_array_equal(out, want_out)
    dres = R1.copy()  # the gradient of res from above; the layer norm adds its part in place
    dw, db = np.zeros(C), np.zeros(C)
    K.k_layernorm_bwd(dres, dw, db, R2, res, inp["weight"], mean, rstd)
    for k in ("a", "b"):
        check(f"k_residual_layernorm_fwd d{k}", dres, fd_grad(objective, inp[k]))
    check("k_residual_layernorm_fwd dweight", dw, fd_grad(objective, inp["weight"]))
    check("k_residual_layernorm_fwd dbias", db, fd_grad(objective, inp["bias"]))


@pytest.mark.parametrize("rows", [B * T, 5])  # one chunk; chunks of 5 rows, the last short
def test_loss(rows, rng=np.random.default_rng(8)):
    inp = {"inp": rnd(rng, B, T, C), "wte": rnd(rng, V, C)}
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    losses, lse, logits = np.zeros((B, T)), np.zeros((B, T)), np.zeros((rows, V))
    dloss = 0.37

    def objective():
        K.k_loss_fwd(losses, lse, logits, inp["inp"], inp["wte"], targets)
        return dloss * float(losses.sum())

    objective()
    pre = {k: rnd(rng, *inp[k].shape) for k in inp}
    g = {k: pre[k].copy() for k in inp}
    losses2, lse2 = np.full((B, T), np.nan), np.full((B, T), np.nan)
    K.k_loss_bwd(losses2, lse2, g["inp"], g["wte"], logits, inp["inp"], inp["wte"], targets,
                 np.array([dloss]))
    np.testing.assert_array_equal(losses2, losses)  # the fused pass writes the same losses
    np.testing.assert_array_equal(lse2, lse)
    for k in inp:
        check(f"k_loss d{k}", g[k] - pre[k], fd_grad(objective, inp[k]))


def test_loss_value_matches_log_softmax(rng=np.random.default_rng(9)):
    inp, wte = rnd(rng, B, T, C), rnd(rng, V, C)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    losses, lse, logits = np.zeros((B, T)), np.zeros((B, T)), np.zeros((3, V))
    K.k_loss_fwd(losses, lse, logits, inp, wte, targets)
    z = inp @ wte.T
    ref = -(z - np.log(np.exp(z).sum(-1, keepdims=True)))
    ref = np.take_along_axis(ref, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(losses, ref, rtol=1e-12)


def _state(scale=1.0, lr=1e-2, step=1):
    st = np.zeros(K.STATE_LEN)
    st[K.S_SCALE], st[K.S_LR], st[K.S_STEP] = scale, lr, step
    return st


def _check_step(st, g, n_micro=1, max_norm=1.0, fp16=False, growth=2000, losses=None):
    """k_loss_accum of losses (default: ones), then the norm partials of g and k_step_check."""
    K.k_loss_accum(st, np.ones(10) if losses is None else losses)
    partials, dloss = np.zeros(K.GRAD_NORM_PARTIALS), np.zeros(1)
    K.k_grad_norm_partial(partials, g)
    K.k_step_check(st, dloss, partials, n_micro, 10, 0.9, 0.95, 0.1, max_norm, fp16, growth, 2.0 ** 24)
    return dloss


def test_step_check_norm_clip_and_loss(rng=np.random.default_rng(10)):
    g = rnd(rng, 1001)  # not a multiple of the partials count: the last chunk is short
    st = _state(scale=4.0)
    dloss = _check_step(st, g, n_micro=2, max_norm=1e9, losses=np.arange(10.0))
    pre = 1.0 / (2 * 4.0)  # averaged over 2 microbatches, unscaled
    assert st[K.S_NORM] == pytest.approx(pre * np.linalg.norm(g), rel=1e-12)
    assert st[K.S_LOSS] == pytest.approx(4.5 / 2)  # the sum of one microbatch's mean over 2
    assert st[K.S_LOSS_SUM] == 0 and st[K.S_SKIP] == 0 and st[K.S_REC_SCALE] == 4.0
    assert st[K.S_CLIP] == pre and dloss[0] == 4.0 / 10  # no clipping: only the pre-scale
    st = _state(scale=4.0)
    _check_step(st, g, n_micro=2, max_norm=0.5)
    assert np.linalg.norm(g * st[K.S_CLIP]) == pytest.approx(0.5, rel=1e-5)  # clipped to 0.5


def test_step_check_non_finite_policy():
    g = np.ones(100)
    st = _state(scale=8.0, step=3)
    st[K.S_GOOD] = 5
    _check_step(st, g * np.inf, fp16=True)  # fp16 overflow: skip, halve, not a bad step
    assert st[K.S_SKIP] == 1 and st[K.S_SKIPPED] == 1 and st[K.S_GOOD] == 0 and st[K.S_BAD] == 0
    assert st[K.S_SCALE] == 4.0 and st[K.S_REC_SCALE] == 8.0
    _check_step(st, g, fp16=True, losses=np.full(10, np.nan))  # non-finite loss: a bad step
    assert st[K.S_SKIPPED] == 2 and st[K.S_BAD] == 1 and st[K.S_SCALE] == 2.0
    st[K.S_SCALE] = 1.0
    _check_step(st, g * np.nan, fp16=True)  # at scale 1 an overflow is a bad step too
    assert st[K.S_BAD] == 2 and st[K.S_SCALE] == 1.0
    st2 = _state(scale=1.0)
    _check_step(st2, g * np.nan)  # fp32: the scale stays 1
    assert st2[K.S_SKIP] == 1 and st2[K.S_BAD] == 1 and st2[K.S_SCALE] == 1.0
    for i in range(3):  # good steps: the bad streak ends, the fp16 scale doubles every 3
        st[K.S_STEP] = 4 + i  # update number step - skipped = 1, 2, 3
        _check_step(st, g, fp16=True, growth=3)
        assert st[K.S_SKIP] == 0 and st[K.S_BAD] == 0
    assert st[K.S_SCALE] == 2.0 and st[K.S_GOOD] == 0


def test_adamw_step_skip_only_zeroes_grads(rng=np.random.default_rng(12)):
    p, gr, m, v = (rnd(rng, 20) for _ in range(4))
    before = [a.copy() for a in (p, m, v)]
    st = _state()
    st[K.S_SKIP] = 1.0
    pc = np.zeros(20, np.float16)
    K.k_adamw_step(p, pc, gr, m, v, st, 0.9, 0.95, 1e-8, 10)
    assert not gr.any() and not pc.any()
    for a, b in zip(before, (p, m, v)):
        assert np.array_equal(a, b)


def test_adamw_step_matches_torch(rng=np.random.default_rng(11)):
    """k_step_check + k_adamw_step = torch's clip_grad_norm_ then AdamW (decoupled decay on the
    matrices only), over steps with a skipped one in the middle."""
    torch = pytest.importorskip("torch")
    n, n_decay, lr, max_norm = 50, 30, 1e-2, 1.0
    p0 = rnd(rng, n)
    p, m, v = p0.copy(), np.zeros(n), np.zeros(n)
    pc = np.zeros(n, np.float32)
    tp = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.AdamW([{"params": [tp]}], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    st = _state(lr=lr)
    for step in range(1, 7):
        gr = rnd(rng, n, scale=0.3)
        st[K.S_STEP] = step
        grads = gr * np.nan if step == 3 else gr.copy()
        _check_step(st, grads, max_norm=max_norm)
        K.k_adamw_step(p, pc, grads, m, v, st, 0.9, 0.95, 1e-8, n_decay)
        assert not grads.any()
        if step == 3:
            assert st[K.S_SKIP] == 1
            continue
        # torch's step count is the number of updates made: step - skipped, as ours
        with torch.no_grad():
            tp[:n_decay] *= 1 - lr * 0.1
        tp.grad = torch.tensor(gr)
        torch.nn.utils.clip_grad_norm_([tp], max_norm)
        opt.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(pc, p.astype(np.float32))  # the compute copy follows


def test_state_slots_match_the_cuda_enum():
    """kernels/optim.cu names the optimizer-state slots in an enum: the same order as here."""
    import re

    from andrea.paths import KERNEL_DIR
    src = (KERNEL_DIR / "optim.cu").read_text()
    enum = re.search(r"enum \{(.*?)\};", src, re.S).group(1)
    names = re.findall(r"\b(S_[A-Z_]+|STATE_LEN)\b", re.sub(r"//[^\n]*", "", enum))
    assert tuple(names) == K.STATE_SLOTS + ("STATE_LEN",)
    assert K.STATE_LEN >= len(K.STATE_SLOTS)


def test_cast_params_rounds_to_nearest_like_torch(rng=np.random.default_rng(12)):
    torch = pytest.importorskip("torch")
    src = (rng.standard_normal(1001) * 100).astype(np.float32)
    dst = np.full(1001, np.nan, dtype=np.float16)
    K.k_cast_params(dst, src)
    assert np.array_equal(dst, torch.tensor(src).to(torch.float16).numpy())


def _written_cases(rng):
    """(kernel, arguments, index of the activation gradient) of every backward kernel with an
    accumulate keyword; gradient buffers are zeros, everything else random."""
    x, w3, w1 = rnd(rng, B, T, C), rnd(rng, 3 * C, C), rnd(rng, C, C)
    mean, rstd, out, lse = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B, T, C)), np.zeros((B, NH, T))
    weight = 1 + rnd(rng, C, scale=0.1)
    K.k_layernorm_fwd(np.zeros((B, T, C)), mean, rstd, x, weight, rnd(rng, C))
    qkv = rnd(rng, B, T, 3 * C)
    K.k_attn_fwd(out, lse, qkv, NH)
    H4 = 4 * C
    w_up, w_down, pre = rnd(rng, H4, C, scale=0.5), rnd(rng, C, H4, scale=0.5), rnd(rng, B, T, H4)
    z = np.zeros
    return [
        ("k_layernorm_bwd", [z((B, T, C)), z(C), z(C), rnd(rng, B, T, C), x, weight, mean, rstd], 0),
        ("k_attn_qkv_bwd", [z((B, T, C)), z((3 * C, C)), z(3 * C), rnd(rng, B, T, 3 * C), x, w3], 0),
        ("k_attn_out_bwd", [z((B, T, C)), z((C, C)), z(C), rnd(rng, B, T, C), x, w1], 0),
        ("k_attn_bwd", [z((B, T, 3 * C)), rnd(rng, B, T, C), qkv, out, lse, NH], 0),
        ("k_mlp_bwd", [z((B, T, C)), z((H4, C)), z(H4), z((C, H4)), z(C), rnd(rng, B, T, C), x, pre, w_up,
                       w_down, z((B, T, H4)), z((B, T, H4))], 0),
        ("k_loss_bwd", [z((B, T)), z((B, T)), z((B, T, C)), z((V, C)), z((5, V)), x, rnd(rng, V, C),
                        rng.integers(0, V, (B, T)).astype(np.int32), 0.37], 2),
        ("k_fp8_linear_bwd", [z((B, T, C)), z((C, C)), z(C), rnd(rng, B, T, C), x, w1, "e4m3"], 0),
        ("k_fp8_mlp_bwd", [z((B, T, C)), z((H4, C)), z(H4), z((C, H4)), z(C), rnd(rng, B, T, C), x, pre,
                           w_up, w_down, z((B, T, H4)), z((B, T, H4)), "e5m2"], 0),
    ]


WRITTEN = [c[0] for c in _written_cases(np.random.default_rng(0))]


@pytest.mark.parametrize("kernel", WRITTEN)
def test_accumulate_false_writes_the_activation_gradient(kernel):
    """accumulate=False: the activation gradient (dinp, dqkv) is written, its old contents (NaN
    here) never read, and every output has the bits of the default mode adding into zeros; the
    parameter gradients (pre-filled at random in both runs) still add. The default mode's
    increments are checked against finite differences above."""
    name, args, i = next(c for c in _written_cases(np.random.default_rng(14)) if c[0] == kernel)
    prng = np.random.default_rng(15)
    pre = {j: prng.normal(size=a.shape) for j, a in enumerate(args)
           if isinstance(a, np.ndarray) and a.dtype == np.float64 and not a.any() and j != i}
    runs = []
    for accumulate, start in ((True, 0.0), (False, np.nan)):
        a = [x.copy() if isinstance(x, np.ndarray) else x for x in args]
        for j, p in pre.items():
            a[j][...] = p
        a[i][...] = start
        getattr(K, kernel)(*a, accumulate=accumulate)
        runs.append(a)
    added, written = runs
    assert np.isfinite(written[i]).all() and np.abs(written[i]).sum() > 0
    for j, (x, y) in enumerate(zip(added, written)):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(y, x, err_msg=f"{kernel} argument {j}")
    assert kernel == "k_attn_bwd" or any(not np.array_equal(written[j], p) for j, p in pre.items())  # grads moved


def test_adamw_step_can_keep_grads(rng=np.random.default_rng(13)):
    """zero_grads=False: the same update, the gradient untouched (the engine's next first pass
    writes it)."""
    n = 50
    st = np.zeros(K.STATE_LEN)
    st[K.S_CLIP] = st[K.S_DECAY] = st[K.S_VHAT] = 1.0
    st[K.S_STEP_SIZE] = 1e-3
    runs = []
    for zero in (True, False):
        p, g, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(4)) if not runs else \
            [a.copy() for a in start]
        if not runs:
            v = np.abs(v)
            start = [p.copy(), g.copy(), m.copy(), v.copy()]
        K.k_adamw_step(p, None, g, m, v, st, 0.9, 0.95, 1e-8, 20, zero_grads=zero)
        runs.append((p, g, m, v))
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][::2], runs[1][::2]))
    assert not runs[0][1].any() and np.array_equal(runs[1][1], start[1])
