"""cuBLASLt through ctypes: matrix products with a fused epilogue (bias; bias + GELU saving the
pre-activation; the GELU gradient), for the CUDA backend's linear layers and MLP.

Like the cuBLAS binding (cublas.Cublas), everything that is not a launch happens outside a CUDA-graph
capture: the handle, the workspace, and per problem (shape, transposes, dtypes, epilogue) one
matmul descriptor, four matrix layouts and the algorithm cuBLASLt's heuristic picks, cached. A call
only sets the descriptor's pointer attributes (host memory) and launches cublasLtMatmul on the
current stream, so it captures and replays.

Row-major convention as Cublas.gemm: D (M, N) = epilogue(op(A) (M, K) @ op(B) (K, N) [+ bias (N,)]).
cuBLASLt is column-major, so it computes D^T = op(B)^T op(A)^T: a bias over D's columns is a bias
over the rows of D^T, which is what cuBLASLt's epilogues broadcast. The GELU is the tanh form.

FP8 products (train.precision=fp8, cuda/fp8/): A and B in CUDA_R_8F_E4M3 / CUDA_R_8F_E5M2
(not both E5M2), each with a device pointer to its float32 scale that cuBLASLt multiplies the
product by; cuBLASLt wants them in its "TN" form, both operands contiguous along K, which in our
row-major convention is D = A @ B.T (ta=False, tb=True). D (and C, for beta) in bf16 or float32.
"""
from __future__ import annotations

import ctypes

from .cublas import find_library
from .runtime import cp

# cublasLtMatmulDescAttributes_t
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
DESC_AUX_POINTER, DESC_AUX_LD, DESC_BIAS_DATA_TYPE = 11, 12, 26
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 17, 18, 25
PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtEpilogue_t
EPILOGUES = {"none": 1, "bias": 4, "gelu_aux_bias": 164}
COMPUTE_32F, SCALE_32F = 68, 0
WORKSPACE_BYTES = 32 << 20


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (64 opaque bytes) and what it needs."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves_count", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


class NoAlgorithm(RuntimeError):
    """cuBLASLt has no algorithm for this problem (the caller falls back to cuBLAS + kernels)."""


