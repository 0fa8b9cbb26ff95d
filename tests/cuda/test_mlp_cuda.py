"""CUDA: the MLP against the NumPy reference, on the GPU (skipped without one); moved from tests/test_cuda_kernels.py.

    python -m pytest -m gpu tests/cuda/test_mlp_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref
from cudakit import B, C, Grad, T, assert_close, dev, host, lt_used, nan_buf, rnd, zeros_like64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


# ---------------------------------------------------------------- MLP
# (2, 77, 200): B*T*4C in whole 16-byte vectors, k_mlp_bwd_gelu's vector path; (1, 77, 201): not
@pytest.mark.parametrize("shape", [(B, T, C), (1, T, 201)])
def test_mlp(be, prec, rng, lt, shape, accumulate):
    dt, tol = prec
    b, t, c = shape
    H = 4 * c
    inp = rnd(rng, (b, t, c), dt)
    w1, b1 = rnd(rng, (H, c), dt, 0.07), rnd(rng, (H,), dt, 0.1)
    w2, b2 = rnd(rng, (c, H), dt, 0.035), rnd(rng, (c,), dt, 0.1)
    out, pre, act = np.zeros((b, t, c)), np.zeros((b, t, H)), np.zeros((b, t, H))
    ref.k_mlp_fwd(out, pre, act, inp, w1, b1, w2, b2)
    g_out, g_pre, g_act = nan_buf((b, t, c), dt), nan_buf((b, t, H), dt), nan_buf((b, t, H), dt)
    be.k_mlp_fwd(g_out, g_pre, g_act, dev(inp, dt), dev(w1, dt), dev(b1, dt), dev(w2, dt), dev(b2, dt))
    assert_close("k_mlp_fwd out", host(g_out), out, tol)
    assert_close("k_mlp_fwd pre", host(g_pre), pre, tol)
    assert_close("k_mlp_fwd act", host(g_act), act, tol)
    assert lt_used(be, "gelu_aux_bias") or not lt

    pre = pre.astype(dt).astype(np.float64)
    dout = rnd(rng, (b, t, c), dt)
    dinp, dw1, db1, dw2, db2 = zeros_like64(inp, w1, b1, w2, b2)
    ref.k_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, np.zeros_like(pre), np.zeros_like(pre))
    gs = [Grad(rng, dinp, dt, accumulate)] + [Grad(rng, x, np.float32) for x in (dw1, db1, dw2, db2)]
    be.k_mlp_bwd(*(g.d for g in gs), dev(dout, dt), dev(inp, dt), dev(pre, dt), dev(w1, dt),
                 dev(w2, dt), nan_buf((b, t, H), dt), nan_buf((b, t, H), dt), accumulate=accumulate)
    for g, n in zip(gs, ("dinp", "dw1", "db1", "dw2", "db2")):
        g.check(f"k_mlp_bwd {n}", tol)

