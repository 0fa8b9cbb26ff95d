"""Programmatic dependent launch on the CPU (andrea/backends/cuda/pdl.py): which kernels may take
the attribute, how arguments are packed for cuLaunchKernelEx, and the driver structures' layout.
The launches themselves are GPU tests (test_cuda_engine.py test_pdl_same_bits, test_fp8_cuda.py
test_pdl_same_bits_t64)."""
import ctypes
import re

import numpy as np
import pytest

from andrea.backends.cuda.pdl import LaunchAttribute, LaunchConfig, pack_args, ready_kernels
from andrea.backends.cuda.runtime import kernel_source
from andrea.paths import KERNEL_DIR


def test_every_package_kernel_waits_first():
    """Every __global__ function of kernels/*.cu starts with pdl_wait(), so each may be launched
    with the attribute; a new kernel without it fails here."""
    for path in sorted(KERNEL_DIR.glob("*.cu")):
        text = path.read_text()
        n = len(re.findall(r"__global__", text))
        ready = ready_kernels(text)
        assert n > 0 and len(ready) == n, (path.name, n, sorted(ready))


def test_ready_kernels_reads_names_and_first_statements():
    text = """
extern "C" __global__ void __launch_bounds__(128, 2) k_a(float* x, int n) {
  pdl_wait();
  x[0] = n;
}
extern "C" __global__ void k_b(float* x) {
  x[0] = 1.f;  // reads before waiting: not ready
  pdl_wait();
}
template <int N> __global__ void k_c(float* x)
{

    pdl_wait();
}
__device__ void helper() { pdl_wait(); }
extern "C" __global__ void k_d(const float* w, float* y) {
  pdl_prefetch_wait(w + blockIdx.x * 64, 256);
  y[0] = w[0];
}
extern "C" __global__ void k_e(const float* w, float* y) {
  prefetch_l2(w);  // a hint of its own before the wait: not the accepted form
  pdl_wait();
}
"""
    assert ready_kernels(text) == {"k_a", "k_c", "k_d"}
    assert ready_kernels("") == frozenset()


def test_the_hopper_attention_kernels_are_ready():
    """attention_hopper.cu with attention.cu pasted in (how the Runtime reads it): its own kernels
    are found under their names."""
    ready = ready_kernels(kernel_source(KERNEL_DIR / "attention_hopper.cu"))
    assert {"k_attn_flash_fwd_fp8", "k_attn_flash_bwd_dq_fp8", "k_attn_flash_bwd_dkv_fp8"} <= ready, sorted(ready)


class FakeArray:
    """Stands for cupy.ndarray: pack_args passes data.ptr."""

    class data:
        ptr = 0x7F0000001000


def _bytes(kept):
    return [bytes(memoryview(k).cast("B")) if not isinstance(k, ctypes.c_void_p) else k.value for k in kept]


def test_pack_args_as_cupy_passes_them():
    args = (FakeArray(), np.int32(-3), np.float32(1.5), 7, 0.25, True, np.uint64(2**40 + 1))
    params, kept = pack_args(args, FakeArray)
    got = _bytes(kept)
    assert got[0] == FakeArray.data.ptr
    assert got[1:] == [np.int32(-3).tobytes(), np.float32(1.5).tobytes(), np.int64(7).tobytes(),
                       np.float64(0.25).tobytes(), np.bool_(True).tobytes(), np.uint64(2**40 + 1).tobytes()]
    # kernelParams[i] points at argument i's bytes
    assert [params[i] for i in range(len(args))] == [ctypes.addressof(k) for k in kept]


@pytest.mark.parametrize("bad", ["text", None, np.complex64(1), np.zeros(3)])
def test_pack_args_refuses_what_a_kernel_cannot_take(bad):
    with pytest.raises(TypeError, match="kernel argument 1"):
        pack_args((np.int32(1), bad), FakeArray)


def test_driver_structures_match_cuda_h():
    """CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value; CUlaunchConfig: seven
    unsigned ints, then the stream, the attributes and their count at 8-byte alignment."""
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.sharedMemBytes.offset, LaunchConfig.hStream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.numAttrs.offset) == (24, 32, 40, 48)
