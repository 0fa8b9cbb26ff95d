"""CUDA backend: the kernels of kernels/*.cu launched through CuPy, matrix products on cuBLAS.

Same interface as numpy_ref (read its docstring): every k_* function has the same name, arguments
and meaning; forward kernels write, backward kernels ADD into every gradient buffer. Selected by
`get_backend("cuda")` (or "auto" on a GPU machine); needs CuPy (the cuda12 / cuda13 extra).

How it works:
- Each kernels/<op>.cu is compiled at run time by NVRTC (cupy.RawModule), once per compute dtype
  (-DCT=float|f16|bf16, picked from the arrays), and cached; kernels/common.cuh is pasted in
  before compiling so that CuPy's on-disk cache key covers it.
- Matrix products go to cuBLAS through ctypes (class Cublas), not CuPy's bindings, so that a
  whole step can later be captured as one CUDA graph (../shared/gpu/README.md says why).
  A/B in the compute dtype, C in the compute dtype or float32, float32 accumulation, TF32 off.
- Scratch memory the kernels need beyond their arguments (attention scores, head-major copies,
  column-sum partials, sort keys) lives in `WORKSPACE`: allocated on first use or by
  `reserve_workspace`, then reused; `workspace_rows` gives its size for the memory plan.
- Launchers check shapes, dtypes and contiguity before launching and raise naming the argument.

    python -m pytest -m gpu tests/test_cuda_kernels.py     # every kernel against numpy_ref
"""
from __future__ import annotations

import ctypes
import math

import cupy as cp
import numpy as np

from ..paths import KERNEL_DIR
from .numpy_ref import STATE_LEN

try:  # registers numpy's "bfloat16" dtype where ml_dtypes is installed (bf16 precision)
    import ml_dtypes  # noqa: F401
except ImportError:
    pass

NAME = "cuda"
xp = cp
GRAD_NORM_PARTIALS = 1024  # blocks of k_grad_norm_partial: enough to fill the GPU at 124M params
THREADS = 256
MAX_BLOCKS = 8192  # grid-stride kernels: enough blocks to fill 132 SMs, few enough to stay cheap
COLSUM_CHUNKS = 64  # row chunks of the two-pass column sums (bias and layer-norm gradients)
# Attention version 3 (fused, kernels/attention.cu) runs for 16-bit compute dtypes and these head
# sizes (tensor-core tiles of 16; 64 is the largest whose tiles fit 48 KB of shared memory);
# float32 and other head sizes take version 1 (scores materialised, cuBLAS). False forces v1.
# (Version 2, fused without cp.async, is in git history; see kernels/attention.cu.)
FLASH = True
LN_FUSED_MAXC = 1024  # widest row the one-pass layer-norm backward holds in registers
LN_BLOCKS = 264  # blocks (and partial rows) of the one-pass layer-norm backward: 2 per SM of an H200
FLASH_HEAD_SIZES = (16, 32, 48, 64)
# Matrix products with a fused epilogue through cuBLASLt (cublaslt.py): bias, bias + GELU saving the
# pre-activation, and the GELU gradient. False (or no algorithm for a problem) takes cuBLAS and
# the separate bias / GELU kernels instead.
LT = True


# ---------------------------------------------------------------- compilation and launching
_MODULES: dict = {}
_FUNCS: dict = {}


def _ct_name(dtype) -> str:
    dt = np.dtype(dtype)
    if dt == np.float32:
        return "float"
    if dt == np.float16:
        return "f16"
    if dt.name == "bfloat16":
        return "bf16"
    raise TypeError(f"compute dtype {dt}: expected float32, float16 or bfloat16")


def _source(fname: str) -> str:
    path = KERNEL_DIR / fname
    if not path.is_file():
        raise FileNotFoundError(f"{path}: kernel source missing (the CUDA backend reads the package's "
                                "kernels/; reinstall the package)")
    common = (KERNEL_DIR / "common.cuh").read_text()
    return path.read_text().replace('#include "common.cuh"', common)


def _fn(fname: str, kernel: str, dtype, defs=()):
    """The compiled kernel; defs are extra -D options (compile-time sizes, e.g. attention's HS)."""
    key = (fname, kernel, _ct_name(dtype), defs)
    f = _FUNCS.get(key)
    if f is None:
        mkey = (fname, key[2], defs)
        mod = _MODULES.get(mkey)
        if mod is None:
            opts = ("-std=c++17", f"-DCT={key[2]}") + tuple(defs)
            mod = _MODULES[mkey] = cp.RawModule(code=_source(fname), options=opts)
        f = _FUNCS[key] = mod.get_function(kernel)
    return f


def _launch(fname, kernel, dtype, grid, block, args, shared_mem=0, hs=None, defs=()):
    defs = tuple(defs) + ((f"-DHS={hs}",) if hs else ())
    _fn(fname, kernel, dtype, defs)(grid if isinstance(grid, tuple) else (grid,),
                                    block if isinstance(block, tuple) else (block,), args,
                                    shared_mem=shared_mem)


