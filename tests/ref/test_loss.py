"""ref/loss.py: the classifier (finite differences in chunks, the loss value, accumulate=False) and
its FP8 form: the dlogits row pass against PyTorch, the stochastic rounding's random bits, and the
FP8 classifier against PyTorch autograd."""
import numpy as np
import pytest

from andrea.backends import ref as K
from andrea.data.chat import IGNORE_INDEX
from refkit import FMTS, B, C, T, V, check, check_written, fd_grad, grid_neighbours, rnd, torch_round


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


def test_accumulate_false_writes_dinp():
    """k_loss_bwd(accumulate=False) writes dinp (refkit.check_written)."""
    rng = np.random.default_rng(14)
    x, z = rnd(rng, B, T, C), np.zeros
    check_written(K.k_loss_bwd, [z((B, T)), z((B, T)), z((B, T, C)), z((V, C)), z((5, V)), x, rnd(rng, V, C),
                                 rng.integers(0, V, (B, T)).astype(np.int32), 0.37], 2)


# ---------------------------------------------------------------- the classifier in FP8


def classifier_case(rng, N=37, C=24, V=53):
    x = rng.normal(0, 1, (N, C)).astype(np.float32)
    w = rng.normal(0, 0.5, (V, C)).astype(np.float32)
    t = rng.integers(0, V, N).astype(np.int64)
    return x, w, t


@pytest.mark.parametrize("fmt", FMTS)
def test_dlogits_row_pass_against_torch(fmt):
    """loss_bwd_fp8: losses and lse as PyTorch's cross-entropy, q8 PyTorch's saturating cast of
    (softmax - onehot) * 2^k (k of an amax of 1: 8 for E4M3, 15 for E5M2), 1/scale = dloss / 2^k."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    z = rng.normal(0, 3, (41, 67))
    t = rng.integers(0, 67, 41)
    losses, lse, q8, meta = np.zeros(41), np.zeros(41), np.zeros((41, 67), np.uint8), np.zeros(2, np.float32)
    K.loss_bwd_fp8(losses, lse, q8, meta, z, t, np.float32(0.125), fmt, rounding="nearest")
    zt = torch.from_numpy(z)
    ce = torch.nn.functional.cross_entropy(zt, torch.from_numpy(t), reduction="none").numpy()
    np.testing.assert_allclose(losses, ce, rtol=1e-12)
    np.testing.assert_allclose(lse, torch.logsumexp(zt, -1).numpy(), rtol=1e-12)
    g = torch.softmax(zt, -1).numpy()
    g[np.arange(41), t] -= 1.0
    k = {"e4m3": 8, "e5m2": 15}[fmt]
    assert K.fp8_bound_scale(fmt) == (2.0 ** k, 2.0 ** -k)
    want = torch_round(g * 2.0 ** k, fmt)
    np.testing.assert_array_equal(K.fp8_decode(q8, fmt), want)
    assert meta[1] == np.float32(0.125 * 2.0 ** -k)
    assert (q8 != 0).mean() > 0.5  # most of dlogits survives the scale (not all flushed to zero)


def test_sr_bits_are_a_function_of_the_logits_and_the_row():
    """fp8_sr_bits: the same logits give the same bits (and the same in chunks: row0), a change of
    one logit by one unit changes the bits of its group of 16 bytes only, equal rows draw different
    bits, and the bits are spread evenly over 16 bits."""
    rng = np.random.default_rng(6)
    z = rng.normal(0, 2, (64, 333)).astype(np.float16)  # 2 bytes an element, as bf16 (no ml_dtypes needed)
    b = K.fp8_sr_bits(z)
    assert b.shape == z.shape and b.max() < 65536
    np.testing.assert_array_equal(b, K.fp8_sr_bits(z.copy()))
    np.testing.assert_array_equal(b[40:], K.fp8_sr_bits(z[40:], row0=40))
    z2 = z.copy()
    z2.view(np.uint16)[3, 20] += 1
    changed = np.argwhere(K.fp8_sr_bits(z2) != b)
    assert set(map(tuple, changed)) <= {(3, j) for j in range(16, 24)} and len(changed) >= 6
    same = np.repeat(z[:1], 4, axis=0)
    bs = K.fp8_sr_bits(same)
    assert all((bs[i] != bs[0]).mean() > 0.99 for i in range(1, 4))
    assert abs(b.mean() / 65535 - 0.5) < 0.01
    hist = np.bincount(b.ravel() >> 12, minlength=16) / b.size
    assert np.all(np.abs(hist - 1 / 16) < 0.01), hist
    f32 = K.fp8_sr_bits(z.astype(np.float32))  # 4 bytes an element: groups of 4
    assert f32.shape == z.shape and not np.array_equal(f32, b)


def test_stochastic_dlogits_keep_the_small_probabilities():
    """E4M3 dlogits with the bound's scale 2^8: probabilities under 2^-18 round to 0 to nearest,
    so their push on the logits is lost; rounded stochastically the sum of the many small entries
    is kept (within 3%), and each element is one of its two grid neighbours."""
    rng = np.random.default_rng(8)
    R, V = 64, 1024
    z = np.full((R, V), -14.0) + rng.normal(0, 0.05, (R, V))
    t = rng.integers(0, V, R)
    z[np.arange(R), t] = 0.0
    z = z.astype(np.float32)
    out = {}
    for rounding in ("nearest", "stochastic"):
        q8, meta = np.zeros((R, V), np.uint8), np.zeros(2, np.float32)
        K.loss_bwd_fp8(np.zeros(R), np.zeros(R), q8, meta, z, t, 1.0, "e4m3", rounding=rounding)
        out[rounding] = K.fp8_decode(q8, "e4m3").astype(np.float64) / 256
    zz = z.astype(np.float64)
    g = np.exp(zz - np.log(np.exp(zz).sum(1, keepdims=True)))
    tail = np.ones((R, V), bool)
    tail[np.arange(R), t] = False
    assert g[tail].max() < 2.0 ** -18
    assert np.all(out["nearest"][tail] == 0)
    assert abs(out["stochastic"][tail].sum() / g[tail].sum() - 1) < 0.03
    g[np.arange(R), t] -= 1.0
    lo, hi = grid_neighbours((g * 256).astype(np.float32), "e4m3")
    s = out["stochastic"] * 256
    assert np.all((s == lo) | (s == hi))


def dlogits_on_grid(g, scale, fmt, rounding, logits):
    """The FP8 values of dlogits g times the bound's scale: rounded to nearest, or stochastically
    with the random bits of the workspace's logits."""
    y = (g * float(scale)).astype(np.float32)
    if rounding == "stochastic":
        y = K.fp8_round_stochastic(y, K.fp8_sr_bits(logits), fmt)
    return K.fp8_decode(K.fp8_encode(K.fp8_round(y, fmt), fmt), fmt)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt,tol", [("e4m3", 0.08), ("e5m2", 0.15)])
