"""CUDA: the classifier loss against the NumPy reference, on the GPU (skipped without one); moved from tests/test_cuda_kernels.py.

    python -m pytest -m gpu tests/cuda/test_loss_cuda.py -q
"""
import os

import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref
from cudakit import B, C, Grad, LOSS_ROWS, T, V, assert_close, dev, host, nan_buf, rnd, use_tuning, zeros_like64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


# ---------------------------------------------------------------- loss
@pytest.mark.parametrize("rows", [B * T, 64])  # one chunk; chunks of 64 rows, the last short
@pytest.mark.parametrize("V", [V, 1000])  # rows of 1000 are whole 16-byte vectors: the kernels' vector path
def test_loss(be, prec, rng, rows, V, accumulate):
    dt, tol = prec
    inp, wte = rnd(rng, (B, T, C), dt), rnd(rng, (V, C), dt, 0.1)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    losses, lse, logits = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B * T, V))
    ref.k_loss_fwd(losses, lse, logits, inp, wte, targets)
    g_losses, g_lse, g_logits = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32), nan_buf((rows, V), dt)
    be.k_loss_fwd(g_losses, g_lse, g_logits, dev(inp, dt), dev(wte, dt), dev(targets, np.int32))
    if rows == B * T:
        assert_close("k_loss_fwd logits", host(g_logits), logits.reshape(rows, V), tol)
    assert_close("k_loss_fwd losses", host(g_losses), losses, tol)
    assert_close("k_loss_fwd lse", host(g_lse), lse, tol)

    dloss = 1.0 / 7  # any scale; the engine passes loss_scale / (B*T)
    dinp, dwte = zeros_like64(inp, wte)
    r_losses, r_lse = np.zeros((B, T)), np.zeros((B, T))
    ref.k_loss_bwd(r_losses, r_lse, dinp, dwte, logits, inp, wte, targets, dloss)
    gi, gw = Grad(rng, dinp, dt, accumulate), Grad(rng, dwte, np.float32)
    b_losses, b_lse = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)
    args = (dev(inp, dt), dev(wte, dt), dev(targets, np.int32))
    be.k_loss_bwd(b_losses, b_lse, gi.d, gw.d, nan_buf((rows, V), dt), *args, dloss, accumulate=accumulate)
    assert_close("k_loss_bwd losses", host(b_losses), r_losses, tol)
    assert np.array_equal(host(b_lse), host(g_lse))  # the same row reduction as k_loss_fwd
    gi.check("k_loss_bwd dinp", tol)
    gw.check("k_loss_bwd dwte", tol)
    # dloss read from the device (the engine's, written by k_step_check): the same bits
    d2, w2 = dev(gi.pre, dt) if accumulate else nan_buf((B, T, C), dt), dev(gw.pre, np.float32)
    be.k_loss_bwd(b_losses, b_lse, d2, w2, nan_buf((rows, V), dt), *args, dev([dloss], np.float32),
                  accumulate=accumulate)
    assert np.array_equal(host(d2), host(gi.d)) and np.array_equal(host(w2), host(gw.d))


