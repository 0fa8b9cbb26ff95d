"""CUDA: what is no one op: host copies, the launchers' argument checks, the runtime arch against the NumPy reference, on the GPU (skipped without one); moved from tests/test_cuda_kernels.py.

    python -m pytest -m gpu tests/cuda/test_backend_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


def test_upload_and_download_async(be, rng):
    """The host copies the engine queues without waiting: many in flight, each sees its own data."""
    import cupy as cp

    from andrea.backends.cuda.backend import PINNED_DEPTH
    dst = cp.zeros((5, 7), cp.int32)
    srcs = [rng.integers(0, 1000, (5, 7)).astype(np.int32) for _ in range(2 * PINNED_DEPTH + 1)]
    pending = []
    for src in srcs:
        src = src.copy()
        be.upload(dst, src)
        src[...] = -1  # the caller may reuse its array at once
        pending.append(be.download_async(dst * 2))
    be.synchronize()
    for src, p in zip(srcs, pending):
        assert np.array_equal(p.get(), 2 * src)


def test_launcher_rejects_bad_arguments(be):
    import cupy as cp
    x = cp.zeros((2, 3, 8), cp.float32)
    with pytest.raises(TypeError, match="k_residual_add: b has dtype float16"):
        be.k_residual_add(x, x, x.astype(cp.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        be.k_residual_add(x, x, cp.zeros((2, 8, 3), cp.float32).transpose(0, 2, 1))


# ---------------------------------------------------------------- architecture-specific builds
def test_runtime_arch_sm90a(tmp_path):
    """Runtime.function(..., arch="sm_90a") builds through NVRTC for the architecture-specific target
    (what wgmma needs) and launches like any other kernel; the plain build of the same file does not
    see the sm_90a feature macro."""
    import cupy as cp
    from andrea.backends.cuda.runtime import Runtime
    if int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("sm_90a needs compute capability 9.0")
    src = tmp_path / "arch.cu"
    src.write_text('extern "C" __global__ void k_arch(int* out, int v) {\n'
                   "#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\n  out[0] = v;\n#else\n  out[0] = -v;\n#endif\n}\n")
    rt = Runtime(sources={"arch.cu": src})
    out = cp.zeros((1,), dtype=cp.int32)
    rt.launch("arch.cu", "k_arch", np.float32, 1, 1, (out, np.int32(7)), arch="sm_90a")
    assert int(out.get()[0]) == 7
    rt.launch("arch.cu", "k_arch", np.float32, 1, 1, (out, np.int32(7)))
    assert int(out.get()[0]) == -7