class CublasLt:
    """One cuBLASLt handle, a preallocated workspace and the cache of planned problems."""

    def __init__(self):
        lib = self.lib = find_library("libcublasLt")
        vp, i, sz, u64, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int64
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i, i]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i, u64, u64, i64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i, vp, sz]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i,
                                                       ctypes.POINTER(_Heuristic), ctypes.POINTER(i)]
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
        self.handle = vp()
        self._ok("cublasLtCreate", lib.cublasLtCreate(ctypes.byref(self.handle)))
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
        self.pref = vp()
        self._ok("cublasLtMatmulPreferenceCreate", lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)))
        ws = ctypes.c_size_t(WORKSPACE_BYTES)
        self._ok("cublasLtMatmulPreferenceSetAttribute", lib.cublasLtMatmulPreferenceSetAttribute(
            self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), ctypes.sizeof(ws)))
        self.plans: dict = {}
        self.failed: set = set()  # problems without an algorithm (asked once; the caller falls back)
        self.ran: set = set()  # problems that ran once
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(what, status):
        if status != 0:
            raise RuntimeError(f"{what} failed: cuBLASLt status {status}")

    def _set(self, desc, attr, value):
        self._ok(f"cublasLtMatmulDescSetAttribute({attr})", self.lib.cublasLtMatmulDescSetAttribute(
            desc, attr, ctypes.byref(value), ctypes.sizeof(value)))

    def _layout(self, dtype, rows, cols, ld):
        lay = ctypes.c_void_p()
        self._ok("cublasLtMatrixLayoutCreate", self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(lay), dtype, rows, cols, ld))
        return lay

    def plan(self, key, ta, tb, M, N, K, lda, ldb, ldd, ab_type, d_type, epilogue, bias_type, aux_ld,
             bias_ptr, aux_ptr, b_type=None, scales=None, fast_accum=False):
        """The descriptor, layouts and algorithm of one problem (made once, outside any capture;
        the heuristic sees example pointers for their alignment). b_type: B's type where it is
        not A's (FP8); scales: (A's, B's) scale pointers (FP8)."""
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        if key in self.failed:
            raise NoAlgorithm(f"cuBLASLt: no algorithm for M={M} N={N} K={K} epilogue {epilogue} (asked before)")
        b_type = ab_type if b_type is None else b_type
        desc = ctypes.c_void_p()
        self._ok("cublasLtMatmulDescCreate", self.lib.cublasLtMatmulDescCreate(
            ctypes.byref(desc), COMPUTE_32F, SCALE_32F))
        # column-major: D^T (N, M) = op(B)^T (N, K) @ op(A)^T (K, M); "B" of cuBLASLt is our A
        self._set(desc, DESC_TRANSA, ctypes.c_int32(1 if tb else 0))
        self._set(desc, DESC_TRANSB, ctypes.c_int32(1 if ta else 0))
        self._set(desc, DESC_EPILOGUE, ctypes.c_uint32(EPILOGUES[epilogue]))
        if bias_type is not None:
            self._set(desc, DESC_BIAS_DATA_TYPE, ctypes.c_int32(bias_type))
            self._set(desc, DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        if aux_ld:
            self._set(desc, DESC_AUX_LD, ctypes.c_int64(aux_ld))
            self._set(desc, DESC_AUX_POINTER, ctypes.c_void_p(aux_ptr))
        if scales is not None:  # cuBLASLt's A is our B and its B our A
            self._set(desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(scales[1]))
            self._set(desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(scales[0]))
            self._set(desc, DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0))
        # the stored matrices seen column-major (rows, cols, ld = our row stride): row-major B
        # (K, N) is (N x K), transposed (N, K) is (K x N); likewise A; D (M, N) is (N x M)
        lay_b = self._layout(b_type, *((K, N) if tb else (N, K)), ldb)
        lay_a = self._layout(ab_type, *((M, K) if ta else (K, M)), lda)
        lay_d = self._layout(d_type, N, M, ldd)
        res, count = _Heuristic(), ctypes.c_int(0)
        st = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, lay_b, lay_a, lay_d, lay_d,
                                                     self.pref, 1, ctypes.byref(res), ctypes.byref(count))
        if st != 0 or count.value < 1 or res.state != 0:
            self.failed.add(key)
            raise NoAlgorithm(f"cuBLASLt: no algorithm for M={M} N={N} K={K} epilogue {epilogue} "
                              f"(status {st}, {count.value} found)")
        plan = self.plans[key] = (desc, lay_b, lay_a, lay_d, res)
        return plan

    def matmul(self, D, A, B, ta, tb, M, N, K, lda, ldb, ldd, ab_type, d_type, epilogue="none",
               bias=None, bias_type=None, aux=None, aux_ld=0, beta=0.0, b_type=None, scales=None,
               fast_accum=False):
        """D (M, N) = epilogue(op(A) @ op(B) [+ bias]) (+ beta D). aux: the GELU pre-activation
        (written by gelu_aux_bias), row-major (M, N) with row stride aux_ld.
        FP8: b_type B's type (A's is ab_type), scales (A's, B's) float32 (1,) device arrays that
        multiply the product, fast_accum cuBLASLt's faster, less precise FP8 accumulation."""
        bias_ptr = bias.data.ptr if bias is not None else 0
        aux_ptr = aux.data.ptr if aux is not None else 0
        scale_ptrs = None if scales is None else tuple(s.data.ptr for s in scales)
        # the algorithm suits the alignment of the pointers it was picked with: a plan per class
        align = tuple(min(256, p & -p) if p else 0 for p in (bias_ptr, aux_ptr))
        key = (ta, tb, M, N, K, lda, ldb, ldd, ab_type, d_type, epilogue, bias_type, aux_ld, align, b_type,
               scales is not None, bool(fast_accum))
        desc, lay_b, lay_a, lay_d, res = self.plan(key, ta, tb, M, N, K, lda, ldb, ldd, ab_type,
                                                   d_type, epilogue, bias_type, aux_ld, bias_ptr, aux_ptr,
                                                   b_type, scale_ptrs, fast_accum)
        if bias is not None:
            self._set(desc, DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        if aux is not None:
            self._set(desc, DESC_AUX_POINTER, ctypes.c_void_p(aux_ptr))
        if scale_ptrs is not None:
            self._set(desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(scale_ptrs[1]))
            self._set(desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(scale_ptrs[0]))
        self.beta.value = beta
        st = self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self.alpha), ctypes.c_void_p(B.data.ptr), lay_b,
            ctypes.c_void_p(A.data.ptr), lay_a, ctypes.byref(self.beta), ctypes.c_void_p(D.data.ptr),
            lay_d, ctypes.c_void_p(D.data.ptr), lay_d, ctypes.byref(res.algo),
            ctypes.c_void_p(self.workspace.data.ptr), WORKSPACE_BYTES,
            ctypes.c_void_p(cp.cuda.get_current_stream().ptr))
        if st != 0 and key not in self.ran:  # refused on its first run: as good as no algorithm
            del self.plans[key]
            self.failed.add(key)
            raise NoAlgorithm(f"cuBLASLt refused M={M} N={N} K={K} epilogue {epilogue} (status {st})")
        self._ok(f"cublasLtMatmul (M={M} N={N} K={K} epilogue {epilogue})", st)
        self.ran.add(key)
