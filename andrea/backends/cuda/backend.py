"""CudaBackend: the backend interface (andrea/backends/interface.py) on one CUDA GPU.

One object per engine. It holds what its kernels need and nothing global: the compiled modules
(runtime.Runtime), the cuBLAS handle (cublas.Cublas, created on first use), the attention path
chosen at construction, and the Workspace that reserve_workspace made. The engine keeps the
workspace and the graph runner it asks for, and prints the workspace in its memory plan.
"""
from __future__ import annotations

import ctypes

import numpy as np

from . import graphs
from .colsum import DeferredColsums
from .cublas import CUBLAS_WORKSPACE, Cublas
from .ops import ATTENTION_PATHS, CudaOps
from .runtime import Runtime, check, cp, require_cupy
from .workspace import Workspace
from ..numpy_ref import FP8_GRAD

GRAD_NORM_PARTIALS = 1024  # blocks of k_grad_norm_partial: enough to fill the GPU at 124M params


class CudaBackend(CudaOps):
    """Kernels of kernels/*.cu through CuPy, matrix products on cuBLAS.

    attention: "fused" (version 3 where it applies, see ops.FLASH_HEAD_SIZES) or "materialised"
    (version 1 always). cublaslt: matrix products with a fused epilogue through cuBLASLt
    (cublaslt.py: bias, bias + GELU saving the pre-activation, the GELU gradient); False (or no
    algorithm for a problem) takes cuBLAS and the separate bias / GELU kernels. sources: {file
    name: path} compiled instead of kernels/<file name>, e.g. a dev/cuda variant under test.
    fp8_grad: the format of the output gradients in train.precision=fp8 ("e4m3" or "e5m2").
    fp8_weight_cache: True / False sets CudaOps.fp8_weight_cache for this object (None: the default)."""

    name = "cuda"
    precisions = ("fp32", "fp16", "bf16", "fp8")  # fp8: bf16 with FP8 linear products (cc >= 8.9)
    grad_norm_partials = GRAD_NORM_PARTIALS
    attention = "fused"  # the default; the constructor's argument sets it per object
    xp = cp  # CuPy (None where it is not installed: then the constructor refuses)

    def __init__(self, attention: str = "fused", cublaslt: bool = True, sources=None, fp8_grad: str = FP8_GRAD,
                 fp8_weight_cache=None):
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention={attention!r}: expected one of {', '.join(ATTENTION_PATHS)}")
        self.cp = require_cupy()
        self.attention = attention
        self.cublaslt = bool(cublaslt)
        self.fp8_grad = fp8_grad
        if fp8_weight_cache is not None:
            self.fp8_weight_cache = bool(fp8_weight_cache)
        self.rt = Runtime(sources)
        self.workspace = Workspace()
        self.colsums = DeferredColsums(self.rt)  # the column sums a param_grad_pass defers
        self._blas = None
        self._lt = None  # the cuBLASLt binding once tried; False where it cannot be loaded
        self._rings: dict = {}  # pinned host buffers of upload / download_async, by shape

    @property
    def blas(self) -> Cublas:
        """The cuBLAS handle, created on first use."""
        if self._blas is None:
            self._blas = Cublas()
        return self._blas

    @property
    def lt(self):
        """The cuBLASLt binding, or None where cublaslt is off or it cannot be loaded."""
        if not self.cublaslt:
            return None
        if self._lt is None:
            from .cublaslt import CublasLt
            try:
                self._lt = CublasLt()
            except OSError:
                self._lt = False
        return self._lt or None

    def used_cublaslt(self) -> bool:
        """Whether cuBLASLt planned any product (each planned problem runs through it)."""
        lt = self.lt
        return bool(lt and lt.plans)

    # ------------------------------------------------------------ arrays
    def empty(self, shape, dtype):
        return self.cp.empty(shape, dtype=np.dtype(dtype))

    def zeros(self, shape, dtype):
        return self.cp.zeros(shape, dtype=np.dtype(dtype))

    def upload(self, dst, src):
        """dst (a device array) = src (host), queued on the current stream: the host does not wait
        for the device (src is copied to a pinned buffer first, so the caller may reuse it at once)."""
        buf, ev = self._ring("up", dst).take()
        buf[...] = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)
        stream = self.cp.cuda.get_current_stream()
        dst.data.copy_from_host_async(ctypes.c_void_p(buf.ctypes.data), dst.nbytes, stream)
        ev.record(stream)

    def write(self, dst, src):
        """dst = src now (a synchronous copy; the host waits for it)."""
        src = np.asarray(src, dtype=dst.dtype)
        dst.set(np.ascontiguousarray(src.reshape(dst.shape)))

    def download_async(self, a) -> "Pending":
        """Queue a copy of device array a to the host on the current stream; .get() returns it."""
        check("download_async", "a", a)
        return Pending(self._ring("down", a), a)

    def _ring(self, kind, a) -> "Pinned":
        key = (kind, tuple(a.shape), a.dtype.name)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = Pinned(a.shape, a.dtype)
        return ring

    def to_numpy(self, a):
        """A host NumPy copy of a device array (waits for the work that writes it)."""
        return self.cp.asnumpy(a)

    def synchronize(self):
        """Wait for all work queued on the current stream."""
        self.cp.cuda.get_current_stream().synchronize()

    # ------------------------------------------------------------ workspace and graphs
    def reserve_workspace(self, B: int, T: int, C: int, n_head: int, act_dtype, fp8: bool = False,
                          n_layer: int = 0, vocab: int = 0) -> Workspace:
        """Allocate the kernels' scratch for this shape now (start-up), so the step loop
        allocates nothing, and create the cuBLAS handle. Returns the Workspace the kernels of
        this backend draw from. fp8: the linear layers' products run in FP8 from now on (a GPU
        without FP8 tensor cores is refused here, with a clear error). n_layer: room for the
        column partials that a backward pass of that many layers defers (param_grad_pass). vocab:
        with fp8, the FP8 classifier's rows for that many classes (workspace_rows)."""
        if fp8:
            from .fp8 import check_fp8_device
            check_fp8_device(B, T, C)
        self.workspace.outside["cublas"] = CUBLAS_WORKSPACE
        self.workspace.outside["cublaslt"] = 0  # counted once the binding exists (below)
        self.workspace.reserve(self.workspace_rows(B, T, C, n_head, act_dtype, fp8, n_layer, vocab))
        if self._blas is None:  # the handle and its 32 MiB workspace, now rather than in step 1
            self._blas = Cublas()
        lt = self.lt
        if lt is not None:
            self.workspace.outside["cublaslt"] = lt.workspace.nbytes
        if fp8:
            from .fp8 import Fp8Ops
            self.fp8 = Fp8Ops(self, self.fp8_grad)
        else:
            self.fp8 = None
        return self.workspace

    def use_fp8_weight_cache(self, weights, data, meta, table, alone=0):
        """FP8 copies of weights in the engine's buffers, made now and read by their products
        (cuda/fp8.Fp8Ops.use_weight_cache, alone as there); needs reserve_workspace(fp8=True) first."""
        if self.fp8 is None:
            raise RuntimeError("use_fp8_weight_cache: call reserve_workspace(..., fp8=True) first")
        self.fp8.use_weight_cache(weights, data, meta, table, alone)

    def use_fp8_input_slots(self, weights, inputs, meta, xt=None, producer_amax=False):
        """Input slots for the products of weights, whose inputs are the saved activations inputs
        (cuda/fp8.Fp8Ops.use_input_slots); needs reserve_workspace(fp8=True) first."""
        if self.fp8 is None:
            raise RuntimeError("use_fp8_input_slots: call reserve_workspace(..., fp8=True) first")
        self.fp8.use_input_slots(weights, inputs, meta, xt, producer_amax)

    def use_fp8_delayed_scales(self, tensors, block):
        """Delayed scales for tensors, (role, weight) pairs (cuda/fp8.Fp8Ops.use_delayed_scales):
        returns their DelayedScales; needs reserve_workspace(fp8=True) and the input slots first."""
        if self.fp8 is None:
            raise RuntimeError("use_fp8_delayed_scales: call reserve_workspace(..., fp8=True) first")
        return self.fp8.use_delayed_scales(tensors, block)

    def refresh_fp8_weight_cache(self):
        """The FP8 copies rewritten from the weights (three launches); nothing without them."""
        if self.fp8 is not None:
            self.fp8.refresh_weight_cache()

    def graph_runner(self) -> graphs.GraphRunner:
        """A new runner replaying whole passes as CUDA graphs (see graphs.GraphRunner)."""
        return graphs.GraphRunner(self)

    def capture(self, fn, stream=None):
        """fn() recorded as a CUDA graph on stream (default: a new non-blocking one), not run.
        The graph's launch(stream=...) replays it."""
        stream = stream if stream is not None else self.cp.cuda.Stream(non_blocking=True)
        return graphs.capture(fn, stream, self.blas)


PINNED_DEPTH = 4  # steps the host may run ahead of the device through upload / download_async


class Pinned:
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


class Pending:
    """A device-to-host copy in flight; get() waits for it (once) and returns the host array."""

    def __init__(self, ring: Pinned, src):
        self.value = None
        self.buf, self.event = ring.take(self)
        stream = cp.cuda.get_current_stream()
        src.data.copy_to_host_async(ctypes.c_void_p(self.buf.ctypes.data), src.nbytes, stream)
        self.event.record(stream)

    def get(self):
        if self.value is None:
            self.event.synchronize()
            self.value = self.buf.copy()
        return self.value