@pytest.mark.parametrize("dt_name,Vr,vectors,prefetch,blocks", LOSS_ROWS)
def test_loss_rows(be, rng, dt_name, Vr, vectors, prefetch, blocks, monkeypatch):
    """k_loss_fwd and k_loss_bwd (one chunk of 154 rows) against the reference: losses, lse, the
    dlogits left in the workspace (also without the target entries, where the -1 would hide an
    error in the softmax), dinp (written) and dwte; lse the same bits in both; a rerun the same
    bits; the version that ran is the one the plan names."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    from andrea.backends.cuda.geometry import loss_row_plan
    dt = np.dtype(dt_name)
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 3e-2}[dt_name]
    use_tuning(monkeypatch, be, loss_vectors=vectors, loss_prefetch=prefetch, loss_blocks=blocks)
    assert (loss_row_plan(Vr, dt.itemsize, vectors) is None) == (dt_name == "float32" and Vr == 50304)
    Cq, N = 64, B * T
    inp, wte = rnd(rng, (B, T, Cq), dt), rnd(rng, (Vr, Cq), dt, 0.3)
    targets = rng.integers(0, Vr, (B, T)).astype(np.int32)
    losses, lse, logits = np.zeros((B, T)), np.zeros((B, T)), np.zeros((N, Vr))
    ref.k_loss_fwd(losses, lse, logits, inp, wte, targets)
    args = (dev(inp, dt), dev(wte, dt), dev(targets, np.int32))
    g_losses, g_lse = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)
    launched = []
    launch = be.rt.launch
    monkeypatch.setattr(be.rt, "launch", lambda f, k, *a, **kw: (launched.append(k), launch(f, k, *a, **kw))[1])
    be.k_loss_fwd(g_losses, g_lse, nan_buf((N, Vr), dt), *args)
    assert launched == (["loss_fwd"] if dt_name == "float32" and Vr == 50304 else ["loss_fwd_regs"])
    assert_close("k_loss_fwd losses", host(g_losses), losses, tol)
    assert_close("k_loss_fwd lse", host(g_lse), lse, tol)

    dloss = 1.0 / 7
    dinp, dwte = zeros_like64(inp, wte)
    ref.k_loss_bwd(losses, lse, dinp, dwte, logits, inp, wte, targets, dloss)
    runs = []
    for _ in range(2):
        b_losses, b_lse, ws = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32), nan_buf((N, Vr), dt)
        d_inp, d_wte = nan_buf((B, T, Cq), dt), dev(np.zeros((Vr, Cq)), np.float32)
        be.k_loss_bwd(b_losses, b_lse, d_inp, d_wte, ws, *args, dloss, accumulate=False)
        runs.append([host(a) for a in (b_losses, b_lse, ws, d_inp, d_wte)])
    got = runs[0]
    assert_close("k_loss_bwd losses", got[0], losses, tol)
    assert np.array_equal(got[1], host(g_lse))
    assert_close("k_loss_bwd dlogits", got[2], logits, tol)
    rows = np.arange(N)
    off = [a.copy() for a in (got[2], logits)]
    for a in off:
        a[rows, targets.reshape(N)] = 0.0
    assert_close("k_loss_bwd dlogits off the targets", off[0], off[1], tol)
    assert_close("k_loss_bwd dinp", got[3], dinp, tol)
    assert_close("k_loss_bwd dwte", got[4], dwte, tol)
    for a, b in zip(runs[0], runs[1]):
        assert np.array_equal(a, b)  # the same bits again



# ---------------------------------------------------------------- the ignore index (chat loss mask)
def ignored_targets(rng, N, Vr):
    """Targets with about 40% IGNORE_INDEX (-1), the first and last row among them."""
    from andrea.data.chat import IGNORE_INDEX
    t = rng.integers(0, Vr, N).astype(np.int32)
    t[rng.random(N) < 0.4] = IGNORE_INDEX
    t[[0, -1]] = IGNORE_INDEX
    return t


@pytest.mark.parametrize("dt_name,Vr", [("float32", 1001), ("float16", 8192), ("bfloat16", 50304)])
@pytest.mark.parametrize("vectors", [0, 8], ids=["v1", "regs"])
def test_loss_ignore_index(be, rng, dt_name, Vr, vectors, monkeypatch):
    """k_loss_fwd / k_loss_bwd with targets of IGNORE_INDEX, row pass version 1 and the row in
    registers (where the plan has one): losses (exactly 0 where ignored), lse, dlogits (an ignored
    row all zeros), dinp (zero rows where ignored) and dwte against the reference; the rows that
    count have the bits they have with every target counted (the 16-bit path unchanged)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    dt = np.dtype(dt_name)
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 3e-2}[dt_name]
    use_tuning(monkeypatch, be, loss_vectors=vectors)
    Cq, N = 64, B * T
    inp, wte = rnd(rng, (B, T, Cq), dt), rnd(rng, (Vr, Cq), dt, 0.3)
    t = ignored_targets(rng, N, Vr)
    keep = t >= 0
    counted = int(keep.sum())
    dloss = 1.0 / counted  # torch's cross_entropy(ignore_index=-1) mean
    losses, lse, dinp, dwte = np.zeros((B, T)), np.zeros((B, T)), *zeros_like64(inp, wte)
    logits = np.zeros((N, Vr))
    ref.k_loss_bwd(losses, lse, dinp, dwte, logits, inp, wte, t.reshape(B, T), dloss)
    runs = {}
    for name, tg in (("masked", t), ("full", np.where(keep, t, 1).astype(np.int32))):
        b_losses, b_lse, ws = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32), nan_buf((N, Vr), dt)
        d_inp, d_wte = nan_buf((B, T, Cq), dt), dev(np.zeros((Vr, Cq)), np.float32)
        be.k_loss_bwd(b_losses, b_lse, d_inp, d_wte, ws, dev(inp, dt), dev(wte, dt), dev(tg.reshape(B, T), np.int32),
                      dloss, accumulate=False)
        f_losses, f_lse = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)
        be.k_loss_fwd(f_losses, f_lse, nan_buf((N, Vr), dt), dev(inp, dt), dev(wte, dt),
                      dev(tg.reshape(B, T), np.int32))
        runs[name] = [host(a) for a in (b_losses, b_lse, ws, d_inp, d_wte, f_losses)]
    got = runs["masked"]
    assert np.all(got[0].reshape(N)[~keep] == 0.0) and np.all(got[5].reshape(N)[~keep] == 0.0)
    assert_close("k_loss_bwd losses", got[0], losses, tol)
    assert_close("k_loss_fwd losses", got[5], losses, tol)
    assert_close("k_loss_bwd lse", got[1], lse, tol)
    assert np.all(got[2][~keep] == 0.0), "an ignored row's dlogits are not zero"
    assert_close("k_loss_bwd dlogits", got[2], logits, tol)
    assert np.all(got[3].reshape(N, Cq)[~keep] == 0.0)
    assert_close("k_loss_bwd dinp", got[3], dinp, tol)
    assert_close("k_loss_bwd dwte", got[4], dwte, tol)
    full = runs["full"]
    for i in (0, 2, 3, 5):  # losses, dlogits, dinp rows, fwd losses of the counted rows: the same bits
        assert np.array_equal(got[i].reshape(N, -1)[keep], full[i].reshape(N, -1)[keep])
    assert np.array_equal(got[1], full[1])  # lse of every row


