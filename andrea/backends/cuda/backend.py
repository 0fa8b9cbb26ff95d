"""CudaBackend: the backend interface (andrea/backends/interface.py) on one CUDA GPU.

One object per engine. It holds what its kernels need and nothing global: the compiled modules
(runtime.Runtime), the cuBLAS handle (cublas.Cublas, created on first use) and cuBLASLt binding,
the attention path chosen at construction, its Tuning (tuning.py), the Workspace that
reserve_workspace made, the parameter-gradient pass (gradpass.GradPass) and, with
train.precision=fp8, the FP8 state (fp8.Fp8). The launchers are its op classes, one file an
operation beside kernels/<op>.cu (ops/): each holds the op's 16-bit launcher and its FP8 form.
The engine keeps the workspace and the graph runner it asks for, and prints the workspace in its
memory plan.
"""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np

from ..interface import FP8_DLOGITS, FP8_DLOGITS_ROUNDING, FP8_FORMATS, FP8_GRAD, FP8_ROUNDINGS
from . import graphs
from .colsum import DEFERRED, DeferredColsums, deferred_floats
from .cublas import CUBLAS_WORKSPACE, Cublas
from .cublaslt import WORKSPACE_BYTES
from .fp8 import (META_STRIDE, Fp8, check_fp8_device, classifier_in_fp8, delayed_history_array, delayed_rows,
                  fp8_rows, input_slot_rows, weight_cache_rows)
from .fp8.plan import FP8_SCALINGS
from .geometry import ATTENTION_PATHS, COLSUM_CHUNKS
from .gradpass import GradPass
from .ops import AttentionOps, DecodeOps, EmbedOps, LayerNormOps, LinearOps, LossOps, MlpOps, OptimOps, ResidualOps
from .runtime import Runtime, check, cp, require_cupy
from .tuning import DEFAULT, Tuning
from .workspace import Workspace

GRAD_NORM_PARTIALS = 1024  # blocks of k_grad_norm_partial: enough to fill the GPU at 124M params
# the run's FP8 settings (train.fp8_classifier, fp8_dlogits, fp8_dlogits_rounding, fp8_scaling):
# what they mean and their defaults, which a run that sets none takes (docs/FP8.md)
FP8_RUN_DEFAULTS = {"fp8_classifier": 2, "fp8_dlogits": FP8_DLOGITS, "fp8_dlogits_rounding": FP8_DLOGITS_ROUNDING,
                    "fp8_scaling": "delayed"}


