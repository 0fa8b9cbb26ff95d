"""CUDA: attention (version 1 and the fused kernels) against the NumPy reference, on the GPU (skipped without one); moved from tests/test_cuda_kernels.py.

    python -m pytest -m gpu tests/cuda/test_attention_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import cuda_available
from cudakit import B, C, FUSED_CASES, PREC, T, assert_fused_kernels, check_attention, dev, fused_path, nan_buf, rnd

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("n_head", [5, 8])  # head sizes 40 and 25: version 1 (scores materialised)
def test_attention(be, prec, rng, n_head, accumulate):
    check_attention(be, prec, rng, n_head, B, T, C, accumulate)


@pytest.mark.parametrize("prec_name,hopper", [("fp16", True), ("fp16", False), ("fp32", None)],
                         ids=["fp16-wgmma", "fp16-mma", "fp32"])  # float32 takes version 1 either way
@pytest.mark.parametrize("n_head,Tq,Cq", FUSED_CASES)
def test_attention_fused(be, prec_name, rng, n_head, Tq, Cq, accumulate, hopper, monkeypatch):
    prec, launched = PREC[prec_name], None
    if prec[0] == np.float16:
        assert be.attention_variant(np.float16, Cq // n_head) == "fused", "this case must exercise the fused kernels"
        launched = fused_path(be, monkeypatch, hopper, Cq // n_head)
    check_attention(be, prec, rng, n_head, 2, Tq, Cq, accumulate)
    if launched is not None:
        assert_fused_kernels(launched, hopper)


@pytest.mark.parametrize("hopper", [True, False], ids=["wgmma", "mma"])
@pytest.mark.parametrize("n_head,Tq,Cq", FUSED_CASES)
def test_attention_fused_bf16(be, rng, n_head, Tq, Cq, accumulate, hopper, monkeypatch):
    """bfloat16 through the same kernels (the mma instruction's bf16 form). Tolerance 3e-2: 8
    significant bits, ~4e-3 per rounding, over the chain S -> P -> dS -> dQ, dK."""
    import ml_dtypes
    assert be.attention_variant(ml_dtypes.bfloat16, Cq // n_head) == "fused"
    launched = fused_path(be, monkeypatch, hopper, Cq // n_head)
    check_attention(be, (ml_dtypes.bfloat16, 3e-2), rng, n_head, 2, Tq, Cq, accumulate)
    assert_fused_kernels(launched, hopper)


@pytest.mark.parametrize("hopper", [True, False], ids=["wgmma", "mma"])
@pytest.mark.parametrize("dt_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("n_head,Tq,Cq", [(2, 1000, 128), (1, 333, 128)])
def test_attention_fused_bitwise_rerun(be, rng, dt_name, n_head, Tq, Cq, hopper, monkeypatch):
    """The same inputs give the same bits, forward and backward (no atomics, fixed orders)."""
    import cupy as cp
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    dt = np.dtype(dt_name)
    assert be.attention_variant(dt, Cq // n_head) == "fused"
    launched = fused_path(be, monkeypatch, hopper, Cq // n_head)
    qkv, dout = dev(rnd(rng, (2, Tq, 3 * Cq), dt), dt), dev(rnd(rng, (2, Tq, Cq), dt), dt)
    pre = dev(rnd(rng, (2, Tq, 3 * Cq), dt), dt)
    runs = []
    for _ in range(2):
        out, lse = nan_buf((2, Tq, Cq), dt), nan_buf((2, n_head, Tq), np.float32)
        be.k_attn_fwd(out, lse, qkv, n_head)
        dqkv = pre.copy()
        be.k_attn_bwd(dqkv, dout, qkv, out, lse, n_head)
        runs.append([cp.asnumpy(a).view(np.uint8) for a in (out, lse, dqkv)])
    for name, a, b in zip(("out", "lse", "dqkv"), *runs):
        assert np.array_equal(a, b), f"{name} differs between two runs on the same inputs"
    # the write mode into NaN: the bits of adding into zeros (a zero result may differ in sign)
    added, written = cp.zeros_like(pre), nan_buf(pre.shape, dt)
    be.k_attn_bwd(added, dout, qkv, out, lse, n_head)
    be.k_attn_bwd(written, dout, qkv, out, lse, n_head, accumulate=False)
    a, w = cp.asnumpy(added).astype(np.float64), cp.asnumpy(written).astype(np.float64)
    assert np.array_equal(a, w), "dqkv written differs from dqkv added into zeros"
    assert_fused_kernels(launched, hopper)

