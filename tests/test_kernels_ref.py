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


def test_loss(rng=np.random.default_rng(8)):
    inp = {"inp": rnd(rng, B, T, C), "wte": rnd(rng, V, C)}
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    losses, lse, logits = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B, T, V))
    dloss = 0.37

    def objective():
        K.k_loss_fwd(losses, lse, logits, inp["inp"], inp["wte"], targets)
        return dloss * float(losses.sum())

    objective()
    pre = {k: rnd(rng, *inp[k].shape) for k in inp}
    g = {k: pre[k].copy() for k in inp}
    K.k_loss_bwd(g["inp"], g["wte"], logits, lse, inp["inp"], inp["wte"], targets, dloss)
    for k in inp:
        check(f"k_loss d{k}", g[k] - pre[k], fd_grad(objective, inp[k]))


def test_loss_value_matches_log_softmax(rng=np.random.default_rng(9)):
    inp, wte = rnd(rng, B, T, C), rnd(rng, V, C)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    losses, lse, logits = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B, T, V))
    K.k_loss_fwd(losses, lse, logits, inp, wte, targets)
    z = inp @ wte.T
    ref = -(z - np.log(np.exp(z).sum(-1, keepdims=True)))
    ref = np.take_along_axis(ref, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(losses, ref, rtol=1e-12)


def test_grad_norm_and_scale(rng=np.random.default_rng(10)):
    g = rnd(rng, 1001)  # not a multiple of the partials count: the last chunk is short
    partials, norm = np.zeros(K.GRAD_NORM_PARTIALS), np.zeros(1)
    K.k_grad_norm_partial(partials, g)
    K.k_grad_norm_final(norm, partials, 0.5)
    assert norm[0] == pytest.approx(0.5 * np.linalg.norm(g), rel=1e-12)
    g2 = g.copy()
    K.k_grad_scale(g2, norm, 0.5, 1.0)  # clip the 0.5-scaled gradient to norm 1
    assert np.linalg.norm(g2) == pytest.approx(1.0, rel=1e-5)
    g3 = g.copy()
    K.k_grad_scale(g3, norm, 0.5, 1e9)  # no clipping: only the pre-scale
    np.testing.assert_allclose(g3, 0.5 * g, rtol=1e-12)


def test_adamw_matches_torch(rng=np.random.default_rng(11)):
    torch = pytest.importorskip("torch")
    n, n_decay = 50, 30
    p0 = rnd(rng, n)
    p, m, v = p0.copy(), np.zeros(n), np.zeros(n)
    tp = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.AdamW([{"params": [tp]}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    # decoupled decay on the first n_decay only: torch decays whole tensors, so decay by hand there
    for step in range(1, 6):
        gr = rnd(rng, n)
        K.k_adamw(p, gr, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, n_decay)
        with torch.no_grad():
            tp[:n_decay] *= 1 - 1e-2 * 0.1
        tp.grad = torch.tensor(gr)
        opt.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-10, atol=1e-12)