class CudaBackend(EmbedOps, LayerNormOps, LinearOps, AttentionOps, MlpOps, ResidualOps, LossOps, OptimOps,
                  DecodeOps):
    """Kernels of kernels/*.cu through CuPy, matrix products on cuBLAS and cuBLASLt.

    attention: "fused" (version 4 where it applies, see geometry.FLASH_HEAD_SIZES; the wgmma
    kernels on compute capability 9.0) or "materialised" (version 1 always). cublaslt: matrix
    products with a fused epilogue through cuBLASLt (cublaslt.py: bias, bias + GELU saving the
    pre-activation), and the FP8 products; False (or no algorithm for a problem) takes cuBLAS and
    the separate bias / GELU kernels. sources: {file name: path} compiled instead of
    kernels/<file name>, e.g. a dev/cuda variant under test. fp8_grad: the format of the output
    gradients in train.precision=fp8 ("e4m3" or "e5m2"). tuning: the launch geometry (Tuning;
    the measured defaults). pdl: programmatic dependent launch where the device has it (runtime.py;
    False launches every kernel the ordinary way: the same bits). graph_edits: the passes' graphs
    with cuBLAS(Lt)'s 4-byte counter memsets replaced by a kernel node that stores the same word
    (graph_edit.py; False keeps the graphs as captured: the same bits).

    The run's FP8 settings (fp8_classifier: 2 all the classifier's products in FP8, 1 the
    backward's, 0 none; fp8_dlogits: dlogits' format; fp8_dlogits_rounding: "stochastic" or
    "nearest"; fp8_scaling: "delayed" or "current") are read when an engine is made; the engine
    sets them from train.* with set_fp8_run (FP8_RUN_DEFAULTS where a run sets none)."""

    name = "cuda"
    precisions = ("fp32", "fp16", "bf16", "fp8")  # fp8: bf16 with FP8 linear products (cc >= 8.9)
    grad_norm_partials = GRAD_NORM_PARTIALS
    attention = "fused"  # the default; the constructor's argument sets it per object
    xp = cp  # CuPy (None where it is not installed: then the constructor refuses)
    fp8 = None  # the FP8 state (fp8.Fp8) once reserve_workspace(fp8=True) made it
    fp8_classifier = FP8_RUN_DEFAULTS["fp8_classifier"]
    fp8_dlogits = FP8_RUN_DEFAULTS["fp8_dlogits"]
    fp8_dlogits_rounding = FP8_RUN_DEFAULTS["fp8_dlogits_rounding"]
    fp8_scaling = FP8_RUN_DEFAULTS["fp8_scaling"]

    def __init__(self, attention: str = "fused", cublaslt: bool = True, sources=None, fp8_grad: str = FP8_GRAD,
                 tuning: Tuning = DEFAULT, pdl: bool = True, graph_edits: bool = True):
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention={attention!r}: expected one of {', '.join(ATTENTION_PATHS)}")
        if not isinstance(tuning, Tuning):
            raise TypeError(f"tuning={tuning!r}: expected a cuda.tuning.Tuning")
        self.cp = require_cupy()
        self.attention = attention
        self.cublaslt = bool(cublaslt)
        self.fp8_grad = fp8_grad
        self.tuning = tuning
        self.rt = Runtime(sources)
        self.rt.pdl = bool(pdl)
        self.graph_edits = bool(graph_edits)
        self.graph_memsets_replaced = 0  # by graph_edit.py, over every graph graphs.edited made
        self.workspace = Workspace()
        self.colsums = DeferredColsums(self.rt)  # the column sums a param_grad_pass defers
        self.grads = GradPass(self.rt, self.workspace, self.colsums)
        self._blas = None
        self._lt = None  # the cuBLASLt binding once tried; False where it cannot be loaded
        self._rings: dict = {}  # pinned host buffers of upload / download_async, by shape

    def set_fp8_run(self, **settings) -> None:
        """The run's FP8 settings (FP8_RUN_DEFAULTS' names; a value None leaves the setting as it is:
        the default unless set before), before an engine reads them; an unknown name or value is
        an error naming it."""
        allowed = {"fp8_classifier": (0, 1, 2), "fp8_dlogits": tuple(FP8_FORMATS), "fp8_dlogits_rounding": FP8_ROUNDINGS,
                   "fp8_scaling": FP8_SCALINGS}
        for name, value in settings.items():
            if name not in allowed:
                raise ValueError(f"set_fp8_run: {name!r}; expected one of {', '.join(allowed)}")
            if value is None:
                continue
            if value not in allowed[name]:
                raise ValueError(f"train.{name}={value!r}: expected one of {', '.join(map(str, allowed[name]))}")
            setattr(self, name, value)

    def fp8_run(self) -> dict:
        """The FP8 settings an engine made now takes (FP8_RUN_DEFAULTS' names)."""
        return {name: getattr(self, name) for name in FP8_RUN_DEFAULTS}

    # ------------------------------------------------------------ the FP8 side of an engine's plan
    @staticmethod
    def fp8_arena_rows(cached_shapes, slot_shapes, n_rows: int, n_delayed: int):
        """[(name, shape, dtype, group)]: the engine's arena rows of train.precision=fp8 (pure
        arithmetic, callable on the class without a GPU): the weight cache of weights of
        cached_shapes ((R, K) each), the input slots of the products of weights of slot_shapes
        ((OC, IC) each) over n_rows rows, with their FP8 X^T, and n_delayed delayed scales."""
        rows = [r + ("fp8 weight cache",) for r in weight_cache_rows(cached_shapes)]
        rows += [r + ("fp8 input slots",) for r in input_slot_rows(slot_shapes, n_rows, True)]
        return rows + [r + ("fp8 delayed scales",) for r in delayed_rows(n_delayed)]

    @staticmethod
    def fp8_classifier_fits(N: int, V: int, R: int) -> bool:
        """Whether the classifier's products can run in FP8 for N rows, V classes and chunks of R rows."""
        return classifier_in_fp8(N, V, R)

    @staticmethod
    def fp8_history_rows(history) -> int:
        """The delayed scales an amax history (a checkpoint sidecar's fp8_amax_history) holds; a
        ValueError naming the field where it is not an (n, FP8_HIST) array of amax values."""
        return delayed_history_array(history).shape[0]

    def workspace_rows(self, B: int, T: int, C: int, n_head: int, act_dtype, fp8: bool = False, n_layer: int = 0,
                       vocab: int = 0, chunk_rows: int = 0):
        """[(name, shape, dtype)] of the scratch the kernels take for one model shape: what
        reserve_workspace allocates, for the engine's memory plan. fp8: with the FP8 operands
        and scales of train.precision=fp8 (fp8/plan.py). n_layer: with the deferred column
        partials of a backward pass of that many layers (colsum.py; 0: none). vocab: with fp8 and
        the run's fp8_classifier, the FP8 classifier's rows for that many classes and chunks of
        chunk_rows rows (the logits workspace's)."""
        act = np.dtype(act_dtype).name
        N, BH = B * T, B * n_head
        P = 1 << max(1, (N - 1).bit_length())
        if self.attention_variant(act_dtype, C // n_head) == "fused":
            rows = [("attn_D", (BH * T,), "float32")]
        else:
            rows = [("attn_scores", (BH * T * T,), "float32"), ("attn_probs", (BH * T * T,), act),
                    ("attn_heads", (3 * N * C,), act), ("attn_y", (N * C,), act),
                    ("attn_dheads", (3 * N * C,), "float32")]
        partial_rows = max(COLSUM_CHUNKS * 4, self._ln_grid(C))
        bias_chunks = COLSUM_CHUNKS  # partial rows of a bias gradient: more where the FP8 casts write them
        if fp8:
            bias_chunks = max(bias_chunks, -(-N // self.tuning.fp8_tile_rows))
        slot_rows = max(partial_rows, 4 * bias_chunks)  # the widest bias is the MLP's first, 4C
        rows += [("colsum_a", (slot_rows * C,), "float32"), ("colsum_b", (slot_rows * C,), "float32"),
                 ("embed_keys", (P,), "uint32"), ("cublas", (CUBLAS_WORKSPACE,), "uint8")]
        deferred = deferred_floats(n_layer, C, partial_rows, bias_chunks)
        if deferred:
            rows.append((DEFERRED, (deferred,), "float32"))
        if self.cublaslt:
            rows.append(("cublaslt", (WORKSPACE_BYTES,), "uint8"))
        if fp8:
            rows += fp8_rows(B, T, C, vocab if self.fp8_classifier else 0, chunk_rows)
        return rows

    @contextlib.contextmanager
    def param_grad_pass(self, start=None):
        """A backward pass's parameter gradients (model.backward opens it; gradpass.GradPass.open):
        the final column sums wait and run as one launch when the outermost pass closes; start:
        the float32 gradient buffer this pass starts (its old contents count as zero)."""
        with self.grads.open(start):
            yield

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
                          n_layer: int = 0, vocab: int = 0, chunk_rows: int = 0) -> Workspace:
        """Allocate the kernels' scratch for this shape now (start-up), so the step loop
        allocates nothing, and create the cuBLAS handle. Returns the Workspace the kernels of
        this backend draw from. fp8: the linear layers' products run in FP8 from now on (a GPU
        without FP8 tensor cores is refused here, with a clear error). n_layer: room for the
        column partials that a backward pass of that many layers defers (param_grad_pass). vocab:
        with fp8, the FP8 classifier's rows for that many classes (workspace_rows)."""
        if fp8:
            check_fp8_device(B, T, C)
        self.workspace.outside["cublas"] = CUBLAS_WORKSPACE
        self.workspace.outside["cublaslt"] = 0  # counted once the binding exists (below)
        self.workspace.reserve(self.workspace_rows(B, T, C, n_head, act_dtype, fp8, n_layer, vocab, chunk_rows))
        if self._blas is None:  # the handle and its 32 MiB workspace, now rather than in step 1
            self._blas = Cublas()
        lt = self.lt
        if lt is not None:
            self.workspace.outside["cublaslt"] = lt.workspace.nbytes
        if fp8:
            self.fp8 = Fp8(self.rt, self.tuning, self.lt, self.workspace, self.grads, self.fp8_grad)
        else:
            self.fp8 = None
        return self.workspace

    def use_fp8_weight_cache(self, weights, data, meta, table, alone=0):
        """FP8 copies of weights in the engine's buffers, made now and read by their products
        (fp8.Fp8.use_weight_cache, alone as there); needs reserve_workspace(fp8=True) first."""
        if self.fp8 is None:
            raise RuntimeError("use_fp8_weight_cache: call reserve_workspace(..., fp8=True) first")
        self.fp8.use_weight_cache(weights, data, meta, table, alone)

    def use_fp8_input_slots(self, weights, inputs, meta, xt=None, producer_amax=False):
        """Input slots for the products of weights, whose inputs are the saved activations inputs
        (fp8.Fp8.use_input_slots); needs reserve_workspace(fp8=True) first."""
        if self.fp8 is None:
            raise RuntimeError("use_fp8_input_slots: call reserve_workspace(..., fp8=True) first")
        self.fp8.use_input_slots(weights, inputs, meta, xt, producer_amax)

    def use_fp8_delayed_scales(self, tensors, block):
        """Delayed scales for tensors, (role, weight) pairs (fp8.Fp8.use_delayed_scales):
        returns their DelayedScales; needs reserve_workspace(fp8=True) and the input slots first."""
        if self.fp8 is None:
            raise RuntimeError("use_fp8_delayed_scales: call reserve_workspace(..., fp8=True) first")
        return self.fp8.use_delayed_scales(tensors, block.reshape(-1, META_STRIDE))

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
