"""CUDA: the layer norms (alone and after the residual add) against the NumPy reference, on the GPU (skipped without one); moved from tests/test_cuda_kernels.py.

    python -m pytest -m gpu tests/cuda/test_layernorm_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref
from cudakit import B, C, Grad, LN_BWD_SHAPES, T, assert_close, dev, host, nan_buf, rnd, use_tuning, zeros_like64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


# ---------------------------------------------------------------- layer norm
@pytest.mark.parametrize("C", [200, 1100])  # one-pass backward (C <= 1024), and the two-pass one
def test_layernorm(be, prec, rng, C, accumulate):
    dt, tol = prec
    inp = rnd(rng, (B, T, C), dt, 2.0, 0.5)
    w, b = rnd(rng, (C,), dt, 0.5, 1.0), rnd(rng, (C,), dt, 0.1)
    out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))
    ref.k_layernorm_fwd(out, mean, rstd, inp, w, b)
    g_out, g_mean, g_rstd = nan_buf((B, T, C), dt), nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)
    be.k_layernorm_fwd(g_out, g_mean, g_rstd, dev(inp, dt), dev(w, dt), dev(b, dt))
    assert_close("k_layernorm_fwd out", host(g_out), out, tol)
    assert_close("k_layernorm_fwd mean", host(g_mean), mean, 1e-5)
    assert_close("k_layernorm_fwd rstd", host(g_rstd), rstd, 1e-5 if dt == np.float32 else 1e-3)

    dout = rnd(rng, (B, T, C), dt)
    dinp, dw, db = zeros_like64(inp, w, b)
    ref.k_layernorm_bwd(dinp, dw, db, dout, inp, w, mean, rstd)
    gi, gw, gb = Grad(rng, dinp, dt, accumulate), Grad(rng, dw, np.float32), Grad(rng, db, np.float32)
    be.k_layernorm_bwd(gi.d, gw.d, gb.d, dev(dout, dt), dev(inp, dt), dev(w, dt),
                       dev(mean, np.float32), dev(rstd, np.float32), accumulate=accumulate)
    gi.check("k_layernorm_bwd dinp", tol)
    gw.check("k_layernorm_bwd dweight", tol)
    gb.check("k_layernorm_bwd dbias", tol)


@pytest.mark.parametrize("N,Cq,dt_name,blocks", LN_BWD_SHAPES)
def test_layernorm_bwd_one_pass(be, rng, N, Cq, dt_name, blocks, monkeypatch, accumulate):
    """k_layernorm_bwd through the one-pass kernel and the in-order sums of its block partials:
    against the reference, the same bits on a second launch and on a graph replay; in both modes
    (dinp added into, or written)."""
    import cupy as cp
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    dt = np.dtype(dt_name)
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 3e-2}[dt_name]
    if blocks:
        use_tuning(monkeypatch, be, ln_blocks=blocks)
    inp = rnd(rng, (N, Cq), dt, 2.0, 0.5)
    w, b = rnd(rng, (Cq,), dt, 0.5, 1.0), rnd(rng, (Cq,), dt, 0.1)
    out, mean, rstd = np.zeros((N, Cq)), np.zeros(N), np.zeros(N)
    ref.k_layernorm_fwd(out, mean, rstd, inp, w, b)
    mean, rstd = mean.astype(np.float32).astype(np.float64), rstd.astype(np.float32).astype(np.float64)
    dout = rnd(rng, (N, Cq), dt)
    dinp, dw, db = zeros_like64(inp, w, b)
    ref.k_layernorm_bwd(dinp, dw, db, dout, inp, w, mean, rstd)
    args = [dev(x, y) for x, y in ((dout, dt), (inp, dt), (w, dt), (mean, np.float32), (rstd, np.float32))]
    gi, gw, gb = Grad(rng, dinp, dt, accumulate), Grad(rng, dw, np.float32), Grad(rng, db, np.float32)
    pre = [g.d.copy() for g in (gi, gw, gb)]
    launched = []
    launch = be.rt.launch
    monkeypatch.setattr(be.rt, "launch", lambda f, k, *a, **kw: (launched.append(k), launch(f, k, *a, **kw))[1])
    be.k_layernorm_bwd(gi.d, gw.d, gb.d, *args, accumulate=accumulate)
    assert launched == ["k_layernorm_bwd_fused", "k_colsum_final", "k_colsum_final"]
    gi.check("k_layernorm_bwd dinp", tol)
    gw.check("k_layernorm_bwd dweight", tol)
    gb.check("k_layernorm_bwd dbias", tol)
    first = [cp.asnumpy(g.d).view(np.uint8) for g in (gi, gw, gb)]
    reset = lambda: [g.d.data.copy_from_device(p.data, p.nbytes) for g, p in zip((gi, gw, gb), pre)]  # noqa: E731
    reset()
    be.k_layernorm_bwd(gi.d, gw.d, gb.d, *args, accumulate=accumulate)
    for name, g, f in zip(("dinp", "dweight", "dbias"), (gi, gw, gb), first):
        assert np.array_equal(cp.asnumpy(g.d).view(np.uint8), f), f"{name} differs on a second launch"
    graph = be.capture(lambda: be.k_layernorm_bwd(gi.d, gw.d, gb.d, *args, accumulate=accumulate))
    for _ in range(2):
        reset()
        graph.launch()
        be.synchronize()
        for name, g, f in zip(("dinp", "dweight", "dbias"), (gi, gw, gb), first):
            assert np.array_equal(cp.asnumpy(g.d).view(np.uint8), f), f"{name} differs on a graph replay"


@pytest.mark.parametrize("C", [C, 201])  # rows of 200 are whole 16-byte vectors (version 2), of 201 not
def test_residual_layernorm(be, prec, rng, C):
    """The fused residual add + layer norm: the same bits as k_residual_add then k_layernorm_fwd
    on the GPU, and the reference's values."""
    dt, tol = prec
    a, b = rnd(rng, (B, T, C), dt), rnd(rng, (B, T, C), dt)
    w, bias = rnd(rng, (C,), dt, 0.1, 1.0), rnd(rng, (C,), dt, 0.1)
    res, out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))
    ref.k_residual_layernorm_fwd(res, out, mean, rstd, a, b, w, bias)
    g = [nan_buf((B, T, C), dt), nan_buf((B, T, C), dt), nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)]
    ins = (dev(a, dt), dev(b, dt), dev(w, dt), dev(bias, dt))
    be.k_residual_layernorm_fwd(*g, *ins)
    for name, got, want in zip(("res", "out", "mean", "rstd"), g, (res, out, mean, rstd)):
        assert_close(f"k_residual_layernorm_fwd {name}", host(got), want, tol)
    s = [nan_buf((B, T, C), dt), nan_buf((B, T, C), dt), nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)]
    be.k_residual_add(s[0], ins[0], ins[1])
    be.k_layernorm_fwd(s[1], s[2], s[3], s[0], ins[2], ins[3])
    for x, y in zip(g, s):
        assert np.array_equal(host(x), host(y))

