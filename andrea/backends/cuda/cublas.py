"""cuBLAS through ctypes: one handle and its workspace, and a row-major GEMM.

Not CuPy's bindings, so that a whole step can be captured as one CUDA graph: the handle follows
CuPy's current stream and uses a workspace we allocate. A/B in the compute dtype, C in the
compute dtype or float32, float32 accumulation, TF32 off. `find_library` and `cuda_type` are
shared with sibling bindings of the same libraries (e.g. cuBLASLt).
"""
from __future__ import annotations

import ctypes

from .runtime import cp, ct_name

STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
          11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED"}
OP_N, OP_T = 0, 1  # cublasOperation_t
COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: float32 accumulation, TF32 only if the math mode asks (never)
GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT
CUBLAS_WORKSPACE = 32 << 20  # cuBLAS's recommended workspace size on Hopper


def cuda_type(dtype) -> int:
    """cudaDataType_t: CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14."""
    return {"float": 0, "f16": 2, "bf16": 14}[ct_name(dtype)]


def find_library(stem: str):
    """The library `stem` (e.g. "libcublas", "libcublasLt") that CuPy already loaded (same copy
    and version), else the usual sonames."""
    cp.cuda.device.get_cublas_handle()  # makes CuPy load its libcublas (and libcublasLt with it)
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if path.rsplit("/", 1)[-1].startswith(stem + ".so"):
                return ctypes.CDLL(path)
    for name in (f"{stem}.so.13", f"{stem}.so.12", f"{stem}.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"{stem} not found: CuPy loaded none and no {stem}.so.{{13,12}} is on the path")


def check_status(what, status):
    if status != 0:
        raise RuntimeError(f"{what} failed: CUBLAS_STATUS_{STATUS.get(status, status)}")


class Cublas:
    """One cuBLAS handle following CuPy's current stream, with a preallocated workspace.
    gemm() speaks row-major: C (M, N) = alpha op(A) op(B) + beta C."""

    def __init__(self):
        lib = self.lib = find_library("libcublas")
        vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        fp = ctypes.POINTER(ctypes.c_float)
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasSetMathMode.argtypes = [vp, i]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, fp, vp, i, i, vp, i, i, fp, vp, i, i, i, i]
        lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, fp, vp, i, i, ll, vp, i, i, ll,
                                                   fp, vp, i, i, ll, i, i, i]
        self.handle = vp()
        check_status("cublasCreate_v2", lib.cublasCreate_v2(ctypes.byref(self.handle)))
        check_status("cublasSetMathMode", lib.cublasSetMathMode(self.handle, 0))  # CUBLAS_DEFAULT_MATH
        self.workspace = cp.empty(CUBLAS_WORKSPACE, dtype=cp.uint8)
        self.stream = None
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def bind_stream(self):
        """Point the handle at CuPy's current stream (not allowed inside a graph capture, so
        capture calls it first). SetStream resets the workspace to cuBLAS's own pool, so ours
        is set again after it."""
        ptr = cp.cuda.get_current_stream().ptr
        if ptr != self.stream:
            check_status("cublasSetStream_v2", self.lib.cublasSetStream_v2(self.handle, ptr))
            check_status("cublasSetWorkspace_v2", self.lib.cublasSetWorkspace_v2(
                self.handle, self.workspace.data.ptr, CUBLAS_WORKSPACE))
            self.stream = ptr

    def gemm(self, C, A, B, trans_a, trans_b, M, N, K, lda, ldb, ldc, alpha=1.0, beta=0.0,
             batch=1, stride_a=0, stride_b=0, stride_c=0):
        """lda, ldb, ldc: row strides (elements) of A, B, C as stored; strides between batches."""
        self.bind_stream()
        if A.dtype != B.dtype:
            raise TypeError(f"gemm: A is {A.dtype} but B is {B.dtype}; both must be the compute dtype")
        ta, tb, tc = cuda_type(A.dtype), cuda_type(B.dtype), cuda_type(C.dtype)
        self.alpha.value, self.beta.value = alpha, beta
        op_a, op_b = (OP_T if trans_a else OP_N), (OP_T if trans_b else OP_N)
        # cuBLAS is column-major: compute C^T (N, M) = op(B)^T (N, K) @ op(A)^T (K, M)
        if batch == 1:
            st = self.lib.cublasGemmEx(self.handle, op_b, op_a, N, M, K, ctypes.byref(self.alpha),
                                       B.data.ptr, tb, ldb, A.data.ptr, ta, lda,
                                       ctypes.byref(self.beta), C.data.ptr, tc, ldc,
                                       COMPUTE_32F, GEMM_DEFAULT)
            check_status(f"cublasGemmEx (M={M} N={N} K={K} {A.dtype}->{C.dtype})", st)
        else:
            st = self.lib.cublasGemmStridedBatchedEx(
                self.handle, op_b, op_a, N, M, K, ctypes.byref(self.alpha),
                B.data.ptr, tb, ldb, stride_b, A.data.ptr, ta, lda, stride_a,
                ctypes.byref(self.beta), C.data.ptr, tc, ldc, stride_c, batch,
                COMPUTE_32F, GEMM_DEFAULT)
            check_status(f"cublasGemmStridedBatchedEx (batch={batch} M={M} N={N} K={K})", st)