@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "write"])
def test_fp8_classifier_against_autograd(fmt, tol, accumulate, rounding):
    """k_fp8_loss_bwd against PyTorch autograd of dloss * sum(cross-entropy) over the
    FP8-rounded operands (float64): the same losses; gradients that differ from autograd's only by
    dlogits' quantisation, each element of dinp and dwte within the bound |dq - g| @ |w| (and
    |dq - g|.T @ |x|) of what the rounding of dlogits can change, and the whole within tol; in
    chunks of R rows (2 here) as one chunk. k_fp8_loss_fwd gives the same losses and lse. Rounded
    stochastically, each dlogit is within one step of the grid of its value."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x, w, t = classifier_case(rng)
    N, C = x.shape
    V = w.shape[0]
    dloss = 1.0 / N
    xf, wf = K.fp8_fake(x, K.FP8_FWD), K.fp8_fake(w, K.FP8_FWD)
    xt = torch.from_numpy(xf).requires_grad_()
    wt = torch.from_numpy(wf).requires_grad_()
    ce = torch.nn.functional.cross_entropy(xt @ wt.T, torch.from_numpy(t), reduction="none")
    (ce.sum() * dloss).backward()
    g = torch.softmax(torch.from_numpy(xf @ wf.T), -1).numpy()
    g[np.arange(N), t] -= 1.0
    scale, inv = K.fp8_bound_scale(fmt)
    dq = dlogits_on_grid(g, scale, fmt, rounding, xf @ wf.T) * float(inv) * dloss
    err = np.abs(dq - g * dloss)
    lo, hi = grid_neighbours((g * float(scale)).astype(np.float32), fmt)
    assert np.all(err <= np.abs(hi - lo) * float(inv) * dloss * (1 if rounding == "stochastic" else 0.5) + 1e-15)
    base = rng.normal(0, 1, (N, C))
    out = {}
    for R in (2, N):
        losses, lse, dinp, dwte = np.zeros(N), np.zeros(N), base.copy(), np.zeros((V, C))
        K.k_fp8_loss_bwd(losses, lse, dinp, dwte, np.zeros((R, V)), x, w, t, dloss, fmt, accumulate, rounding=rounding)
        out[R] = losses, dinp, dwte
        np.testing.assert_allclose(losses, ce.detach().numpy(), rtol=1e-10)
        want_dx = xt.grad.numpy() + (base if accumulate else 0)
        assert np.all(np.abs(dinp - want_dx) <= err @ np.abs(wf) + 1e-12)
        assert np.all(np.abs(dwte - wt.grad.numpy()) <= err.T @ np.abs(xf) + 1e-12)
        r = np.linalg.norm(dwte - wt.grad.numpy()) / np.linalg.norm(wt.grad.numpy())
        assert 0 < r < tol, r
        lf, lsef = np.zeros(N), np.zeros(N)
        K.k_fp8_loss_fwd(lf, lsef, np.zeros((R, V)), x, w, t)
        np.testing.assert_allclose(lf, losses, rtol=1e-12)
    for a, b in zip(out[2], out[N]):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    # fp8_logits=False: the logits of the unquantised operands, the backward's products as above
    losses, lse, dinp, dwte = np.zeros(N), np.zeros(N), base.copy(), np.zeros((V, C))
    K.k_fp8_loss_bwd(losses, lse, dinp, dwte, np.zeros((N, V)), x, w, t, dloss, fmt, accumulate, fp8_logits=False,
                     rounding=rounding)
    z = x.astype(np.float64) @ w.astype(np.float64).T
    ce = torch.nn.functional.cross_entropy(torch.from_numpy(z), torch.from_numpy(t), reduction="none").numpy()
    np.testing.assert_allclose(losses, ce, rtol=1e-10)
    g = torch.softmax(torch.from_numpy(z), -1).numpy()
    g[np.arange(N), t] -= 1.0
    inv_dl = float(np.float32(dloss * float(inv)))  # the float32 1/scale the products get
    dq = dlogits_on_grid(g, scale, fmt, rounding, z).astype(np.float64) * inv_dl
    np.testing.assert_allclose(dinp, dq @ wf + (base if accumulate else 0), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(dwte, dq.T @ xf, rtol=1e-10, atol=1e-14)
    q = np.arange(12, dtype=np.uint8).reshape(3, 4)
    qt = np.zeros((4, 3), np.uint8)
    K.k_fp8_transpose(qt, q)
    np.testing.assert_array_equal(qt, q.T)


# ---------------------------------------------------------------- the ignore index (chat loss mask)


def ignored_case(rng, N=43, C=11, V=37, share=0.4):
    """Odd sizes; about `share` of the targets IGNORE_INDEX, the first and last row among them."""
    x, w = rng.normal(0, 1, (N, C)), rng.normal(0, 0.5, (V, C))
    t = rng.integers(0, V, N).astype(np.int32)
    t[rng.random(N) < share] = IGNORE_INDEX
    t[[0, -1]] = IGNORE_INDEX
    return x, w, t


@pytest.mark.parametrize("rows", [43, 5])  # one chunk; chunks of 5 rows, the last short
def test_ignore_index_against_torch(rows):
    """k_loss_fwd / k_loss_bwd with targets of IGNORE_INDEX (-1) and dloss = 1 / (targets that
    count): the losses are torch's cross_entropy(ignore_index=-1, reduction="none") (0 where
    ignored), their sum times dloss its reduction="mean", and dinp and dwte the gradients of that
    mean by autograd; the ignored rows' dinp is exactly zero."""
    torch = pytest.importorskip("torch")
    x, w, t = ignored_case(np.random.default_rng(21))
    N, C = x.shape
    V = w.shape[0]
    xt, wt, tt = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_(), torch.from_numpy(t).long()
    mean = torch.nn.functional.cross_entropy(xt @ wt.T, tt, ignore_index=-1)
    mean.backward()
    per = torch.nn.functional.cross_entropy(xt @ wt.T, tt, ignore_index=-1, reduction="none").detach().numpy()
    counted = int((t != IGNORE_INDEX).sum())
    losses, lse = np.full((1, N), np.nan), np.full((1, N), np.nan)
    K.k_loss_fwd(losses, lse, np.zeros((rows, V)), x[None], w, t[None])
    np.testing.assert_allclose(losses[0], per, rtol=1e-12, atol=0)
    assert np.all(losses[0][t == IGNORE_INDEX] == 0.0)
    np.testing.assert_allclose(lse[0], torch.logsumexp(torch.from_numpy(x @ w.T), -1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(losses.sum() / counted, mean.item(), rtol=1e-12)
    dinp, dwte, l2, lse2 = np.zeros((1, N, C)), np.zeros((V, C)), np.zeros((1, N)), np.zeros((1, N))
    K.k_loss_bwd(l2, lse2, dinp, dwte, np.zeros((rows, V)), x[None], w, t[None], 1.0 / counted)
    np.testing.assert_array_equal(l2, losses)
    np.testing.assert_allclose(dinp[0], xt.grad.numpy(), rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(dwte, wt.grad.numpy(), rtol=1e-10, atol=1e-15)
    assert np.all(dinp[0][t == IGNORE_INDEX] == 0.0)


def test_ignore_index_keeps_the_counted_rows_bits():
    """The rows that count give the same bits whether other rows are ignored or not (losses, lse,
    their dinp rows), and a batch without an ignored target is computed as before the ignore index
    (the loss of every row, compared with the log-softmax formula bit for bit)."""
    x, w, t = ignored_case(np.random.default_rng(22))
    N, C = x.shape
    V = w.shape[0]
    full = np.where(t == IGNORE_INDEX, 3, t).astype(np.int32)
    out = {}
    for name, tg in (("masked", t), ("full", full)):
        losses, lse, dinp, dwte = np.zeros((1, N)), np.zeros((1, N)), np.zeros((1, N, C)), np.zeros((V, C))
        K.k_loss_bwd(losses, lse, dinp, dwte, np.zeros((N, V)), x[None], w, tg[None], 0.25)
        out[name] = losses[0], lse[0], dinp[0]
    keep = t != IGNORE_INDEX
    for a, b in zip(out["masked"], out["full"]):
        np.testing.assert_array_equal(a[keep], b[keep])
    np.testing.assert_array_equal(out["masked"][1], out["full"][1])  # lse of every row
    z = x @ w.T
    m = z.max(-1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(-1))
    np.testing.assert_array_equal(out["full"][0], lse - z[np.arange(N), full])


@pytest.mark.parametrize("fmt", FMTS)
def test_ignore_index_fp8_row_pass(fmt):
    """loss_bwd_fp8 and k_fp8_loss_bwd: an ignored row has loss 0 and FP8 dlogits of zero bytes;
    the rows that count have the bytes they have without it; k_fp8_loss_bwd's gradient is that of
    the counted rows alone (the same as leaving the ignored rows out)."""
    rng = np.random.default_rng(23)
    x, w, t = ignored_case(rng)
    x, w = x.astype(np.float32), w.astype(np.float32)
    N, V = x.shape[0], w.shape[0]
    keep = t != IGNORE_INDEX
    z = rng.normal(0, 3, (N, V))
    q = {}
    for name, tg in (("masked", t), ("full", np.where(keep, t, 0))):
        losses, lse, q8, meta = np.zeros(N), np.zeros(N), np.zeros((N, V), np.uint8), np.zeros(2, np.float32)
        K.loss_bwd_fp8(losses, lse, q8, meta, z, tg, 0.5, fmt, rounding="stochastic")
        q[name] = losses, q8
    assert np.all(q["masked"][0][~keep] == 0.0) and np.all(q["masked"][1][~keep] == 0)
    np.testing.assert_array_equal(q["masked"][0][keep], q["full"][0][keep])
    np.testing.assert_array_equal(q["masked"][1][keep], q["full"][1][keep])
    C = x.shape[1]
    dinp, dwte = np.zeros((N, C)), np.zeros((V, C))
    K.k_fp8_loss_bwd(np.zeros(N), np.zeros(N), dinp, dwte, np.zeros((N, V)), x, w, t, 0.5, fmt, rounding="nearest")
    sub_x, sub_w = np.zeros((keep.sum(), C)), np.zeros((V, C))
    K.k_fp8_loss_bwd(np.zeros(keep.sum()), np.zeros(keep.sum()), sub_x, sub_w, np.zeros((keep.sum(), V)), x[keep], w,
                     t[keep], 0.5, fmt, rounding="nearest")
    assert np.all(dinp[~keep] == 0.0)
    np.testing.assert_allclose(dinp[keep], sub_x, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(dwte, sub_w, rtol=1e-6, atol=1e-9)