def _blocks(n: int, per_block: int = THREADS) -> int:
    return max(1, min(MAX_BLOCKS, -(-n // per_block)))


def _i32(x):
    return np.int32(x)


def _i64(x):
    return np.int64(x)


def _check(kernel: str, name: str, a, shape=None, dtype=None):
    """Raise a clear error unless a is a C-contiguous CuPy array of this shape and dtype."""
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{kernel}: {name} must be a CuPy array, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{kernel}: {name} must be C-contiguous (strides {a.strides})")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise TypeError(f"{kernel}: {name} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{kernel}: {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")


# ---------------------------------------------------------------- cuBLAS through ctypes
_STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
           11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED"}
OP_N, OP_T = 0, 1  # cublasOperation_t
COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: float32 accumulation, TF32 only if the math mode asks (never)
GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT
CUBLAS_WORKSPACE = 32 << 20  # cuBLAS's recommended workspace size on Hopper


def _cuda_type(dtype) -> int:
    """cudaDataType_t: CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14."""
    return {"float": 0, "f16": 2, "bf16": 14}[_ct_name(dtype)]


def _find_cublas():
    """The libcublas CuPy already loaded (same copy and version), else the usual sonames."""
    cp.cuda.device.get_cublas_handle()  # makes CuPy load its libcublas
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if path.rsplit("/", 1)[-1].startswith("libcublas.so"):
                return ctypes.CDLL(path)
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libcublas not found: CuPy loaded none and no libcublas.so.{13,12} is on the path")


class Cublas:
    """One cuBLAS handle following CuPy's current stream, with a preallocated workspace.
    gemm() speaks row-major: C (M, N) = alpha op(A) op(B) + beta C."""

    def __init__(self):
        lib = self.lib = _find_cublas()
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
        self._ok("cublasCreate_v2", lib.cublasCreate_v2(ctypes.byref(self.handle)))
        self._ok("cublasSetMathMode", lib.cublasSetMathMode(self.handle, 0))  # CUBLAS_DEFAULT_MATH
        self.workspace = cp.empty(CUBLAS_WORKSPACE, dtype=cp.uint8)
        self.stream = None
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(what, status):
        if status != 0:
            raise RuntimeError(f"{what} failed: CUBLAS_STATUS_{_STATUS.get(status, status)}")

    def _bind_stream(self):
        # SetStream resets the workspace to cuBLAS's own pool, so set ours again after it
        ptr = cp.cuda.get_current_stream().ptr
        if ptr != self.stream:
            self._ok("cublasSetStream_v2", self.lib.cublasSetStream_v2(self.handle, ptr))
            self._ok("cublasSetWorkspace_v2", self.lib.cublasSetWorkspace_v2(
                self.handle, self.workspace.data.ptr, CUBLAS_WORKSPACE))
            self.stream = ptr

    def gemm(self, C, A, B, trans_a, trans_b, M, N, K, lda, ldb, ldc, alpha=1.0, beta=0.0,
             batch=1, stride_a=0, stride_b=0, stride_c=0):
        """lda, ldb, ldc: row strides (elements) of A, B, C as stored; strides between batches."""
        self._bind_stream()
        if A.dtype != B.dtype:
            raise TypeError(f"gemm: A is {A.dtype} but B is {B.dtype}; both must be the compute dtype")
        ta, tb, tc = _cuda_type(A.dtype), _cuda_type(B.dtype), _cuda_type(C.dtype)
        self.alpha.value, self.beta.value = alpha, beta
        op_a, op_b = (OP_T if trans_a else OP_N), (OP_T if trans_b else OP_N)
        # cuBLAS is column-major: compute C^T (N, M) = op(B)^T (N, K) @ op(A)^T (K, M)
        if batch == 1:
            st = self.lib.cublasGemmEx(self.handle, op_b, op_a, N, M, K, ctypes.byref(self.alpha),
                                       B.data.ptr, tb, ldb, A.data.ptr, ta, lda,
                                       ctypes.byref(self.beta), C.data.ptr, tc, ldc,
                                       COMPUTE_32F, GEMM_DEFAULT)
            self._ok(f"cublasGemmEx (M={M} N={N} K={K} {A.dtype}->{C.dtype})", st)
        else:
            st = self.lib.cublasGemmStridedBatchedEx(
                self.handle, op_b, op_a, N, M, K, ctypes.byref(self.alpha),
                B.data.ptr, tb, ldb, stride_b, A.data.ptr, ta, lda, stride_a,
                ctypes.byref(self.beta), C.data.ptr, tc, ldc, stride_c, batch,
                COMPUTE_32F, GEMM_DEFAULT)
            self._ok(f"cublasGemmStridedBatchedEx (batch={batch} M={M} N={N} K={K})", st)


_CUBLAS = None
_LT = None


def _lt():
    """The cuBLASLt binding, or None where LT is off or it cannot be loaded."""
    global _LT
    if not LT:
        return None
    if _LT is None:
        from .cublaslt import CublasLt
        try:
            _LT = CublasLt()
        except OSError:
            _LT = False
    return _LT or None


def _lt_matmul(D, A, B, ta, tb, M, N, K, lda, ldb, ldd, epilogue, bias=None, aux=None, aux_ld=0):
    """One cuBLASLt product with its epilogue; False when it does not apply (the caller falls
    back): LT off, or cuBLASLt has no algorithm for the problem."""
    lt = _lt()
    # cuBLASLt's heuristic assumes 256-byte aligned matrices (the arena's views and CuPy's pool are)
    if lt is None or any(x.data.ptr % 256 for x in (D, A, B)):
        return False
    from .cublaslt import NoAlgorithm
    ab, d = _cuda_type(A.dtype), _cuda_type(D.dtype)
    try:
        lt.matmul(D, A, B, ta, tb, M, N, K, lda, ldb, ldd, ab, d, epilogue, bias=bias,
                  bias_type=_cuda_type(bias.dtype) if bias is not None else None, aux=aux, aux_ld=aux_ld)
    except NoAlgorithm:
        return False
    return True


def _blas() -> Cublas:
    global _CUBLAS
    if _CUBLAS is None:
        _CUBLAS = Cublas()
    return _CUBLAS


# ---------------------------------------------------------------- workspace
class Workspace:
    """Named scratch buffers, grown on demand (so only while the first step runs), then reused."""

    def __init__(self):
        self.bufs: dict = {}
        self.generation = 0  # counts (re)allocations: CUDA graphs hold the old addresses

    def get(self, name: str, n: int, dtype):
        dt = np.dtype(dtype)
        buf = self.bufs.get((name, dt.name))
        if buf is None or buf.size < n:
            self.bufs.pop((name, dt.name), None)
            buf = self.bufs[(name, dt.name)] = cp.empty(max(int(n), 1), dtype=dt)
            self.generation += 1
        return buf[:n]

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs.values())


WORKSPACE = Workspace()


def workspace_rows(B: int, T: int, C: int, n_head: int, act_dtype):
    """[(name, shape, dtype)] of the scratch the kernels take for one model shape: what
    reserve_workspace allocates, for the engine's memory plan."""
    act = np.dtype(act_dtype).name
    N, BH = B * T, B * n_head
    P = 1 << max(1, (N - 1).bit_length())
    if _flash(act_dtype, C // n_head):
        rows = [("attn_D", (BH * T,), "float32")]
    else:
        rows = [("attn_scores", (BH * T * T,), "float32"), ("attn_probs", (BH * T * T,), act),
                ("attn_heads", (3 * N * C,), act), ("attn_y", (N * C,), act),
                ("attn_dheads", (3 * N * C,), "float32")]
    rows += [("colsum_a", (max(COLSUM_CHUNKS * 4, LN_BLOCKS) * C,), "float32"),
             ("colsum_b", (max(COLSUM_CHUNKS * 4, LN_BLOCKS) * C,), "float32"),
             ("embed_keys", (P,), "uint32"), ("cublas", (CUBLAS_WORKSPACE,), "uint8")]
    if LT:
        from .cublaslt import WORKSPACE_BYTES
        rows.append(("cublaslt", (WORKSPACE_BYTES,), "uint8"))
    return rows


def reserve_workspace(B: int, T: int, C: int, n_head: int, act_dtype) -> int:
    """Allocate the workspace for this shape now (start-up), so the step loop allocates nothing.
    Returns the bytes held."""
    for name, shape, dtype in workspace_rows(B, T, C, n_head, act_dtype):
        if name not in ("cublas", "cublaslt"):
            WORKSPACE.get(name, shape[0], dtype)
    _blas()
    lt = _lt()
    return WORKSPACE.nbytes() + CUBLAS_WORKSPACE + (lt.workspace.nbytes if lt else 0)


def _colsum_add(out, x, N: int, Cc: int, slot="colsum_a"):
    """out (Cc,) float32 += column sums of x (N, Cc), in two fixed-order passes."""
    rpc = -(-N // COLSUM_CHUNKS)
    chunks = -(-N // rpc)
    part = WORKSPACE.get(slot, chunks * Cc, np.float32)
    _launch("linear.cu", "k_colsum_partial", x.dtype, (-(-Cc // 32), chunks), (32, 8),
            (part, x, _i64(N), _i32(Cc), _i32(rpc)))
    _launch("linear.cu", "k_colsum_final", x.dtype, -(-Cc // 8), THREADS,
            (out, part, _i32(chunks), _i32(Cc)))


# ---------------------------------------------------------------- embedding
def k_embed_fwd(out, tokens, wte, wpe):
    """out (B,T,C) = wte[tokens] + wpe[:T]; tokens (B,T) int32."""
    B, T = tokens.shape
    V, C = wte.shape
    ct = wte.dtype
    _check("k_embed_fwd", "tokens", tokens, dtype=np.int32)
    _check("k_embed_fwd", "wte", wte, dtype=ct)
    _check("k_embed_fwd", "wpe", wpe, dtype=ct)
    _check("k_embed_fwd", "out", out, (B, T, C), ct)
    if wpe.shape[0] < T or wpe.shape[1] != C:
        raise ValueError(f"k_embed_fwd: wpe has shape {wpe.shape}, needs at least ({T}, {C})")
    N = B * T
    _launch("embed.cu", "k_embed_fwd", ct, min(N, MAX_BLOCKS), THREADS,
            (out, tokens, wte, wpe, _i32(N), _i32(T), _i32(C), _i32(V)))


def k_embed_bwd(dwte, dwpe, dout, tokens):
    """dwte[tokens] += dout, dwpe[:T] += sum over batch of dout; no atomics (sorted tokens)."""
    B, T = tokens.shape
    V, C = dwte.shape
    ct = dout.dtype
    _check("k_embed_bwd", "tokens", tokens, dtype=np.int32)
    _check("k_embed_bwd", "dwte", dwte, dtype=np.float32)
    _check("k_embed_bwd", "dwpe", dwpe, dtype=np.float32)
    _check("k_embed_bwd", "dout", dout, (B, T, C))
    N = B * T
    shift = max(1, (N - 1).bit_length())
    if V << shift >= 1 << 32:
        raise ValueError(f"k_embed_bwd: vocab {V} with B*T={N} overflows the 32-bit sort key")
    P = 1 << shift
    keys = WORKSPACE.get("embed_keys", P, np.uint32)
    use_shared = P * 4 <= 48 * 1024
    _launch("embed.cu", "k_embed_sort", ct, 1, 1024,
            (keys, tokens, _i32(N), _i32(P), _i32(shift), _i32(int(use_shared))),
            shared_mem=P * 4 if use_shared else 0)
    _launch("embed.cu", "k_embed_bwd_wte", ct, (N, -(-C // 128)), 128,
            (dwte, keys, dout, _i32(N), _i32(C), _i32(shift)))
    _launch("embed.cu", "k_embed_bwd_wpe", ct, -(-(T * C) // THREADS), THREADS,
            (dwpe, dout, _i32(B), _i32(T), _i32(C)))


# ---------------------------------------------------------------- layer norm
def k_layernorm_fwd(out, mean, rstd, inp, weight, bias):
    """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T) float32."""
    C = inp.shape[-1]
    ct = inp.dtype
    for n, a in (("out", out), ("inp", inp)):
        _check("k_layernorm_fwd", n, a, inp.shape, ct)
    for n, a in (("weight", weight), ("bias", bias)):
        _check("k_layernorm_fwd", n, a, (C,), ct)
    for n, a in (("mean", mean), ("rstd", rstd)):
        _check("k_layernorm_fwd", n, a, inp.shape[:-1], np.float32)
    N = inp.size // C
    _launch("layernorm.cu", "k_layernorm_fwd", ct, -(-N // 8), THREADS,
            (out, mean, rstd, inp, weight, bias, _i64(N), _i32(C)))


def k_residual_layernorm_fwd(res, out, mean, rstd, a, b, weight, bias):
    """res = a + b (the residual stream), then out = layer norm of res, in one pass."""
    C = a.shape[-1]
    ct = a.dtype
    for n, x in (("res", res), ("out", out), ("a", a), ("b", b)):
        _check("k_residual_layernorm_fwd", n, x, a.shape, ct)
    for n, x in (("weight", weight), ("bias", bias)):
        _check("k_residual_layernorm_fwd", n, x, (C,), ct)
    for n, x in (("mean", mean), ("rstd", rstd)):
        _check("k_residual_layernorm_fwd", n, x, a.shape[:-1], np.float32)
    N = a.size // C
    _launch("layernorm.cu", "k_residual_layernorm_fwd", ct, -(-N // 8), THREADS,
            (res, out, mean, rstd, a, b, weight, bias, _i64(N), _i32(C)))


def k_layernorm_bwd(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    """Adds into dinp (B,T,C) (compute dtype), dweight, dbias (C,) float32."""
    C = inp.shape[-1]
    ct = inp.dtype
    for n, a in (("dinp", dinp), ("dout", dout), ("inp", inp)):
        _check("k_layernorm_bwd", n, a, inp.shape, ct)
    _check("k_layernorm_bwd", "weight", weight, (C,), ct)
    for n, a in (("dweight", dweight), ("dbias", dbias)):
        _check("k_layernorm_bwd", n, a, (C,), np.float32)
    for n, a in (("mean", mean), ("rstd", rstd)):
        _check("k_layernorm_bwd", n, a, inp.shape[:-1], np.float32)
    N = inp.size // C
    vec = 16 // inp.dtype.itemsize  # version 3 loads rows as whole 16-byte vectors
    if C <= LN_FUSED_MAXC and C % vec == 0 and all(a.data.ptr % 16 == 0 for a in (dinp, dout, inp, weight)):
        # version 3: one pass, block partials of dweight/dbias
        rpb = -(-N // LN_BLOCKS)
        blocks = -(-N // rpb)
        pdw = WORKSPACE.get("colsum_a", blocks * C, np.float32)
        pdb = WORKSPACE.get("colsum_b", blocks * C, np.float32)
        _launch("layernorm.cu", "k_layernorm_bwd_fused", ct, blocks, THREADS,
                (dinp, pdw, pdb, dout, inp, weight, mean, rstd, _i64(N), _i32(C), _i32(rpb)),
                defs=(f"-DLN_MAXC={-(-C // (32 * vec)) * 32 * vec}",))
    else:  # version 1: row pass for dinp, then column partials (version 2 is in git history)
        _launch("layernorm.cu", "k_layernorm_bwd_dx", ct, -(-N // 8), THREADS,
                (dinp, dout, inp, weight, mean, rstd, _i64(N), _i32(C)))
        rpb = -(-N // COLSUM_CHUNKS)
        blocks = -(-N // rpb)
        pdw = WORKSPACE.get("colsum_a", blocks * C, np.float32)
        pdb = WORKSPACE.get("colsum_b", blocks * C, np.float32)
        _launch("layernorm.cu", "k_layernorm_bwd_partial", ct, (-(-C // 32), blocks), (32, 8),
                (pdw, pdb, dout, inp, mean, rstd, _i64(N), _i32(C), _i32(rpb)))
    _launch("layernorm.cu", "k_colsum_final", ct, -(-C // 8), THREADS, (dweight, pdw, _i32(blocks), _i32(C)))
    _launch("layernorm.cu", "k_colsum_final", ct, -(-C // 8), THREADS, (dbias, pdb, _i32(blocks), _i32(C)))


# ---------------------------------------------------------------- linear layers (shared)
def _linear_fwd(kernel, out, inp, w, b, bias=True):
    """out (N, OC) = inp (N, IC) @ w (OC, IC).T (+ b)."""
    OC, IC = w.shape
    ct = w.dtype
    _check(kernel, "inp", inp, dtype=ct)
    _check(kernel, "w", w, dtype=ct)
    if inp.shape[-1] != IC:
        raise ValueError(f"{kernel}: inp has shape {inp.shape}, its last axis must be {IC}")
    N = inp.size // IC
    _check(kernel, "out", out, inp.shape[:-1] + (OC,), ct)
    if bias:
        _check(kernel, "b", b, (OC,), ct)
        if _lt_matmul(out, inp, w, False, True, N, OC, IC, IC, IC, OC, "bias", bias=b):
            return
    _blas().gemm(out, inp, w, False, True, N, OC, IC, IC, IC, OC)
    if bias:
        _launch("linear.cu", "k_bias_add", ct, min(N, MAX_BLOCKS), THREADS, (out, b, _i64(N), _i32(OC)))


def _linear_bwd(kernel, dinp, dw, db, dout, inp, w):
    """dinp (N, IC) += dout @ w; dw (OC, IC) += dout.T @ inp; db (OC,) += column sums of dout."""
    OC, IC = w.shape
    ct = w.dtype
    N = inp.size // IC
    _check(kernel, "inp", inp, dtype=ct)
    _check(kernel, "dinp", dinp, inp.shape, ct)
    _check(kernel, "dout", dout, inp.shape[:-1] + (OC,), ct)
    _check(kernel, "dw", dw, (OC, IC), np.float32)
    _check(kernel, "db", db, (OC,), np.float32)
    blas = _blas()
    blas.gemm(dinp, dout, w, False, False, N, IC, OC, OC, IC, IC, beta=1.0)
    blas.gemm(dw, dout, inp, True, False, OC, IC, N, OC, IC, IC, beta=1.0)
    _colsum_add(db, dout, N, OC)


def k_attn_qkv_fwd(qkv, inp, w, b):
    """qkv (B,T,3C) = inp (B,T,C) @ w (3C,C).T + b (3C,)."""
    _linear_fwd("k_attn_qkv_fwd", qkv, inp, w, b)


def k_attn_qkv_bwd(dinp, dw, db, dqkv, inp, w):
    """Adds into dinp (B,T,C), dw (3C,C), db (3C,)."""
    _linear_bwd("k_attn_qkv_bwd", dinp, dw, db, dqkv, inp, w)


# ---------------------------------------------------------------- attention
def _attn_shapes(kernel, qkv, n_head):
    _check(kernel, "qkv", qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    if C3 % 3 or C % n_head:
        raise ValueError(f"{kernel}: qkv last axis {C3} must be 3*C with C divisible by n_head={n_head}")
    return B, T, C, n_head, C // n_head


def k_attn_decode_fwd(out, kcache, vcache, qkv, pos, n_head):
    """One new position against the KV cache (inference only): writes its k, v into row pos of
    kcache, vcache (B,ctx,C), then out (B,1,C) = its causal attention over rows 0..pos."""
    B, T, C, NH, hs = _attn_shapes("k_attn_decode_fwd", qkv, n_head)
    ct = qkv.dtype
    if T != 1:
        raise ValueError(f"k_attn_decode_fwd: qkv has {T} positions, expected 1 (shape (B, 1, 3C))")
    ctx = kcache.shape[1] if kcache.ndim == 3 else 0
    _check("k_attn_decode_fwd", "kcache", kcache, (B, ctx, C), ct)
    _check("k_attn_decode_fwd", "vcache", vcache, (B, ctx, C), ct)
    _check("k_attn_decode_fwd", "out", out, (B, 1, C), ct)
    if not 0 <= pos < ctx:
        raise ValueError(f"k_attn_decode_fwd: pos {pos} outside the cache's {ctx} rows")
    _launch("decode.cu", "k_attn_decode_fwd", ct, (NH, B), 128,
            (out, kcache, vcache, qkv, _i32(NH), _i32(hs), _i32(ctx), _i32(pos), np.float32(1.0 / math.sqrt(hs))),
            shared_mem=4 * (ctx + hs + 32))


def _flash(dtype, hs, *arrays) -> bool:
    """Version 3 applies: 16-bit dtype, a supported head size, and every array 16-byte aligned
    (its tiles are copied 16 bytes at a time)."""
    return (FLASH and np.dtype(dtype) != np.float32 and hs in FLASH_HEAD_SIZES
            and all(a.data.ptr % 16 == 0 for a in arrays))


def _attn_scores(qkv, B, T, C, NH, hs):
    """Split heads and compute S = Q K^T / sqrt(hs) (float32 workspace). Returns q, k, v, S."""
    ct = qkv.dtype
    N, BH = B * T, B * NH
    heads = WORKSPACE.get("attn_heads", 3 * N * C, ct)
    q, k, v = heads[:N * C], heads[N * C:2 * N * C], heads[2 * N * C:]
    _launch("attention.cu", "k_attn_split_heads", ct, min(B * T, MAX_BLOCKS), THREADS,
            (q, k, v, qkv, _i32(B), _i32(T), _i32(NH), _i32(hs)))
    S = WORKSPACE.get("attn_scores", BH * T * T, np.float32)
    _blas().gemm(S, q, k, False, True, T, T, hs, hs, hs, T, alpha=1.0 / math.sqrt(hs),
                 batch=BH, stride_a=T * hs, stride_b=T * hs, stride_c=T * T)
    return q, k, v, S


def k_attn_fwd(out, lse, qkv, n_head):
    """Causal softmax(q k^T / sqrt(hs)) v into out (B,T,C); lse (B,NH,T) float32."""
    B, T, C, NH, hs = _attn_shapes("k_attn_fwd", qkv, n_head)
    ct = qkv.dtype
    _check("k_attn_fwd", "out", out, (B, T, C), ct)
    _check("k_attn_fwd", "lse", lse, (B, NH, T), np.float32)
    scale = np.float32(1.0 / math.sqrt(hs))
    if _flash(ct, hs, qkv, out):
        _launch("attention.cu", "k_attn_flash_fwd", ct, (-(-T // 64), B * NH), 128,
                (out, lse, qkv, _i32(B), _i32(T), _i32(NH), scale), hs=hs)
        return
    q, k, v, S = _attn_scores(qkv, B, T, C, NH, hs)
    BH = B * NH
    P = WORKSPACE.get("attn_probs", BH * T * T, ct)
    _launch("attention.cu", "k_attn_softmax", ct, -(-(BH * T) // 8), THREADS,
            (P, lse, S, _i64(BH * T), _i32(T), _i32(1)))
    y = WORKSPACE.get("attn_y", B * T * C, ct)
    _blas().gemm(y, P, v, False, False, T, hs, T, T, hs, hs,
                 batch=BH, stride_a=T * T, stride_b=T * hs, stride_c=T * hs)
    _launch("attention.cu", "k_attn_merge_heads", ct, min(B * T, MAX_BLOCKS), THREADS,
            (out, y, _i32(B), _i32(T), _i32(NH), _i32(hs)))


def k_attn_bwd(dqkv, dout, qkv, out, lse, n_head):
    """Adds into dqkv (B,T,3C); recomputes P from S and the saved lse."""
    B, T, C, NH, hs = _attn_shapes("k_attn_bwd", qkv, n_head)
    ct = qkv.dtype
    _check("k_attn_bwd", "dqkv", dqkv, qkv.shape, ct)
    _check("k_attn_bwd", "dout", dout, (B, T, C), ct)
    _check("k_attn_bwd", "out", out, (B, T, C), ct)
    _check("k_attn_bwd", "lse", lse, (B, NH, T), np.float32)
    blas, N, BH = _blas(), B * T, B * NH
    if _flash(ct, hs, dqkv, qkv, dout, out):
        scale = np.float32(1.0 / math.sqrt(hs))
        D = WORKSPACE.get("attn_D", BH * T, np.float32)
        _launch("attention.cu", "k_attn_flash_D", ct, -(-(BH * T) // 8), THREADS,
                (D, dout, out, _i32(B), _i32(T), _i32(NH)), hs=hs)
        for kernel in ("k_attn_flash_bwd_dq", "k_attn_flash_bwd_dkv"):
            _launch("attention.cu", kernel, ct, (-(-T // 64), BH), 128,
                    (dqkv, qkv, dout, lse, D, _i32(B), _i32(T), _i32(NH), scale), hs=hs)
        return
    q, k, v, S = _attn_scores(qkv, B, T, C, NH, hs)
    P = WORKSPACE.get("attn_probs", BH * T * T, ct)
    _launch("attention.cu", "k_attn_softmax", ct, -(-(BH * T) // 8), THREADS,
            (P, lse, S, _i64(BH * T), _i32(T), _i32(0)))
    dy = WORKSPACE.get("attn_y", N * C, ct)
    _launch("attention.cu", "k_attn_split_dout", ct, min(B * T, MAX_BLOCKS), THREADS,
            (dy, dout, _i32(B), _i32(T), _i32(NH), _i32(hs)))
    dh = WORKSPACE.get("attn_dheads", 3 * N * C, np.float32)
    dq, dk, dv = dh[:N * C], dh[N * C:2 * N * C], dh[2 * N * C:]
    th, tt = T * hs, T * T
    blas.gemm(dv, P, dy, True, False, T, hs, T, T, hs, hs, batch=BH, stride_a=tt, stride_b=th, stride_c=th)
    blas.gemm(S, dy, v, False, True, T, T, hs, hs, hs, T, batch=BH, stride_a=th, stride_b=th, stride_c=tt)
    _launch("attention.cu", "k_attn_dscores", ct, -(-(BH * T) // 8), THREADS,
            (P, S, dout, out, _i64(BH * T), _i32(T), _i32(NH), _i32(hs), np.float32(1.0 / math.sqrt(hs))))
    blas.gemm(dq, P, k, False, False, T, hs, T, T, hs, hs, batch=BH, stride_a=tt, stride_b=th, stride_c=th)
    blas.gemm(dk, P, q, True, False, T, hs, T, T, hs, hs, batch=BH, stride_a=tt, stride_b=th, stride_c=th)
    _launch("attention.cu", "k_attn_merge_grads", ct, min(B * T, MAX_BLOCKS), THREADS,
            (dqkv, dq, dk, dv, _i32(B), _i32(T), _i32(NH), _i32(hs)))


def k_attn_out_fwd(out, inp, w, b):
    """out (B,T,C) = inp (B,T,C) @ w (C,C).T + b: the output projection W_O."""
    _linear_fwd("k_attn_out_fwd", out, inp, w, b)


def k_attn_out_bwd(dinp, dw, db, dout, inp, w):
    """Adds into dinp (B,T,C), dw (C,C), db (C,)."""
    _linear_bwd("k_attn_out_bwd", dinp, dw, db, dout, inp, w)


# ---------------------------------------------------------------- MLP
def k_mlp_fwd(out, pre, act, inp, w1, b1, w2, b2):
    """out (B,T,C) = gelu_tanh(inp @ w1.T + b1) @ w2.T + b2; saves pre (B,T,4C); act workspace."""
    H, C = w1.shape
    ct = w1.dtype
    _check("k_mlp_fwd", "pre", pre, inp.shape[:-1] + (H,), ct)
    _check("k_mlp_fwd", "act", act, pre.shape, ct)
    _check("k_mlp_fwd", "b1", b1, (H,), ct)
    _check("k_mlp_fwd", "w2", w2, (C, H), ct)
    _check("k_mlp_fwd", "inp", inp, dtype=ct)
    N = inp.size // C
    # cuBLASLt: act = gelu(inp @ w1.T + b1) with pre saved by the epilogue, in one product
    if not _lt_matmul(act, inp, w1, False, True, N, H, C, C, C, H, "gelu_aux_bias", bias=b1,
                      aux=pre, aux_ld=H):
        _linear_fwd("k_mlp_fwd", pre, inp, w1, None, bias=False)
        _launch("mlp.cu", "k_mlp_bias_gelu", ct, min(N, MAX_BLOCKS), THREADS, (pre, act, b1, _i64(N), _i32(H)))
    _linear_fwd("k_mlp_fwd", out, act, w2, b2)


def k_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact):
    """Adds into dinp, dw1 (4C,C), db1, dw2 (C,4C), db2. act, dact (B,T,4C) are workspace."""
    H, C = w1.shape
    ct = w1.dtype
    for n, a in (("pre", pre), ("act", act), ("dact", dact)):
        _check("k_mlp_bwd", n, a, inp.shape[:-1] + (H,), ct)
    _check("k_mlp_bwd", "w2", w2, (C, H), ct)
    _check("k_mlp_bwd", "dout", dout, inp.shape, ct)
    _check("k_mlp_bwd", "dw2", dw2, (C, H), np.float32)
    _check("k_mlp_bwd", "db2", db2, (C,), np.float32)
    N = inp.size // C
    _launch("mlp.cu", "k_mlp_gelu", ct, _blocks(N * H), THREADS, (act, pre, _i64(N * H)))
    blas = _blas()
    blas.gemm(dw2, dout, act, True, False, C, H, N, C, H, H, beta=1.0)
    _colsum_add(db2, dout, N, C)
    # dact = (dout @ w2) * gelu'(pre) (overwrites): one cuBLASLt product with its epilogue
    if not _lt_matmul(dact, dout, w2, False, False, N, H, C, C, H, H, "dgelu", aux=pre, aux_ld=H):
        blas.gemm(dact, dout, w2, False, False, N, H, C, C, H, H)
        _launch("mlp.cu", "k_mlp_gelu_bwd", ct, _blocks(N * H), THREADS, (dact, pre, _i64(N * H)))
    _linear_bwd("k_mlp_bwd", dinp, dw1, db1, dact, inp, w1)


# ---------------------------------------------------------------- residual
def k_residual_add(out, a, b):
    """out = a + b."""
    for n, x in (("out", out), ("a", a), ("b", b)):
        _check("k_residual_add", n, x, a.shape, a.dtype)
    _launch("residual.cu", "k_residual_add", a.dtype, _blocks(a.size), THREADS, (out, a, b, _i64(a.size)))


def k_residual_add_bwd(da, db, dout):
    """da += dout, db += dout."""
    for n, x in (("da", da), ("db", db), ("dout", dout)):
        _check("k_residual_add_bwd", n, x, dout.shape, dout.dtype)
    _launch("residual.cu", "k_residual_add_bwd", dout.dtype, _blocks(dout.size), THREADS,
            (da, db, dout, _i64(dout.size)))


# ---------------------------------------------------------------- loss
def _loss_checks(kernel, losses, lse, logits, inp, wte, targets):
    """Checks, and flat row views: x (N, C), targets, losses, lse (N,), logits as (R, V)."""
    V, C = wte.shape
    B, T = targets.shape
    ct = wte.dtype
    _check(kernel, "targets", targets, dtype=np.int32)
    _check(kernel, "losses", losses, (B, T), np.float32)
    _check(kernel, "lse", lse, (B, T), np.float32)
    _check(kernel, "logits", logits, dtype=ct)
    if logits.size % V or logits.size == 0:
        raise ValueError(f"{kernel}: logits has shape {logits.shape}; expected (R, {V}) rows of the vocab")
    _check(kernel, "inp", inp, (B, T, C), ct)
    _check(kernel, "wte", wte, dtype=ct)
    N = B * T
    return (inp.reshape(N, C), targets.reshape(N), losses.reshape(N), lse.reshape(N),
            logits.reshape(-1, V), N, V, C, ct)


def k_loss_fwd(losses, lse, logits, inp, wte, targets):
    """Writes losses, lse (B,T); logits (R, V) is workspace: chunks of R rows of inp @ wte.T."""
    x, tg, lf, lsef, z_all, N, V, C, ct = _loss_checks("k_loss_fwd", losses, lse, logits, inp, wte, targets)
    R = z_all.shape[0]
    for r0 in range(0, N, R):
        n = min(R, N - r0)
        z = z_all[:n]
        _blas().gemm(z, x[r0:r0 + n], wte, False, True, n, V, C, C, C, V)
        _launch("loss.cu", "k_loss_fwd", ct, n, 512,
                (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], _i64(n), _i32(V)))


def k_loss_bwd(losses, lse, dinp, dwte, logits, inp, wte, targets, dloss):
    """The fused classifier (numpy_ref.k_loss_bwd): per chunk of R rows the logits product, loss,
    lse and dlogits in place, then dinp (B,T,C) += dlogits @ wte and dwte (V,C) += dlogits.T @ inp.
    dloss: a float, or a (1,) float32 device array read when the kernel runs."""
    x, tg, lf, lsef, z_all, N, V, C, ct = _loss_checks("k_loss_bwd", losses, lse, logits, inp, wte, targets)
    _check("k_loss_bwd", "dinp", dinp, inp.shape, ct)
    _check("k_loss_bwd", "dwte", dwte, (V, C), np.float32)
    if isinstance(dloss, cp.ndarray):
        _check("k_loss_bwd", "dloss", dloss, (1,), np.float32)
        dl = (dloss, np.float32(0))
    else:
        dl = (np.uint64(0), np.float32(dloss))
    blas, dx, R = _blas(), dinp.reshape(N, C), z_all.shape[0]
    for r0 in range(0, N, R):
        n = min(R, N - r0)
        z = z_all[:n]
        blas.gemm(z, x[r0:r0 + n], wte, False, True, n, V, C, C, C, V)
        _launch("loss.cu", "k_loss_bwd", ct, n, 512,
                (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], _i64(n), _i32(V)) + dl)
        blas.gemm(dx[r0:r0 + n], z, wte, False, False, n, C, V, V, C, C, beta=1.0)
        blas.gemm(dwte, z, x[r0:r0 + n], True, False, V, C, n, V, C, C, beta=1.0)


# ---------------------------------------------------------------- clipping and the optimizer
def k_grad_norm_partial(partials, grads):
    """partials[i] = sum of squares of the i-th of len(partials) equal chunks of grads."""
    _check("k_grad_norm_partial", "partials", partials, dtype=np.float32)
    _check("k_grad_norm_partial", "grads", grads, dtype=np.float32)
    _launch("optim.cu", "k_grad_norm_partial", np.float32, partials.shape[0], THREADS,
            (partials, grads, _i64(grads.size)))


def k_loss_accum(state, losses):
    """state[S_LOSS_SUM] += sum of losses in float64 (one block)."""
    _check("k_loss_accum", "state", state, (STATE_LEN,), np.float64)
    _check("k_loss_accum", "losses", losses, dtype=np.float32)
    _launch("optim.cu", "k_loss_accum", np.float32, 1, 1024, (state, losses, _i64(losses.size)))


def k_step_check(state, dloss, partials, n_micro, n_pos, beta1, beta2, weight_decay, max_norm,
                 fp16, growth_interval, max_scale):
    """The end-of-step bookkeeping of numpy_ref.k_step_check, by one device thread."""
    _check("k_step_check", "state", state, (STATE_LEN,), np.float64)
    _check("k_step_check", "dloss", dloss, (1,), np.float32)
    _check("k_step_check", "partials", partials, dtype=np.float32)
    f64 = np.float64
    _launch("optim.cu", "k_step_check", np.float32, 1, 32,
            (state, dloss, partials, _i32(partials.size), _i32(n_micro), f64(n_pos), f64(beta1),
             f64(beta2), f64(weight_decay), f64(max_norm), _i32(int(bool(fp16))),
             f64(growth_interval), f64(max_scale)))


def k_adamw_step(params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay):
    """Clip + AdamW + cast + zeroing of grads in one pass, as numpy_ref.k_adamw_step."""
    for n, a in (("params", params), ("grads", grads), ("m", m), ("v", v)):
        _check("k_adamw_step", n, a, params.shape, np.float32)
    _check("k_adamw_step", "state", state, (STATE_LEN,), np.float64)
    cast = params_c is not None and params_c is not params
    if cast:
        _check("k_adamw_step", "params_c", params_c, params.shape)
    pc = params_c if cast else params
    f32 = np.float32
    _launch("optim.cu", "k_adamw_step", pc.dtype, _blocks(params.size), THREADS,
            (params, pc, grads, m, v, state, _i64(params.size), _i64(n_decay), f32(beta1),
             f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2), f32(eps), _i32(int(cast))))


def k_cast_params(dst, src):
    """dst (compute dtype) = src (float32 master weights), a flat copy."""
    _check("k_cast_params", "src", src, dtype=np.float32)
    _check("k_cast_params", "dst", dst, src.shape)
    _launch("optim.cu", "k_cast_params", dst.dtype, _blocks(src.size), THREADS, (dst, src, _i64(src.size)))


# ---------------------------------------------------------------- CUDA graphs of whole passes
class GraphRunner:
    """Runs a function of backend kernels as a CUDA graph: the first call with a key runs it
    eagerly (compiles modules, allocates the workspace, creates the cuBLAS handle), the second
    captures it on a private stream and launches the graph, later calls only launch it. The graph
    runs on the caller's current stream, so uploads queued there before it are seen.
    A key must stand for everything the function bakes in (array addresses, host scalars); the
    workspace's addresses are tracked here: when it grows, graphs made before run eagerly again."""

    MAX_GRAPHS = 8  # e.g. one per loss scale seen; older ones are dropped

    def __init__(self):
        self.graphs: dict = {}  # key -> (graph, workspace generation)
        self.seen: dict = {}  # key -> workspace generation of its eager run
        self.stream = None

    def run(self, key, fn):
        gen = WORKSPACE.generation
        entry = self.graphs.get(key)
        if entry is not None and entry[1] == gen:
            entry[0].launch(stream=cp.cuda.get_current_stream())
            return
        if self.seen.get(key) != gen:  # new key, or the workspace moved: eager run first
            fn()
            self.seen[key] = WORKSPACE.generation
            return
        if self.stream is None:
            self.stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.get_current_stream().synchronize()
        with self.stream:
            _blas()._bind_stream()  # cuBLAS handle set-up is not allowed inside a capture
            self.stream.begin_capture()
            try:
                fn()
            finally:
                g = self.stream.end_capture()
        if len(self.graphs) >= self.MAX_GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        self.graphs[key] = (g, gen)
        g.launch(stream=cp.cuda.get_current_stream())


GRAPHS = GraphRunner()


def run_graph(key, fn):
    """fn() (backend kernels only: no host syncs, no allocation) replayed as a CUDA graph; see
    GraphRunner. Used by the engine for the forward + backward pass of a microbatch."""
    GRAPHS.run(key, fn)


# ---------------------------------------------------------------- host utilities (not kernels)
PINNED_DEPTH = 4  # steps the host may run ahead of the device through upload / download_async


class _Pinned:
    """PINNED_DEPTH page-locked host buffers of one shape and dtype, used in turn, each with the
    event of the copy that last used it: a buffer is reused only once that copy has completed (and
    a download still unread has been read out), so asynchronous copies never see it change."""

    def __init__(self, shape, dtype):
        import cupyx
        self.bufs = [cupyx.empty_pinned(shape, dtype) for _ in range(PINNED_DEPTH)]
        self.events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(PINNED_DEPTH)]
        self.owners = [None] * PINNED_DEPTH
        self.i = 0

    def take(self, owner=None):
        i = self.i
        self.i = (i + 1) % PINNED_DEPTH
        if self.owners[i] is not None:
            self.owners[i].get()  # reads it out before the buffer is reused
        self.events[i].synchronize()
        self.owners[i] = owner
        return self.bufs[i], self.events[i]


_RINGS: dict = {}


def _ring(kind, a) -> _Pinned:
    key = (kind, tuple(a.shape), a.dtype.name)
    ring = _RINGS.get(key)
    if ring is None:
        ring = _RINGS[key] = _Pinned(a.shape, a.dtype)
    return ring


def upload(dst, src):
    """dst (a device array) = src (host), queued on the current stream: the host does not wait
    for the device (src is copied to a pinned buffer first, so the caller may reuse it at once)."""
    buf, ev = _ring("up", dst).take()
    buf[...] = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)
    stream = cp.cuda.get_current_stream()
    dst.data.copy_from_host_async(ctypes.c_void_p(buf.ctypes.data), dst.nbytes, stream)
    ev.record(stream)


class Pending:
    """A device-to-host copy in flight; get() waits for it (once) and returns the host array."""

    def __init__(self, src):
        self.value = None
        self.buf, self.event = _ring("down", src).take(self)
        stream = cp.cuda.get_current_stream()
        src.data.copy_to_host_async(ctypes.c_void_p(self.buf.ctypes.data), src.nbytes, stream)
        self.event.record(stream)

    def get(self):
        if self.value is None:
            self.event.synchronize()
            self.value = self.buf.copy()
        return self.value


def download_async(a) -> Pending:
    """Queue a copy of device array a to the host on the current stream; .get() returns it."""
    _check("download_async", "a", a)
    return Pending(a)


def to_numpy(a):
    """A host NumPy copy of a device array (waits for the work that writes it)."""
    return cp.asnumpy(a)


def synchronize():
    """Wait for all work queued on the current stream."""
    cp.cuda.get_current_stream().synchronize()