@pytest.mark.parametrize("version", ["regs", "v1"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_row_pass_ignore_index(be, fmt, version, monkeypatch):
    """loss_bwd_fp8(_regs) with targets of IGNORE_INDEX: loss 0 and zero bytes of FP8 dlogits on the
    ignored rows, and on the rows that count the bytes of ref.loss_bwd_fp8 (rounded to nearest; a
    value at a rounding midpoint may take its neighbour, fewer than 1 in 1000) and the bytes the row
    has when no row is ignored."""
    import cupy as cp
    from andrea.backends.cuda.fp8.quant import Quant
    from andrea.backends.cuda.ops.loss import dloss_args
    from fp8kit import on_dev
    if version == "v1":
        use_tuning(monkeypatch, be, loss_vectors=0)
    n, Vr = 48, 1008
    rng = np.random.default_rng(31)
    z0 = on_dev(rng.normal(0, 4, (n, Vr)))
    th = ignored_targets(rng, n, Vr)
    keep = th >= 0
    dloss = cp.asarray(np.array([1.0 / keep.sum()], np.float32))
    out = {}
    for name, tg in (("masked", th), ("full", np.where(keep, th, 1).astype(np.int32))):
        z, t = z0.copy(), cp.asarray(tg)
        q8, meta = cp.zeros((n, Vr), cp.uint8), cp.zeros(2, cp.float32)
        lf, lse = cp.zeros(n, cp.float32), cp.zeros(n, cp.float32)
        be._loss_rows(True, n, z, z.dtype, (lf, lse, z, t, np.int64(n), np.int32(Vr)) + dloss_args("t", dloss)
                      + (q8, meta[1:], np.int64(0)), fp8_defs=Quant.fmt_defs(fmt) + ("-DFP8_SR=0",))
        out[name] = lf.get(), q8.get()
    lf, got = out["masked"]
    assert np.all(lf[~keep] == 0.0) and np.all(got[~keep] == 0)
    assert np.array_equal(lf[keep], out["full"][0][keep]) and np.array_equal(got[keep], out["full"][1][keep])
    want = np.zeros((n, Vr), np.uint8)
    ref.loss_bwd_fp8(np.zeros(n), np.zeros(n), want, np.zeros(2, np.float32), z0.get(), th, dloss.get(), fmt, "nearest")
    assert (got != want).mean() < 1e-3


BEFORE = os.environ.get("ANDREA_LOSS_BEFORE")  # a kernels/loss.cu from before the ignore index


@pytest.mark.skipif(not BEFORE, reason="set ANDREA_LOSS_BEFORE to the loss.cu of a commit before the ignore index")
@pytest.mark.parametrize("dt_name,Vr", [("float32", 1001), ("float16", 8192), ("bfloat16", 50304)])
@pytest.mark.parametrize("vectors", [0, 8], ids=["v1", "regs"])
def test_loss_bits_as_before_the_ignore_index(be, rng, dt_name, Vr, vectors, monkeypatch):
    """With no target ignored, k_loss_fwd and k_loss_bwd (and the FP8 row pass, stochastic rounding)
    give the bytes the kernels gave before the ignore index existed: losses, lse, dlogits, dinp,
    dwte, FP8 dlogits."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    import cupy as cp
    from andrea.backends import get_backend
    from andrea.backends.cuda.fp8.quant import Quant
    from andrea.backends.cuda.ops.loss import dloss_args
    dt = np.dtype(dt_name)
    old = get_backend("cuda", sources={"loss.cu": BEFORE})
    Cq, N = 64, B * T
    inp, wte = rnd(rng, (B, T, Cq), dt), rnd(rng, (Vr, Cq), dt, 0.3)
    t = rng.integers(0, Vr, (B, T)).astype(np.int32)
    got = []
    for b in (be, old):
        use_tuning(monkeypatch, b, loss_vectors=vectors)
        # k_loss_bwd's order: losses, lse, dinp, dwte, logits
        out = [nan_buf((B, T), np.float32), nan_buf((B, T), np.float32), nan_buf((B, T, Cq), dt),
               dev(np.zeros((Vr, Cq)), np.float32), nan_buf((N, Vr), dt)]
        b.k_loss_bwd(*out, dev(inp, dt), dev(wte, dt), dev(t, np.int32), 1.0 / 7, accumulate=False)
        fwd = [nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)]
        b.k_loss_fwd(*fwd, nan_buf((N, Vr), dt), dev(inp, dt), dev(wte, dt), dev(t, np.int32))
        z = dev(rng.normal(0, 4, (48, 1008)) if b is be else host(got[0][-1]), np.float16)
        q8, meta, lf, lse = cp.zeros((48, 1008), cp.uint8), cp.zeros(2, cp.float32), cp.zeros(48, cp.float32), \
            cp.zeros(48, cp.float32)
        tz = cp.asarray(np.arange(48, dtype=np.int32) * 13)
        b._loss_rows(True, 48, z, z.dtype, (lf, lse, z, tz, np.int64(48), np.int32(1008))
                     + dloss_args("t", cp.asarray(np.array([0.25], np.float32))) + (q8, meta[1:], np.int64(3)),
                     fp8_defs=Quant.fmt_defs("e4m3") + ("-DFP8_SR=1",))
        got.append([a.get() for a in out + fwd + [lf, lse, q8, meta]] + [z])
    for i, (a, b) in enumerate(zip(got[0][:-1], got[1][:-1])):
        assert a.tobytes() == b.tobytes(), f"output {i} differs from the kernels before the ignore index"
