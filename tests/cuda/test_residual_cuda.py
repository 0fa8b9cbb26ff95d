"""CUDA: the residual add against the NumPy reference, on the GPU (skipped without one); moved from tests/test_cuda_kernels.py.

    python -m pytest -m gpu tests/cuda/test_residual_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref
from cudakit import B, C, Grad, T, assert_close, dev, host, nan_buf, rnd, zeros_like64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


# ---------------------------------------------------------------- residual
def test_residual(be, prec, rng):
    dt, tol = prec
    a, b = rnd(rng, (B, T, C), dt), rnd(rng, (B, T, C), dt)
    out = np.zeros((B, T, C))
    ref.k_residual_add(out, a, b)
    got = nan_buf((B, T, C), dt)
    be.k_residual_add(got, dev(a, dt), dev(b, dt))
    assert_close("k_residual_add out", host(got), out, tol)
    dout = rnd(rng, (B, T, C), dt)
    da, db = zeros_like64(a, b)
    ref.k_residual_add_bwd(da, db, dout)
    ga, gb = Grad(rng, da, dt), Grad(rng, db, dt)
    be.k_residual_add_bwd(ga.d, gb.d, dev(dout, dt))
    ga.check("k_residual_add_bwd da", tol)
    gb.check("k_residual_add_bwd db", tol)

