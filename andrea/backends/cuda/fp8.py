"""The FP8 linear layers of train.precision=fp8: quantisation kernels (kernels/fp8.cu) and
cuBLASLt FP8 products, behind the same names as numpy_ref's FP8 section.

    be.reserve_workspace(B, T, C, n_head, "bfloat16", fp8=True)   # be.fp8 is an Fp8Ops now
    # the backend's k_attn_qkv_*, k_attn_out_*, k_mlp_* then run their products here

Each operand of a product is quantised with its own per-tensor scale (a power of two), taken
from the tensor's amax just before (current scaling, docs/FP8.md) or, for the eight tensors a layer
with a delayed scale (DelayedScales below), from an amax history. Current scaling: k_fp8_amax, then
k_fp8_cast (forward:
activations and weights, E4M3) or k_fp8_cast_transpose (backward: cuBLASLt's FP8 products want
both operands contiguous along the summed axis, so dW = dY.T @ X takes dY and X transposed and
dX = dY @ W takes W transposed). The output gradient dY is quantised in the gradient format
(numpy_ref.FP8_GRAD). Products accumulate in float32 and write the compute dtype (bf16) or, for
the weight gradients, add into the float32 grads (beta = 1). Biases ride on cuBLASLt's bias
epilogue where cuBLASLt has an FP8 algorithm for it; otherwise a plain product and the 16-bit
path's bias kernel. Bias gradients are column sums of the 16-bit dY, as in the 16-bit path.
The MLP's GELU is not an epilogue: act = gelu(pre) is made into its FP8 operand straight from
pre (k_fp8_gelu_amax, k_fp8_gelu_cast_transpose; act is never stored in 16 bits), and the
backward's dact *= gelu'(pre) runs in one pass with dact's amax and the first bias's column
partials (k_fp8_dgelu_colsum_amax). The operands live in the backend's
workspace ("fp8_*" rows), reused by every layer; the scales live in "fp8_meta".

The weights change once per optimizer step, not once per product: with the FP8 weight cache
(CudaOps.fp8_weight_cache, on by default) the engine keeps an FP8 copy of every linear weight W and
of its transpose W^T with their (amax, 1/scale) in its arena (weight_cache_rows), hands them over
with use_weight_cache, and refresh_weight_cache rewrites them after each update (inside the
optimizer's CUDA graph) and whenever the weights are loaded: one memset, k_fp8_amax_many and
k_fp8_cast_transpose_many for all of them. The products then read the copies instead of
quantising W themselves; the bytes and scales are the ones the per-product quantisation writes
for the same weights, so a step is bit-identical with the cache on or off.

The inputs X of the layers whose X the model saves for the backward pass (ln1 for QKV, the
attention output for its projection, ln2 for the first MLP product) and act (the second MLP
product's, made from the saved pre) have input slots
(use_input_slots, rows input_slot_rows in the engine's arena): each slot holds the (amax,
1/scale) of its X for the current microbatch and, with CudaOps.fp8_keep_xt, FP8 X^T. The
forward product then quantises X once into both X and X^T (k_fp8_cast_transpose) and the
backward's weight-gradient product reads that X^T instead of quantising X again: the same
tensor, amax, scale and rounding, so the same bytes (act's X^T comes from pre, as the backward
would make it from its own act = gelu(pre)). With CudaOps.fp8_producer_amax the layer
norms that write ln1 and ln2 also reduce their amax into the slot (layernorm.cu), and the
product skips its k_fp8_amax pass. The amax of every slot is zeroed by one memset when the first
slot (layer 0's ln1) is quantised, i.e. once per forward pass, not once per product. Both
switches are on by default (docs/FP8.md has the GPU job that measured them).

Delayed scaling (CudaOps.fp8_scaling = "delayed", the default; use_delayed_scales): act, dact,
the attention output, dqkv, the residual stream's two gradients, ln1 and ln2 of every layer take
their scale from the largest amax of the last 16 optimizer steps, kept in the engine's arena (a
row a tensor) and the checkpoint's sidecar. The pass that makes or casts each of them reduces its
amax into the row as it casts (k_fp8_gelu_cast_transpose_amax,
k_fp8_dgelu_cast_transpose_colsum_amax: dact *= gelu'(pre) cast and transposed without a bf16
dact, k_fp8_cast_transpose_amax, k_fp8_cast_transpose_colsum_amax), and k_fp8_delayed_roll moves
the histories at the end of each optimizer step, in its CUDA graph (not on a skipped step). The
layer norms that make ln1 and ln2 write them as the products' FP8 operands and X^T themselves
(layernorm_operand, k_layernorm_fwd_fp8; CudaOps.fp8_layernorm_cast): no bf16 ln1 or ln2, no
cast of them. The first step, with no history, takes each amax first. The casts of dY of a layer
with a bias also write its column partials (CudaOps.fp8_cast_colsum,
k_fp8_cast_transpose_colsum), so the bias gradient reads dY no more.

The classifier (CudaOps.fp8_classifier, on by default, docs/FP8.md) runs its products here too
(k_fp8_loss_fwd / k_fp8_loss_bwd): the tied embedding in the weight cache, lnf's output quantised
once a call, dlogits written in FP8 by loss.cu's row pass with the scale of its bound
|softmax - onehot| <= 1 (no amax pass), rounded stochastically (the loss held only so), and
transposed for dW by k_fp8_transpose into the logits workspace the chunk no longer needs.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ...core.model import loss_chunk_rows
from ..numpy_ref import FP8_FORMATS, FP8_FWD, FP8_HIST, S_SKIP, fp8_rounding
from .cublas import cuda_type
from .cublaslt import WORKSPACE_BYTES
from .runtime import MAX_BLOCKS, THREADS, blocks, check, cp, i32, i64

FP8_CUDA_TYPES = {"e4m3": 28, "e5m2": 29}  # cudaDataType_t CUDA_R_8F_E4M3, CUDA_R_8F_E5M2
FP8_MIN_CC = 89  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) or later
FP8_MULTIPLE = 16  # cuBLASLt's FP8 products want every dimension a multiple of 16
META_STRIDE = 64  # floats per tensor: amax at 0, 1/scale at 32 (128-byte aligned, for cuBLASLt)
# the input, the weight, the output gradient of a product; the classifier's input (lnf's output)
# and its dlogits
META_SLOTS = {"x": 0, "w": 1, "dy": 2, "cx": 3, "dz": 4}
TILE = 64  # the cast kernels' tile: 64 columns, 64 rows (the *_many kernel) or CudaOps.fp8_tile_rows
TILE_ROWS = (64, 128, 256)  # what fp8.cu's single-tensor cast kernels compile for
TABLE_COLS = 5  # int64 per tensor of a *_many launch: address of x, of out, of out_t, R, K (fp8.cu)
CACHE_ALIGN = 256  # bytes: each cached copy starts aligned as cuBLASLt's heuristics assume
MANY_BLOCKS = 128  # blocks per tensor of the *_many kernels (grid-stride over the tensor)
# fp8(dY)^T buffers the casts take in turn while the weight-gradient products run on a stream of
# their own (CudaOps.fp8_wgrad_stream): a cast reuses one once the product that read it is done
WGRAD_RING = 4
ADAMW_AMAX_MAX = 256  # weights k_adamw_step_amax takes the amax of at most (optim.cu's ADAMW_AMAX_MAX)
# a delayed scale's row (META_STRIDE floats, fp8.cu k_fp8_delayed_roll): the amax it scales by at
# 0, the amax of the step under way at DELAYED_CUR, the last FP8_HIST steps' from DELAYED_HIST_AT
DELAYED_CUR, DELAYED_HIST_AT = 1, 2
FP8_SCALINGS = ("current", "delayed")


def _aligned(n: int) -> int:
    return -(-n // CACHE_ALIGN) * CACHE_ALIGN


def weight_cache_rows(shapes):
    """The arena rows of the FP8 weight cache for weights of these (R, K) shapes: the copies (W
    and W^T of each, CACHE_ALIGN-aligned, in one uint8 row), their (amax, 1/scale) rows and the
    table the *_many kernels read. Pure arithmetic: the memory plan calls it without a GPU."""
    n = len(shapes)
    data = sum(2 * _aligned(int(R) * int(K)) for R, K in shapes)
    return [("fp8_wcache", (data,), "uint8"), ("fp8_wmeta", (n * META_STRIDE,), "float32"),
            ("fp8_wtable", (n, TABLE_COLS), "int64")]


def input_slot_rows(shapes, N: int, keep_xt: bool):
    """The arena rows of the input slots of weights of these (OC, IC) shapes, for products of N
    rows: their (amax, 1/scale) rows and, with keep_xt, FP8 X^T (IC, N) of each input (one byte
    an element, CACHE_ALIGN-aligned, in one uint8 row). Pure arithmetic, as weight_cache_rows."""
    rows = [("fp8_xmeta", (len(shapes) * META_STRIDE,), "float32")]
    if keep_xt:
        rows.append(("fp8_xt", (sum(_aligned(int(K) * int(N)) for _, K in shapes),), "uint8"))
    return rows


def fp8_rows(B: int, T: int, C: int, vocab: int = 0, wgrad_stream: bool = False):
    """The workspace rows of the FP8 path for this model shape: the widest operand of each role
    (the MLP's: B*T x 4C activations and gradients, a 4C x C weight) and the scales. vocab: with
    the classifier in FP8 (classifier_in_fp8): one chunk's input and its transpose, its FP8
    dlogits (R, V), and room for the embedding (V, C) where the weight cache does not hold it.
    wgrad_stream: with WGRAD_RING buffers of fp8(dY)^T and a cuBLASLt workspace for the
    weight-gradient stream (CudaOps.fp8_wgrad_stream)."""
    N, H = B * T, 4 * C
    w = H * C
    rows = [("fp8_x", (N * H,), "uint8"), ("fp8_dy", (N * H,), "uint8"), ("fp8_dyt", (N * H,), "uint8")]
    if wgrad_stream:
        rows += [(f"fp8_dyt{i}", (N * H,), "uint8") for i in range(1, WGRAD_RING)]
        rows += [("cublaslt_wgrad", (WORKSPACE_BYTES,), "uint8")]
    if vocab and classifier_in_fp8(N, vocab):
        R = loss_chunk_rows(N, vocab)
        w = max(w, vocab * C)
        rows += [("fp8_cx", (R * C,), "uint8"), ("fp8_cxt", (R * C,), "uint8"), ("fp8_dz", (R * vocab,), "uint8")]
    return rows + [("fp8_w", (w,), "uint8"), ("fp8_meta", (len(META_SLOTS) * META_STRIDE,), "float32")]


def delayed_rows(n: int):
    """The engine's arena rows of n delayed scales (CudaOps.fp8_scaling = "delayed"), one
    META_STRIDE row each (engine.fp8_delayed_tensors lists them)."""
    return [("fp8_delayed", (n * META_STRIDE,), "float32")] if n else []


def delayed_history_array(history, n=None) -> np.ndarray:
    """history (a checkpoint sidecar's fp8_amax_history: n lists of FP8_HIST amax, newest first) as
    a float32 (n, FP8_HIST) array (n None: any number of rows); a ValueError naming the field where
    it is not that, or holds a value that is not a finite, non-negative number."""
    want = f"({'n' if n is None else n}, {FP8_HIST}) amax values (a row a delayed scale, newest first)"
    try:
        h = np.asarray(history, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"fp8_amax_history: not an array of numbers; expected {want}") from None
    if h.ndim != 2 or h.shape[1] != FP8_HIST or (n is not None and h.shape[0] != n):
        raise ValueError(f"fp8_amax_history: shape {h.shape}; expected {want}")
    if not np.all(np.isfinite(h)) or (h < 0).any():
        raise ValueError("fp8_amax_history: a value is not finite or is negative; expected amax values >= 0")
    return h


def classifier_in_fp8(N: int, V: int) -> bool:
    """Whether the classifier's products can run in FP8 for N = B*T rows and V classes: cuBLASLt's
    FP8 products and k_fp8_transpose want V and every chunk's rows (N, and model.loss_chunk_rows, a
    power of two) multiples of FP8_MULTIPLE; otherwise the classifier stays in bf16."""
    return V % FP8_MULTIPLE == 0 and N % FP8_MULTIPLE == 0 and loss_chunk_rows(N, V) % FP8_MULTIPLE == 0


def check_fp8_device(B: int, T: int, C: int):
    """Raise a clear error where train.precision=fp8 cannot run: a GPU without FP8 tensor cores,
    or sizes cuBLASLt's FP8 products do not take."""
    dev = cp.cuda.Device()
    cc = int(dev.compute_capability)
    if cc < FP8_MIN_CC:
        name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        raise RuntimeError(f"train.precision=fp8 needs FP8 tensor cores (compute capability 8.9 or later); "
                           f"this GPU ({name}) is {cc // 10}.{cc % 10}: use precision fp16 or bf16")
    for what, v in (("model.d_model", C), ("train.batch_size * train.seq_len", B * T)):
        if v % FP8_MULTIPLE:
            raise ValueError(f"train.precision=fp8: {what} = {v} must be a multiple of {FP8_MULTIPLE} "
                             "(cuBLASLt's FP8 products)")


class InputSlot:
    """The input slot of one product (Fp8Ops.use_input_slots): x, its input's (address, N, IC);
    meta, the (META_STRIDE,) row (amax at 0, 1/scale at META_STRIDE // 2); xt, FP8 X^T (IC, N) or
    None; first, the slot whose quantisation starts a forward pass. state (what the launchers
    queued last, which a captured graph replays in the same order): "zeroed" (amax zero),
    "armed" (a kernel reduces into it), "amax" (its producer did), "used" (a product used it);
    ready: the forward product wrote xt for the backward; delayed: meta is a delayed scale's row
    (use_delayed_scales), and with state "cast" the layer norm writing x wrote its FP8 operand and
    X^T itself (layernorm_operand)."""

    __slots__ = ("first", "x", "meta", "xt", "state", "ready", "delayed")

    def __init__(self, first, x, meta, xt):
        self.first, self.x, self.meta, self.xt = first, x, meta, xt
        self.state, self.ready, self.delayed = "used", False, False


class DelayedScales:
    """The delayed scales of one engine (Fp8Ops.use_delayed_scales): block (n, META_STRIDE), a row
    a tensor (fp8.cu k_fp8_delayed_roll: the amax it scales by, the step's, the history); rows,
    (role, address of a weight) -> its row. live: the rows hold a history (else each pass takes its
    amax first and records it: the first step); record: the passes being queued reduce their amax
    into the rows (a training step's, not a forward pass of evaluation or generation)."""

    def __init__(self, fp8, block, rows):
        self.fp8, self.block, self.rows = fp8, block, rows
        self.live, self.record = False, False
        self.load(None)

    def load(self, history):
        """The rows from history ((n, FP8_HIST) amax, newest first: what history() gave), or
        empty (None: the next step takes its amax first and records it): [0] the history's
        largest (as the roll makes it), [1] zero; written whole from the host."""
        b = self.block
        rows = np.zeros(b.shape, np.float32)
        if history is not None:
            h = delayed_history_array(history, b.shape[0])
            rows[:, DELAYED_HIST_AT:DELAYED_HIST_AT + FP8_HIST] = h
            rows[:, 0] = h.max(axis=1)
        b.set(rows)
        self.live = history is not None

    def history(self):
        """The rows' histories (n, FP8_HIST) float32, newest first (host; waits for the device)."""
        return self.block[:, DELAYED_HIST_AT:DELAYED_HIST_AT + FP8_HIST].get()

    def roll(self, state):
        """The end of an optimizer step (state: the engine's optimizer state): each history takes
        the step's amax unless the step was skipped, each scale its history's largest."""
        self.fp8.k_fp8_delayed_roll(self.block, state)

    @contextmanager
    def recording(self):
        """The passes queued inside reduce their amax into the rows (a training step's)."""
        saved, self.record = self.record, True
        try:
            yield
        finally:
            self.record = saved


class Fp8Ops:
    """The FP8 launchers of one CudaBackend (ops): its Runtime, cuBLASLt binding and workspace.
    grad_fmt: the format of the output gradients ("e4m3" or "e5m2")."""

    def __init__(self, ops, grad_fmt: str):
        if grad_fmt not in FP8_FORMATS:
            raise ValueError(f"FP8 gradient format {grad_fmt!r}: expected one of {', '.join(FP8_FORMATS)}")
        if ops.lt is None:
            raise RuntimeError("train.precision=fp8 needs cuBLASLt (the backend was made with cublaslt=False, "
                               "or libcublasLt could not be loaded)")
        self.ops, self.grad_fmt = ops, grad_fmt
        self.cache = {}  # (address, shape, dtype) of a weight -> (W fp8, W^T fp8, its meta row (META_STRIDE,))
        self._cache_args = None  # (meta (n, META_STRIDE), table, dtype, shapes) of refresh_weight_cache
        self._cache_weights, self._amax_taken = [], False  # the cached weights; see k_adamw_step_amax
        self._cache_alone = []  # (w, fp8 W, fp8 W^T, meta row) of the weights refreshed on their own
        # input slots (use_input_slots): address of a weight -> InputSlot of its product's input X;
        # address of an input -> the same slot (the layer-norm launchers ask by their output)
        self.slots, self.slot_of_input = {}, {}
        self._slot_block = None  # every slot's meta rows, (n, META_STRIDE): zeroed by one memset
        self._producer_amax = False  # the layer norms writing a slot's input reduce its amax (producer_amax)
        self.delayed = None  # the DelayedScales of use_delayed_scales
        # address of a forward product's output -> its weight's (k_fp8_linear_fwd): the attention
        # backward finds the QKV weight of the qkv it differentiates (attention_grad_operand)
        self._made_by = {}
        # (dqkv, w, fp8 dY, fp8 dY^T, delayed row, partial, chunks, format) that the attention
        # backward wrote for w's product backward (attention_grad_operand, _dgrad_wgrad), or None
        self._pending_dy = None
        # the weight-gradient stream (CudaOps.fp8_wgrad_stream; _wgrad_product): the stream, the
        # next fp8(dY)^T buffer, buffer -> the event after the product that read it (this pass),
        # address -> buffer, the event after the stream's last product (None: nothing to join)
        self._wg_stream, self._ring_next, self._ring_busy, self._ring_of, self._wg_last = None, 0, {}, {}, None
        self._wg_events = None  # (the fork event, one "done" event a buffer), made with the stream, reused
        self.wgrad_side_products = 0  # products the stream ran (tests and benchmarks count them)

    # ------------------------------------------------------------ the quantisation kernels
    @staticmethod
    def _defs(fmt):
        """The -D options of a kernel file built for FP8 format fmt: none for E4M3, fp8.cuh's
        default (so its kernels share one build with the launches that pass no format)."""
        if fmt not in FP8_FORMATS:
            raise ValueError(f"FP8 format {fmt!r}: expected one of {', '.join(FP8_FORMATS)}")
        return ("-DFP8_E5M2=1",) if fmt == "e5m2" else ()

    def _gelu_defs(self):
        """The -D option of fp8.cu's GELU passes for gelu.cuh's form (CudaOps.fp8_gelu_fma)."""
        return ("-DGELU_FMA=1",) if self.ops.fp8_gelu_fma else ()

    @staticmethod
    def _inv_at(kernel, meta):
        """Where 1/scale goes in meta: float32 (2m,) holds amax at 0 and 1/scale at m."""
        check(kernel, "meta", meta, dtype=np.float32)
        if meta.ndim != 1 or meta.size < 2 or meta.size % 2:
            raise ValueError(f"{kernel}: meta has shape {meta.shape}; expected (2m,): amax at 0, 1/scale at m")
        return i32(meta.size // 2)

    @staticmethod
    def _check_x(kernel, x):
        check(kernel, "x", x)
        if x.size % FP8_MULTIPLE or x.data.ptr % 16:
            raise ValueError(f"{kernel}: x has {x.size} values (need a multiple of {FP8_MULTIPLE}) "
                             f"at address {x.data.ptr:#x} (need 16-byte alignment)")

    def _amax_grid(self, kernel, meta, x, zeroed):
        """Checks, the memset of meta[0] (unless zeroed) and the grid of an amax launch of x."""
        check(kernel, "meta", meta, dtype=np.float32)
        self._check_x(kernel, x)
        if not zeroed:
            cp.cuda.runtime.memsetAsync(meta.data.ptr, 0, 4, cp.cuda.get_current_stream().ptr)
        grid = blocks(x.size // 8, THREADS)
        if self.ops.fp8_amax_blocks:  # a few blocks an SM, each thread four loads at a time (fp8.cu)
            from .ops import _sm_limits
            grid = min(grid, self.ops.fp8_amax_blocks * _sm_limits(x.device.id)["sms"])
        return grid

    def k_fp8_amax(self, meta, x, zeroed=False):
        """meta[0] = max |x| (NaN if any x is NaN); zeroes meta[0] first (a memset, so it captures)
        unless zeroed says it is zero already."""
        grid = self._amax_grid("k_fp8_amax", meta, x, zeroed)
        self.ops.rt.launch("fp8.cu", "k_fp8_amax", x.dtype, grid, THREADS, (meta, x, i64(x.size)))

    def k_fp8_gelu_amax(self, meta, pre, zeroed=False):
        """meta[0] = max |act|, act = gelu(pre) rounded to pre's dtype (fp8.cu's sigmoid form),
        without writing act (and, for 16-bit pre, without a GELU per value: fp8.cu
        fp8_amax_block; CudaOps.fp8_gelu_amax_full takes the GELU of every value, the same bits);
        zeroes meta[0] first unless zeroed."""
        grid = self._amax_grid("k_fp8_gelu_amax", meta, pre, zeroed)
        defs = ("-DFP8_GELU_AMAX_FULL=1",) if self.ops.fp8_gelu_amax_full else ()
        self.ops.rt.launch("fp8.cu", "k_fp8_gelu_amax", pre.dtype, grid, THREADS, (meta, pre, i64(pre.size)),
                           defs=defs + self._gelu_defs())

    def k_fp8_cast(self, out, meta, x, fmt):
        """out (uint8, x's size) = fp8 bytes of x * scale (scale from meta[0]); 1/scale into meta
        (meta[1] of a (2,) pair, as numpy_ref; meta[m] of a (2m,) slot)."""
        inv_at = self._inv_at("k_fp8_cast", meta)
        self._check_x("k_fp8_cast", x)
        check("k_fp8_cast", "out", out, dtype=np.uint8)
        if out.size != x.size:
            raise ValueError(f"k_fp8_cast: out has {out.size} bytes, x {x.size} values")
        self.ops.rt.launch("fp8.cu", "k_fp8_cast", x.dtype, blocks(x.size // 8, THREADS), THREADS,
                           (out, meta, inv_at, x, i64(x.size)), defs=self._defs(fmt))

    def _cast_transpose_launch(self, kernel, out, out_t, meta, x, fmt):
        """Checks, grid, arguments and defines of a launch of k_fp8_cast_transpose or
        k_fp8_gelu_cast_transpose (the same signature): (grid, args, defs)."""
        inv_at = self._inv_at(kernel, meta)
        self._check_x(kernel, x)
        if x.ndim != 2 or x.shape[0] % FP8_MULTIPLE or x.shape[1] % FP8_MULTIPLE:
            raise ValueError(f"{kernel}: x has shape {x.shape}; expected (R, K), both multiples of {FP8_MULTIPLE}")
        R, K = x.shape
        for name, a in (("out", out), ("out_t", out_t)):
            if a is not None:
                check(kernel, name, a, dtype=np.uint8)
                if a.size != x.size:
                    raise ValueError(f"{kernel}: {name} has {a.size} bytes, x {x.size} values")
        null = np.uint64(0)
        rows = int(self.ops.fp8_tile_rows)
        if rows not in TILE_ROWS:
            raise ValueError(f"{kernel}: CudaOps.fp8_tile_rows = {rows}; expected one of {TILE_ROWS}")
        return ((-(-K // TILE), -(-R // rows)),
                (out if out is not None else null, out_t if out_t is not None else null, meta, inv_at, x, i32(R),
                 i32(K)),
                self._defs(fmt) + (f"-DFP8_TILE_ROWS={rows}",))

    def k_fp8_cast_transpose(self, out, out_t, meta, x, fmt):
        """x (R, K) to out (R, K) and/or out_t (K, R) (None skips one), as k_fp8_cast."""
        grid, args, defs = self._cast_transpose_launch("k_fp8_cast_transpose", out, out_t, meta, x, fmt)
        self.ops.rt.launch("fp8.cu", "k_fp8_cast_transpose", x.dtype, grid, THREADS, args, defs=defs)

    def k_fp8_cast_transpose_colsum(self, out, out_t, meta, x, fmt, partial):
        """k_fp8_cast_transpose, and partial (ceil(R / rows), K) float32 = the column sums of x
        over each tile of rows = CudaOps.fp8_tile_rows rows (numpy_ref.fp8_tile_colsum's order):
        the first pass of a bias gradient, k_colsum_final of them the second."""
        kernel = "k_fp8_cast_transpose_colsum"
        grid, args, defs = self._cast_transpose_launch(kernel, out, out_t, meta, x, fmt)
        R, K = x.shape
        check(kernel, "partial", partial, (grid[1] * K,), np.float32)
        self.ops.rt.launch("fp8.cu", "k_fp8_cast_transpose_colsum", x.dtype, grid, THREADS, args + (partial,),
                           defs=defs)

    def k_fp8_gelu_cast_transpose(self, out, out_t, meta, pre, fmt):
        """act = gelu(pre) (R, K), rounded to pre's dtype, to out (R, K) and/or out_t (K, R) as
        k_fp8_cast_transpose casts it (scale from meta[0]: k_fp8_gelu_amax), without writing act."""
        grid, args, defs = self._cast_transpose_launch("k_fp8_gelu_cast_transpose", out, out_t, meta, pre, fmt)
        self.ops.rt.launch("fp8.cu", "k_fp8_gelu_cast_transpose", pre.dtype, grid, THREADS, args,
                           defs=defs + self._gelu_defs())

    def k_fp8_cast_transpose_amax(self, out, out_t, meta, x, fmt, amax_out):
        """k_fp8_cast_transpose, and amax_out (a (1,) float32 view, or None: not taken) =
        max(amax_out, max |x|)."""
        kernel = "k_fp8_cast_transpose_amax"
        grid, args, defs = self._cast_transpose_launch(kernel, out, out_t, meta, x, fmt)
        self.ops.rt.launch("fp8.cu", "k_fp8_cast_transpose_amax", x.dtype, grid, THREADS,
                           args + (self._amax_out(kernel, amax_out),), defs=defs)

    def k_fp8_cast_transpose_colsum_amax(self, out, out_t, meta, x, fmt, partial, amax_out):
        """k_fp8_cast_transpose_colsum, and amax_out (a (1,) float32 view, or None) = max(amax_out,
        max |x|)."""
        kernel = "k_fp8_cast_transpose_colsum_amax"
        grid, args, defs = self._cast_transpose_launch(kernel, out, out_t, meta, x, fmt)
        check(kernel, "partial", partial, (grid[1] * x.shape[1],), np.float32)
        self.ops.rt.launch("fp8.cu", "k_fp8_cast_transpose_colsum_amax", x.dtype, grid, THREADS,
                           args + (partial, self._amax_out(kernel, amax_out)), defs=defs)

    def k_fp8_gelu_cast_transpose_amax(self, out, out_t, meta, pre, fmt, amax_out):
        """k_fp8_gelu_cast_transpose, and amax_out (a (1,) float32 view, or None: not taken) =
        max(amax_out, max |act|)."""
        kernel = "k_fp8_gelu_cast_transpose_amax"
        grid, args, defs = self._cast_transpose_launch(kernel, out, out_t, meta, pre, fmt)
        self.ops.rt.launch("fp8.cu", "k_fp8_gelu_cast_transpose_amax", pre.dtype, grid, THREADS,
                           args + (self._amax_out(kernel, amax_out),), defs=defs + self._gelu_defs())

    def k_fp8_dgelu_cast_transpose_colsum_amax(self, out, out_t, meta, dact, pre, fmt, partial, amax_out):
        """d = dact * gelu'(pre) (R, K) rounded to dact's dtype (not stored), cast as
        k_fp8_cast_transpose_colsum casts it (partial: ceil(R / CudaOps.fp8_tile_rows) rows of
        column sums), and amax_out (a (1,) float32 view, or None) = max(amax_out, max |d|)."""
        kernel = "k_fp8_dgelu_cast_transpose_colsum_amax"
        grid, args, defs = self._cast_transpose_launch(kernel, out, out_t, meta, dact, fmt)
        check(kernel, "pre", pre, dact.shape, dact.dtype)
        if pre.data.ptr % 16:
            raise ValueError(f"{kernel}: pre at {pre.data.ptr:#x}; expected 16-byte alignment")
        check(kernel, "partial", partial, (grid[1] * dact.shape[1],), np.float32)
        out_, out_t_, meta_, inv_at, x, R, K = args
        self.ops.rt.launch("fp8.cu", "k_fp8_dgelu_cast_transpose_colsum_amax", dact.dtype, grid, THREADS,
                           (out_, out_t_, meta_, inv_at, x, pre, R, K, partial, self._amax_out(kernel, amax_out)),
                           defs=defs + self._gelu_defs())

    def k_layernorm_fwd_fp8(self, out, out_t, res, mean, rstd, a, b, weight, bias, meta, amax_out):
        """numpy_ref.k_layernorm_fwd_fp8 (layernorm.cu): the layer norm of a (N, C) (b None), or of
        res = a + b, written as E4M3 bytes out (N, C) and out_t (C, N) with the scale of meta[0];
        mean, rstd (N,) float32; meta[inv_at] = 1/scale; amax_out (1,) or None. C a multiple of
        16 / itemsize up to the one-pass layer norm's widest row, N a multiple of 8, arrays 16-byte
        aligned."""
        from .ops import LN_FUSED_MAXC
        kernel = "k_layernorm_fwd_fp8"
        C = a.shape[-1]
        N, ct = a.size // C, a.dtype
        vec = 16 // ct.itemsize
        for n, x in (("a", a),) + (() if b is None else (("b", b), ("res", res))):
            check(kernel, n, x, a.shape, ct)
        for n, x in (("weight", weight), ("bias", bias)):
            check(kernel, n, x, (C,), ct)
        for n, x in (("mean", mean), ("rstd", rstd)):
            check(kernel, n, x, a.shape[:-1], np.float32)
        check(kernel, "out", out, (N, C), np.uint8)
        check(kernel, "out_t", out_t, (C, N), np.uint8)
        if N % 8 or not self.ops._ln_vec_rows(a, (out, out_t, res, a, b, weight, bias)):
            raise ValueError(f"{kernel}: rows of {C} {ct} values, {N} rows; expected a multiple of {vec} values up "
                             f"to {LN_FUSED_MAXC}, a multiple of 8 rows and 16-byte aligned arrays")
        rows, warps = int(self.ops.fp8_layernorm_rows), int(self.ops.fp8_layernorm_warps)
        if rows not in (8, 16, 32):
            raise ValueError(f"{kernel}: fp8_layernorm_rows = {rows}; expected 8, 16 or 32")
        if warps not in (4, 8, 16, 32):
            raise ValueError(f"{kernel}: fp8_layernorm_warps = {warps}; expected 4, 8, 16 or 32")
        null = np.uint64(0)
        defs = (f"-DLN_MAXC={-(-C // (32 * vec)) * 32 * vec}", f"-DLN_FP8_ROWS={rows}")
        self.ops.rt.launch("layernorm.cu", "k_layernorm_fwd_fp8", ct, -(-N // rows), 32 * warps,
                           (out, out_t, null if b is None else res, mean, rstd, a, null if b is None else b, weight,
                            bias, i64(N), i32(C), meta, self._inv_at(kernel, meta), self._amax_out(kernel, amax_out)),
                           defs=defs + ((f"-DLN_FP8_WARPS={warps}",) if warps != 8 else ()))

    def attention_fits(self, T, C, hs) -> bool:
        """The FP8 attention kernels take these shapes: the wgmma kernels (CudaOps._hopper) at this
        head size, T a multiple of 64 (a warpgroup's rows are a 64-row tile of the casts), C a
        multiple of 16."""
        return T % 64 == 0 and C % FP8_MULTIPLE == 0 and self.ops._hopper(hs)

    def _attn_fp8_check(self, kernel, qkv, n_head, arrays):
        """The shapes (B, T, C, NH, hs) of an FP8 attention launch, after its conditions
        (attention_fits, arrays 16-byte aligned)."""
        from .ops import _attn_shapes
        B, T, C, NH, hs = _attn_shapes(kernel, qkv, n_head)
        if not self.attention_fits(T, C, hs) or any(a.data.ptr % 16 for a in arrays):
            raise ValueError(f"{kernel}: B={B} T={T} C={C} head size {hs}; expected the wgmma attention "
                             f"(compute capability 9.0), T a multiple of 64, C of {FP8_MULTIPLE}, 16-byte "
                             "aligned arrays")
        return B, T, C, NH, hs

    def k_attn_fwd_fp8(self, out, lse, q, q_t, meta, amax_out, qkv, n_head):
        """numpy_ref.k_attn_fwd_fp8 (attention_hopper.cu k_attn_flash_fwd_fp8): out (B,T,C) and lse
        (B,NH,T) as k_attn_fwd writes them, and out as E4M3 bytes q (B*T, C) and q_t (C, B*T) with
        the scale of meta[0]; meta[inv_at] = 1/scale; amax_out (1,) or None."""
        from .ops import attn_scale, hopper_geometry
        kernel = "k_attn_fwd_fp8"
        B, T, C, NH, hs = self._attn_fp8_check(kernel, qkv, n_head, (qkv, out))
        ct = qkv.dtype
        check(kernel, "out", out, (B, T, C), ct)
        check(kernel, "lse", lse, (B, NH, T), np.float32)
        check(kernel, "q", q, (B * T, C), np.uint8)
        check(kernel, "q_t", q_t, (C, B * T), np.uint8)
        geo = hopper_geometry(hs)
        self.ops.rt.launch("attention_hopper.cu", "k_attn_flash_fwd_fp8", ct, (B * NH, -(-T // geo["fwd_rows"])),
                           geo["threads"], (out, lse, q, q_t, meta, self._inv_at(kernel, meta),
                                            self._amax_out(kernel, amax_out), qkv, i32(B), i32(T), i32(NH),
                                            attn_scale(hs)),
                           shared_mem=geo["k_attn_flash_fwd"], hs=hs, arch="sm_90a")

    def k_attn_bwd_fp8(self, q, q_t, partial, meta, amax_out, dout, qkv, out, lse, n_head, fmt):
        """numpy_ref.k_attn_bwd_fp8 (attention_hopper.cu k_attn_flash_bwd_dq_fp8, then
        k_attn_flash_bwd_dkv_fp8): dqkv as k_attn_bwd writes it (accumulate=False), but only as
        bytes of format fmt q (B*T, 3C) and q_t (3C, B*T) with the scale of meta[0], its column
        sums over each 64-row tile into partial (B*T / 64, 3C) float32 or None, its amax into
        amax_out (1,) or None; meta[inv_at] = 1/scale. dqkv itself is not written."""
        from .ops import attn_scale, hopper_geometry
        kernel = "k_attn_bwd_fp8"
        B, T, C, NH, hs = self._attn_fp8_check(kernel, qkv, n_head, (qkv, dout, out))
        ct, N = qkv.dtype, B * T
        for name, x in (("dout", dout), ("out", out)):
            check(kernel, name, x, (B, T, C), ct)
        check(kernel, "lse", lse, (B, NH, T), np.float32)
        check(kernel, "q", q, (N, 3 * C), np.uint8)
        check(kernel, "q_t", q_t, (3 * C, N), np.uint8)
        if partial is not None:
            check(kernel, "partial", partial, (N // 64, 3 * C), np.float32)
        geo, hop = hopper_geometry(hs), dict(hs=hs, arch="sm_90a", defs=self._defs(fmt))
        D = self.ops.workspace.get("attn_D", B * NH * T, np.float32)
        scale, dims = attn_scale(hs), (i32(B), i32(T), i32(NH))
        part, amax = (np.uint64(0) if partial is None else partial), self._amax_out(kernel, amax_out)
        self.ops.rt.launch("attention_hopper.cu", "k_attn_flash_bwd_dq_fp8", ct, (B * NH, -(-T // geo["rows"])),
                           geo["threads"], (q, q_t, part, meta, self._inv_at(kernel, meta), amax, qkv, dout, out, lse,
                                            D) + dims + (scale,), shared_mem=geo["k_attn_flash_bwd_dq"], **hop)
        self.ops.rt.launch("attention_hopper.cu", "k_attn_flash_bwd_dkv_fp8", ct, (B * NH, -(-T // geo["keys"])),
                           geo["dkv_threads"], (q, q_t, part, meta, amax, qkv, dout, lse, D) + dims + (scale,),
                           shared_mem=geo["k_attn_flash_bwd_dkv"], **hop)

    @staticmethod
    def _amax_out(kernel, amax_out):
        if amax_out is None:
            return np.uint64(0)
        check(kernel, "amax_out", amax_out, (1,), np.float32)
        return amax_out

    def k_fp8_delayed_roll(self, rows, state):
        """The delayed scales' rows (n, META_STRIDE) at the end of an optimizer step (numpy_ref
        k_fp8_delayed_roll; the step's skip flag read from the optimizer state on the device)."""
        check("k_fp8_delayed_roll", "rows", rows, dtype=np.float32)
        check("k_fp8_delayed_roll", "state", state, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] < DELAYED_HIST_AT + FP8_HIST:
            raise ValueError(f"k_fp8_delayed_roll: rows has shape {rows.shape}; expected (n, >= "
                             f"{DELAYED_HIST_AT + FP8_HIST})")
        n = rows.shape[0]
        self.ops.rt.launch("fp8.cu", "k_fp8_delayed_roll", np.float32, -(-n // 32), 32,
                           (rows, i32(n), i32(rows.shape[1]), state, i32(S_SKIP)))

    def k_fp8_dgelu_colsum_amax(self, partial, meta, dact, pre, rows_per_chunk):
        """dact (N, H) *= gelu'(pre) in place (k_mlp_bwd_gelu's derivative); partial (chunks, H)
        float32 = the column sums of the new dact over each chunk of rows_per_chunk rows, in
        k_colsum_partial's order (k_colsum_final of them gives _colsum_add's bits); meta[0] =
        max |new dact| (zeroed first: a memset). H a multiple of 8, rows 16-byte aligned."""
        kernel = "k_fp8_dgelu_colsum_amax"
        check(kernel, "meta", meta, dtype=np.float32)
        check(kernel, "pre", pre, dact.shape, dact.dtype)
        self._check_x(kernel, dact)
        N, H = dact.shape
        vec = 16 // dact.dtype.itemsize
        chunks = -(-N // rows_per_chunk)
        check(kernel, "partial", partial, (chunks * H,), np.float32)
        if H % vec or pre.data.ptr % 16:
            raise ValueError(f"{kernel}: H = {H} (need a multiple of {vec}), pre at {pre.data.ptr:#x} "
                             "(need 16-byte alignment)")
        cp.cuda.runtime.memsetAsync(meta.data.ptr, 0, 4, cp.cuda.get_current_stream().ptr)
        self.ops.rt.launch("fp8.cu", "k_fp8_dgelu_colsum_amax", dact.dtype, (-(-H // (32 * vec)), chunks),
                           THREADS, (partial, meta, dact, pre, i64(N), i32(H), i32(rows_per_chunk)),
                           defs=self._defs(FP8_FWD) + self._gelu_defs())

    @staticmethod
    def _check_many(kernel, meta, table):
        check(kernel, "meta", meta, dtype=np.float32)
        check(kernel, "table", table, dtype=np.int64)
        if table.ndim != 2 or table.shape[1] != TABLE_COLS or meta.ndim != 2 or meta.shape[0] != table.shape[0] \
                or meta.shape[1] % 2 or meta.shape[1] * 4 % 16:
            raise ValueError(f"{kernel}: meta {meta.shape} and table {table.shape}; expected (n, 2m) float32 with "
                             f"m * 8 bytes a multiple of 16, and (n, {TABLE_COLS}) int64")

    def make_table(self, xs, outs, outs_t, table=None):
        """The (n, TABLE_COLS) int64 device table of a *_many launch for tensors xs (each (R, K),
        the compute dtype) and their uint8 outputs outs (R, K) / outs_t (K, R) (an entry None
        skips that output): written now (a synchronous copy: at start-up, never inside a graph),
        into table where given. Every size and address is checked here, once."""
        rows = []
        for i, (x, o, ot) in enumerate(zip(xs, outs, outs_t, strict=True)):
            what = f"make_table: tensor {i}"
            self._check_x(what, x)
            if x.ndim != 2 or x.shape[0] % FP8_MULTIPLE or x.shape[1] % FP8_MULTIPLE:
                raise ValueError(f"{what}: shape {x.shape}; expected (R, K), both multiples of {FP8_MULTIPLE}")
            if x.dtype != xs[0].dtype:
                raise ValueError(f"{what}: dtype {x.dtype}, the first tensor's is {xs[0].dtype}")
            R, K = x.shape
            for name, a, shape in (("out", o, (R, K)), ("out_t", ot, (K, R))):
                if a is not None:
                    check(what, name, a, shape, np.uint8)
                    if a.data.ptr % 16:
                        raise ValueError(f"{what}: {name} at {a.data.ptr:#x}; expected 16-byte alignment")
            rows.append([x.data.ptr, 0 if o is None else o.data.ptr, 0 if ot is None else ot.data.ptr, R, K])
        host = np.array(rows, dtype=np.int64).reshape(-1, TABLE_COLS)
        if table is None:
            table = cp.empty(host.shape, dtype=np.int64)
        check("make_table", "table", table, host.shape, np.int64)
        table.set(host)
        return table

    def _many_grid(self, table_host, per_block):
        """(blocks per tensor, tensors): enough blocks for the largest tensor, at most MANY_BLOCKS."""
        most = max(int(np.prod(r)) for r in table_host)
        return (max(1, min(MANY_BLOCKS, -(-most // per_block))), len(table_host))

    def k_fp8_amax_many(self, meta, table, dtype, sizes):
        """meta (n, 2m) = 0, then meta[t, 0] = max |x_t| for every tensor t of table (make_table);
        dtype: the tensors' dtype, sizes: their (R, K) (the launch reads neither: the table holds
        them on the device; the grid comes from sizes)."""
        self._check_many("k_fp8_amax_many", meta, table)
        cp.cuda.runtime.memsetAsync(meta.data.ptr, 0, meta.nbytes, cp.cuda.get_current_stream().ptr)
        self.ops.rt.launch("fp8.cu", "k_fp8_amax_many", dtype, self._many_grid(sizes, 8 * THREADS), THREADS,
                           (meta, i32(meta.shape[1]), table))

    def k_fp8_cast_transpose_many(self, meta, table, fmt, dtype, sizes):
        """For every tensor t of table: its out and/or out_t as k_fp8_cast_transpose writes them,
        scale from meta[t, 0], 1/scale into meta[t, m] (meta (n, 2m))."""
        self._check_many("k_fp8_cast_transpose_many", meta, table)
        tiles = [(-(-R // TILE) * -(-K // TILE), 1) for R, K in sizes]
        self.ops.rt.launch("fp8.cu", "k_fp8_cast_transpose_many", dtype, self._many_grid(tiles, 1), THREADS,
                           (meta, i32(meta.shape[1]), i32(meta.shape[1] // 2), table), defs=self._defs(fmt))

    # ------------------------------------------------------------ the FP8 weight cache
    def use_weight_cache(self, weights, data, meta, table, alone=0):
        """Keep FP8 copies of weights (a list of (R, K) compute-dtype arrays that the products will
        be given, the same views) in data (uint8), their (amax, 1/scale) in meta (float32, META_STRIDE
        a weight) and the kernels' table in table: the rows weight_cache_rows planned. Fills them
        now (refresh_weight_cache); from then on the products read the copies of these weights.
        alone: the first `alone` weights are refreshed by the single-tensor kernels (k_fp8_amax,
        k_fp8_cast_transpose: the same bytes) rather than in the *_many launches, whose grid gives
        every tensor the blocks of the largest: the classifier's embedding (V, C) is 16 times the
        largest linear weight at ANDREA-120M, and its blocks alone would be the launch's tail."""
        shapes = [tuple(w.shape) for w in weights]
        need = {name: (shape, dtype) for name, shape, dtype in weight_cache_rows(shapes)}
        for name, a in (("fp8_wcache", data), ("fp8_wmeta", meta), ("fp8_wtable", table)):
            check("use_weight_cache", name, a, need[name][0], need[name][1])
        if data.data.ptr % CACHE_ALIGN or meta.data.ptr % 128:
            raise ValueError(f"use_weight_cache: fp8_wcache at {data.data.ptr:#x} and fp8_wmeta at "
                             f"{meta.data.ptr:#x}: expected {CACHE_ALIGN}- and 128-byte alignment")
        meta2 = meta.reshape(len(weights), META_STRIDE)
        outs, outs_t, off = [], [], 0
        for R, K in shapes:
            n = R * K
            outs.append(data[off:off + n].reshape(R, K))
            outs_t.append(data[off + _aligned(n):off + _aligned(n) + n].reshape(K, R))
            off += 2 * _aligned(n)
        self.make_table(weights, outs, outs_t, table)
        self._cache_args = (meta2, table, weights[0].dtype, shapes)
        self._cache_weights = list(weights)
        self._amax_taken = False  # k_adamw_step_amax took the amax the next refresh needs
        self._cache_alone = [(w, outs[i], outs_t[i], meta2[i]) for i, w in enumerate(weights[:alone])]
        self.cache = {(w.data.ptr, tuple(w.shape), w.dtype.name): (q, qt, meta2[i])
                      for i, (w, q, qt) in enumerate(zip(weights, outs, outs_t))}
        self.refresh_weight_cache()

    def refresh_weight_cache(self):
        """Rewrite every cached copy and its scale from the weights as they are now: after each
        optimizer update and after the weights are loaded (Engine). Three launches (a memset,
        k_fp8_amax_many, k_fp8_cast_transpose_many); nothing where no cache is in use."""
        if self._cache_args is None:
            return
        meta, table, dtype, shapes = self._cache_args
        taken, self._amax_taken = self._amax_taken, False  # by the update just queued: no amax pass
        k = len(self._cache_alone)  # the first k weights, on their own
        for w, q, q_t, row in self._cache_alone:
            if not taken:
                self.k_fp8_amax(row, w)
            self.k_fp8_cast_transpose(q, q_t, row, w, FP8_FWD)
        if k < len(shapes):
            if not taken:
                self.k_fp8_amax_many(meta[k:], table[k:], dtype, shapes[k:])
            self.k_fp8_cast_transpose_many(meta[k:], table[k:], FP8_FWD, dtype, shapes[k:])

    def adamw_amax_fits(self, params_c, floats) -> bool:
        """The update into params_c can take the weight cache's amax (k_adamw_step_amax): a cache
        is in use, the cached weights lie in params_c in increasing address order without overlap,
        each at a multiple of 4 elements, and the kernel's vectors fit (the float32 buffers floats,
        params grads m v, 16-byte aligned; params_c 4 elements aligned, a multiple of 4 long)."""
        if self._cache_args is None or len(self._cache_weights) > ADAMW_AMAX_MAX:
            return False
        base, size, item = params_c.data.ptr, params_c.size, params_c.itemsize
        if params_c.dtype != self._cache_args[2] or size % 4 or base % (4 * item) or \
                any(x.data.ptr % 16 for x in floats):
            return False
        end = 0  # the weights in increasing address order, apart (the kernel's binary search)
        for w in self._cache_weights:
            off = w.data.ptr - base
            if off < end or off % (4 * item) or off // item + w.size > size:
                return False
            end = off + w.nbytes
        return True

    def k_adamw_step_amax(self, args, zero_grads=True):
        """numpy_ref.k_adamw_step_amax with the cached weights as the segments: the cache's meta
        zeroed, then optim.cu's update, which also takes their amax into it; the next
        refresh_weight_cache casts without its amax pass. args: ops.adamw_args (the caller checked
        the buffers and adamw_amax_fits)."""
        meta, table, _, shapes = self._cache_args
        params, pc = args[0], args[1]
        cp.cuda.runtime.memsetAsync(meta.data.ptr, 0, meta.nbytes, cp.cuda.get_current_stream().ptr)
        self.ops.rt.launch("optim.cu", "k_adamw_step_amax", pc.dtype, blocks(params.size), THREADS,
                           args + (i32(int(bool(zero_grads))), table, i32(len(shapes)), meta, i32(META_STRIDE)))
        self._amax_taken = True

    # ------------------------------------------------------------ input slots (X^T kept, amax from its producer)
    def use_input_slots(self, weights, inputs, meta, xt=None, producer_amax=False):
        """Slots for the inputs of the products of weights (a list of (OC, IC) compute-dtype
        arrays) whose inputs are the saved activations inputs (each (..., IC), the same views the
        layers will be given, alive from a forward product to its backward): their (amax,
        1/scale) rows in meta (float32, META_STRIDE a weight) and, where xt (uint8) is given, FP8
        X^T of each input there, for the backward (input_slot_rows planned both). producer_amax:
        the layer norms writing an input also reduce its amax (producer_amax below)."""
        if len(weights) != len(inputs) or not weights:
            raise ValueError(f"use_input_slots: {len(weights)} weights and {len(inputs)} inputs; expected as many, "
                             "at least one")
        N = inputs[0].size // inputs[0].shape[-1]
        shapes = [tuple(w.shape) for w in weights]
        need = {name: (shape, dtype) for name, shape, dtype in input_slot_rows(shapes, N, xt is not None)}
        check("use_input_slots", "fp8_xmeta", meta, *need["fp8_xmeta"])
        if xt is not None:
            check("use_input_slots", "fp8_xt", xt, *need["fp8_xt"])
            if xt.data.ptr % CACHE_ALIGN:
                raise ValueError(f"use_input_slots: fp8_xt at {xt.data.ptr:#x}; expected {CACHE_ALIGN}-byte alignment")
        if meta.data.ptr % 128:
            raise ValueError(f"use_input_slots: fp8_xmeta at {meta.data.ptr:#x}; expected 128-byte alignment")
        block = meta.reshape(len(weights), META_STRIDE)
        self.slots, self.slot_of_input, off = {}, {}, 0
        shared = {}
        for x in inputs:
            shared[x.data.ptr] = shared.get(x.data.ptr, 0) + 1
        for i, (w, x) in enumerate(zip(weights, inputs)):
            OC, IC = w.shape
            if x.shape[-1] != IC or x.size != N * IC or x.dtype != w.dtype:
                raise ValueError(f"use_input_slots: input {i} has shape {x.shape} and dtype {x.dtype}; its weight "
                                 f"{w.shape} {w.dtype} wants (..., {IC}) with {N} rows of that dtype")
            t = None
            if xt is not None:
                t = xt[off:off + IC * N].reshape(IC, N)
                off += _aligned(IC * N)
            slot = InputSlot(first=i == 0, x=(x.data.ptr, N, IC), meta=block[i], xt=t)
            self.slots[w.data.ptr] = slot
            if shared[x.data.ptr] == 1:  # a workspace every layer reuses (act) has no producer here
                self.slot_of_input[x.data.ptr] = slot
        self._slot_block, self._producer_amax = block, bool(producer_amax)

    # ------------------------------------------------------------ delayed scaling
    def use_delayed_scales(self, tensors, block):
        """Delayed scales (docs/FP8.md) for the tensors (role, w): "act" the input act = gelu(pre)
        of w's product (the MLP's second), "x" the input of w's product (its input slot's: the
        attention output), "dy" the output gradient of w's product. block (n, META_STRIDE)
        float32 in the engine's arena (delayed_rows), a row each in that order. The input slots
        (use_input_slots, called first) of "act" and "x" take their 1/scale from these rows. The
        rows start empty: the next step takes its amax first. Returns the DelayedScales."""
        if block.shape != (len(tensors), META_STRIDE) or block.dtype != np.float32:
            raise ValueError(f"use_delayed_scales: {len(tensors)} tensors, block {block.shape} {block.dtype}; "
                             f"expected a ({len(tensors)}, {META_STRIDE}) float32 block")
        rows = {}
        for i, (role, w) in enumerate(tensors):
            if role not in ("act", "x", "dy"):
                raise ValueError(f"use_delayed_scales: role {role!r}; expected act, x or dy")
            rows[role, w.data.ptr] = block[i]
            slot = self.slots.get(w.data.ptr) if self.slots and role != "dy" else None
            if slot is not None:
                slot.meta, slot.delayed = block[i], True
            elif role == "x":
                raise ValueError("use_delayed_scales: an input (role x) needs its product's input slot")
        self.delayed = DelayedScales(self, block, rows)
        return self.delayed

    def _delayed_row(self, role, w):
        return self.delayed.rows.get((role, w.data.ptr)) if self.delayed is not None else None

    @property
    def delayed_live(self) -> bool:
        return self.delayed is not None and self.delayed.live

    def _record_at(self, row):
        """Where a pass reduces its amax: row's current step, while recording."""
        return row[DELAYED_CUR:DELAYED_CUR + 1] if self.delayed.record else None

    def _arm(self, slot):
        """Make slot's amax zero before a kernel reduces into it: the first slot (layer 0's ln1,
        quantised first in every forward pass) zeroes every slot's row in one memset; another
        slot needs a memset of its own only if its amax was used since."""
        stream = cp.cuda.get_current_stream().ptr
        if slot.first:
            cp.cuda.runtime.memsetAsync(self._slot_block.data.ptr, 0, self._slot_block.nbytes, stream)
            for s in self.slots.values():
                s.state = "zeroed"
        elif slot.state != "zeroed":
            cp.cuda.runtime.memsetAsync(slot.meta.data.ptr, 0, 4, stream)
        slot.state = "armed"

    def _slot_written(self, out):
        """The input slot whose whole input is out (a layer norm's output), or None."""
        slot = self.slot_of_input.get(out.data.ptr) if self.slot_of_input else None
        return slot if slot is not None and out.size == slot.x[1] * slot.x[2] else None

    def producer_amax(self, out):
        """Where a layer-norm forward that writes out reduces max |out| (its amax argument): the
        meta row of out's input slot, zeroed first, or None where out has no slot (or the
        producers' amax is off). The slot's next product then skips its k_fp8_amax."""
        slot = self._slot_written(out) if self._producer_amax else None
        if slot is None or slot.delayed:  # a delayed one: its cast's
            return None
        self._arm(slot)
        slot.state = "amax"
        return slot.meta

    def layernorm_operand(self, out):
        """Where a layer-norm forward writing out (N, C) writes it as its product's FP8 operand
        instead (k_layernorm_fwd_fp8, CudaOps.fp8_layernorm_cast): _written_operand's."""
        return self._written_operand(out, self.ops.fp8_layernorm_cast)

    def attention_operand(self, out):
        """Where the attention forward writing out (B, T, C) writes it as the attention
        projection's FP8 operand too (k_attn_fwd_fp8, CudaOps.fp8_attention_cast): as
        layernorm_operand (out itself is still written: the backward reads it)."""
        return self._written_operand(out, self.ops.fp8_attention_cast)

    def _written_operand(self, out, enabled):
        """Where the kernel that writes out (N, C) writes it as its product's FP8 operand itself:
        enabled, and out is the input of a slot with a delayed scale that holds a history, and the
        slot keeps X^T. Returns (q (N, C) in the workspace, where the product takes it, X^T, the
        delayed row, where the kernel records its amax or None), marking the slot "cast" and
        ready; else None (the operand is cast from out as before)."""
        slot = self._slot_written(out)
        if (slot is None or not slot.delayed or slot.xt is None or not self.delayed_live
                or not enabled or slot.x[1] % 8):
            return None
        N, IC = slot.x[1], slot.x[2]
        q = self.ops.workspace.get("fp8_x", N * IC, np.uint8).reshape(N, IC)
        slot.state, slot.ready = "cast", True
        return q, slot.xt, slot.meta, self._record_at(slot.meta)

    def attention_grad_operand(self, dqkv, qkv):
        """Where the attention backward writing dqkv (B, T, 3C) writes it as the FP8 output
        gradient of the QKV product instead (k_attn_bwd_fp8, CudaOps.fp8_attention_cast): qkv was
        made by a forward product here, whose output gradient has a delayed scale holding a
        history, and the casts of dY write the bias gradient's column partials (fp8_cast_colsum,
        64-row tiles). Returns (fp8 dY (B*T, 3C), fp8 dY^T, the delayed row, where the kernels
        record the amax or None, the column partials (B*T / 64, 3C), the gradient format) and
        keeps them for that product's backward (_dgrad_wgrad, which then reads dqkv no more: it is
        not written); else None (dqkv is written as before)."""
        ops = self.ops
        w = self._made_by.get(qkv.data.ptr)
        if (w is None or not ops.fp8_attention_cast or not self.delayed_live or not ops.fp8_cast_colsum
                or int(ops.fp8_tile_rows) != 64):
            return None
        row = self.delayed.rows.get(("dy", w))
        if row is None:
            return None
        N, K = dqkv.size // dqkv.shape[-1], dqkv.shape[-1]
        chunks = N // 64
        partial = ops._colsum_partials("colsum_a", chunks, K)
        q = ops.workspace.get("fp8_dy", N * K, np.uint8).reshape(N, K)
        q_t = self._dy_t(K, N)
        self._pending_dy = (dqkv.data.ptr, w, q, q_t, row, partial, chunks, self.grad_fmt)
        return q, q_t, row, self._record_at(row), partial.reshape(chunks, K), self.grad_fmt

    def drop_pending_dy(self):
        """Forget what attention_grad_operand kept (a backward of attention starts: its dqkv is
        either written in 16 bits or kept anew)."""
        self._pending_dy = None

    def _take_pending_dy(self, dy2, w):
        """(fp8 dY, fp8 dY^T, 1/scale, partial, chunks) the attention backward wrote for w's
        product with output gradient dy2 (attention_grad_operand), or None."""
        pend, self._pending_dy = self._pending_dy, None
        if pend is None or pend[0] != dy2.data.ptr:
            return None
        dqkv, wp, q, q_t, row, partial, chunks, fmt = pend
        if wp != w.data.ptr or fmt != self.grad_fmt:
            raise RuntimeError(f"the attention backward wrote dqkv at {dqkv:#x} as the FP8 output gradient of "
                               f"another product or format ({fmt}) than the one reading it now ({self.grad_fmt})")
        return q, q_t, row[META_STRIDE // 2:META_STRIDE // 2 + 1], partial, chunks

    def _slot(self, w, x2, forward=False):
        """The input slot of w's product where x2 (N, IC) is its registered input, else None (a
        forward product of w on another input leaves the slot's X^T stale: ready is cleared)."""
        slot = self.slots.get(w.data.ptr) if self.slots else None
        if slot is None:
            return None
        if slot.x != (x2.data.ptr, *x2.shape):
            if forward:
                slot.ready = False
            return None
        return slot

    def cached(self, w):
        """(fp8(w) (R, K), fp8(w)^T (K, R), meta row: amax at 0, 1/scale at META_STRIDE // 2) of a
        weight the cache keeps, or None."""
        return self.cache.get((w.data.ptr, tuple(w.shape), w.dtype.name)) if self.cache else None

    def _weight(self, w, transpose=False):
        """fp8(w) (R, K), or with transpose fp8(w)^T (K, R), and its 1/scale (a (1,) view): the
        cached copy where w is a cached weight, else quantised now into the workspace."""
        hit = self.cached(w)
        if hit is None:
            q, q_t, inv = self._quantise("w", w, FP8_FWD, transpose=transpose)
            return (q_t if transpose else q), inv
        q, q_t, row = hit
        return (q_t if transpose else q), row[META_STRIDE // 2:META_STRIDE // 2 + 1]

    # ------------------------------------------------------------ operands and products
    def _meta(self, role):
        m = self.ops.workspace.get("fp8_meta", len(META_SLOTS) * META_STRIDE, np.float32)
        i = META_SLOTS[role] * META_STRIDE
        return m[i:i + META_STRIDE]

    def _quantise(self, role, x2, fmt, transpose=False, both=False, amax_done=False, partial=None, row=None,
                  record=True):
        """x2 (R, K) quantised into the role's workspace: (q, q_t, 1/scale as a (1,) view); q is
        (R, K) unless transpose without both, q_t (K, R) with transpose. amax_done: the kernel
        that wrote x2 put its amax in the role's meta already (k_fp8_dgelu_colsum_amax). partial
        (with transpose): x2's column partials go there too (k_fp8_cast_transpose_colsum). row
        (with transpose): x2's delayed scale, whose history gives the scale (the first step: its
        amax taken first) and, with record, takes x2's amax."""
        R, K = x2.shape
        if row is not None:
            if not transpose:
                raise ValueError("_quantise: a delayed scale's cast transposes (its kernels are the tile casts)")
            return self._quantise_delayed(role, x2, fmt, both, partial, row, record)
        meta = self._meta(role)
        slot = {"x": "fp8_x", "w": "fp8_w", "dy": "fp8_dy"}[role]
        if not amax_done:
            self.k_fp8_amax(meta, x2)
        if not transpose:
            q = self.ops.workspace.get(slot, R * K, np.uint8).reshape(R, K)
            self.k_fp8_cast(q, meta, x2, fmt)
            return q, None, meta[META_STRIDE // 2:META_STRIDE // 2 + 1]
        q_t = self._dy_t(K, R) if role == "dy" else self.ops.workspace.get(slot, R * K, np.uint8).reshape(K, R)
        q = self.ops.workspace.get(slot, R * K, np.uint8).reshape(R, K) if both else None
        if partial is None:
            self.k_fp8_cast_transpose(q, q_t, meta, x2, fmt)
        else:
            self.k_fp8_cast_transpose_colsum(q, q_t, meta, x2, fmt, partial)
        return q, q_t, meta[META_STRIDE // 2:META_STRIDE // 2 + 1]

    def _quantise_delayed(self, role, x2, fmt, both, partial, row, record):
        R, K = x2.shape
        slot = {"x": "fp8_x", "dy": "fp8_dy"}[role]
        q_t = self._dy_t(K, R) if role == "dy" else self.ops.workspace.get(slot, R * K, np.uint8).reshape(K, R)
        q = self.ops.workspace.get(slot, R * K, np.uint8).reshape(R, K) if both else None
        if not self.delayed_live:
            self.k_fp8_amax(row, x2)
        rec = self._record_at(row) if record else None
        if partial is None:
            self.k_fp8_cast_transpose_amax(q, q_t, row, x2, fmt, rec)
        else:
            self.k_fp8_cast_transpose_colsum_amax(q, q_t, row, x2, fmt, partial, rec)
        return q, q_t, row[META_STRIDE // 2:META_STRIDE // 2 + 1]

    def _product(self, D, A, a_fmt, a_inv, B, b_fmt, b_inv, epilogue="none", bias=None, aux=None,
                 beta=0.0, fast_accum=False, workspace=None):
        """D (M, N) [+]= A (M, K) @ B (N, K).T times both inverse scales (cuBLASLt, FP8 operands).
        Raises NoAlgorithm where cuBLASLt has none for this problem and epilogue. workspace: the
        cuBLASLt workspace of a product on another stream."""
        M, K = A.shape
        N = B.shape[0]
        lt = self.ops.lt
        lt.matmul(D, A, B, False, True, M, N, K, K, K, N, FP8_CUDA_TYPES[a_fmt], cuda_type(D.dtype),
                  epilogue, bias=bias, bias_type=cuda_type(bias.dtype) if bias is not None else None,
                  aux=aux, aux_ld=N if aux is not None else 0, beta=beta, b_type=FP8_CUDA_TYPES[b_fmt],
                  scales=(a_inv, b_inv), fast_accum=fast_accum, workspace=workspace)

    def _fwd_product(self, out2, x2, w, b, fallback):
        """out2 (N, OC) = fp8(x2) @ fp8(w).T + b: the bias on cuBLASLt's epilogue where it has
        one, else a plain product and fallback() (the 16-bit path's bias kernel)."""
        xq, x_inv = self._fwd_operand(x2, w)
        self._fwd_matmul(out2, xq, x_inv, w, b, fallback)

    def _fwd_operand(self, x2, w, pre=None):
        """fp8(x2) (N, IC) in the workspace for the forward product of w, and its 1/scale: with
        x2's input slot, its amax from the producer (or taken here) and X^T kept in one pass.
        pre: x2 is act = gelu(pre), made from pre by the GELU kernels (x2 itself is not read)."""
        row = self._delayed_row("act" if pre is not None else "x", w)
        if row is not None:
            slot = self._slot(w, x2, forward=True)
            if pre is not None or slot is not None:  # an input's delayed scale: its slot's input only
                return self._fwd_delayed(x2, pre, row, slot)
        src, amax, cast_t = ((x2, self.k_fp8_amax, self.k_fp8_cast_transpose) if pre is None else
                             (pre, self.k_fp8_gelu_amax, self.k_fp8_gelu_cast_transpose))
        slot = self._slot(w, x2, forward=True)
        if slot is None:
            meta, xt = self._meta("x"), None
            amax(meta, src)
        else:  # x2's amax from its producer, or taken here; with a kept X^T both forms in one pass
            if slot.state != "amax":
                self._arm(slot)
                amax(slot.meta, src, zeroed=True)
            slot.state, meta, xt = "used", slot.meta, slot.xt
            slot.ready = xt is not None
        N, IC = x2.shape
        xq = self.ops.workspace.get("fp8_x", N * IC, np.uint8).reshape(N, IC)
        if xt is None and pre is None:
            self.k_fp8_cast(xq, meta, src, FP8_FWD)
        else:
            cast_t(xq, xt, meta, src, FP8_FWD)
        return xq, meta[META_STRIDE // 2:META_STRIDE // 2 + 1]

    def _fwd_delayed(self, x2, pre, row, slot):
        """_fwd_operand with a delayed scale (x2 = act = gelu(pre) made from pre, or with pre None
        x2 itself): one pass casts it with the scale of row's history and reduces its amax into
        the row (the first step: its amax taken first); X^T kept in the slot (where there is
        one), whose 1/scale is the row's."""
        N, IC = x2.shape
        if slot is not None and slot.state == "cast":  # its layer norm wrote the operand (layernorm_operand)
            slot.state = "used"
            q = self.ops.workspace.get("fp8_x", N * IC, np.uint8).reshape(N, IC)
            return q, row[META_STRIDE // 2:META_STRIDE // 2 + 1]
        xt = None
        if slot is not None:
            slot.state, xt = "used", slot.xt
            slot.ready = xt is not None
        if not self.delayed_live:
            (self.k_fp8_amax if pre is None else self.k_fp8_gelu_amax)(row, x2 if pre is None else pre)
        xq = self.ops.workspace.get("fp8_x", N * IC, np.uint8).reshape(N, IC)
        if pre is None:
            self.k_fp8_cast_transpose_amax(xq, xt, row, x2, FP8_FWD, self._record_at(row))
        else:
            self.k_fp8_gelu_cast_transpose_amax(xq, xt, row, pre, FP8_FWD, self._record_at(row))
        return xq, row[META_STRIDE // 2:META_STRIDE // 2 + 1]

    def _fwd_matmul(self, out2, xq, x_inv, w, b, fallback):
        """out2 = xq @ fp8(w).T * both inverse scales + b (cuBLASLt's bias epilogue, else fallback())."""
        from .cublaslt import NoAlgorithm
        wq, w_inv = self._weight(w)
        try:
            self._product(out2, xq, FP8_FWD, x_inv, wq, FP8_FWD, w_inv, "bias", bias=b, fast_accum=True)
        except NoAlgorithm:
            self._product(out2, xq, FP8_FWD, x_inv, wq, FP8_FWD, w_inv, fast_accum=True)
            fallback()

    def _dgrad_wgrad(self, dinp2, dw, dy2, x2, w, dx_epilogue=None, accumulate=True, dy_amax=False, x_t=None,
                     db=None, dy_q=None):
        """The two backward products of one linear layer with output gradient dy2: dinp2 +=
        fp8(dY) @ fp8(w) (accumulate=False: =; or, with dx_epilogue, written through it) and dw +=
        fp8(dY).T @ fp8(x2). dy_amax: dy2's amax is in the dy meta already. x_t: (fp8(X)^T, its
        1/scale) made by the caller (x2 is then not read). db: the bias gradient, += the column
        sums of dy2: its partials written by dY's cast (CudaOps.fp8_cast_colsum), else the
        two-pass column sums. dy_q: (fp8(dY), fp8(dY)^T, 1/scale) made by the caller (dy2 is then
        not read)."""
        g = self.grad_fmt
        ops, partial = self.ops, None
        pend = self._take_pending_dy(dy2, w)
        if pend is not None:  # the attention backward wrote fp8(dY), fp8(dY)^T and the column partials
            dy_q, (partial, chunks) = pend[:3], pend[3:]
            if db is None:
                raise RuntimeError("the attention backward wrote the QKV bias's column partials; "
                                   "its gradient is missing")
        elif db is not None and ops.fp8_cast_colsum:
            chunks = -(-dy2.shape[0] // int(ops.fp8_tile_rows))
            partial = ops._colsum_partials("colsum_a", chunks, dy2.shape[1])
        if dy_q is not None:  # the attention's or the dGELU pass's, with dY's delayed scale
            dq, dq_t, d_inv = dy_q
            dy_own_scale = True
        else:
            row = None if dy_amax else self._delayed_row("dy", w)
            dq, dq_t, d_inv = self._quantise("dy", dy2, g, transpose=True, both=True, amax_done=dy_amax,
                                             partial=partial, row=row)
            dy_own_scale = row is not None  # else 1/scale is in the dy meta, which the next cast rewrites
        wq_t, w_inv = self._weight(w, transpose=True)
        slot = self._slot(w, x2)
        # X^T as the forward product quantised it, kept in the slot with its 1/scale until the next
        # forward pass: with dY's own scale, dW may go to the weight-gradient stream, first, so that
        # it runs beside dX and what follows it
        kept = None
        if x_t is None and slot is not None and slot.ready:
            kept = slot.xt, slot.meta[META_STRIDE // 2:META_STRIDE // 2 + 1]
        early = dy_own_scale and kept is not None and self._wgrad_side(dq_t)
        if early:
            self._wgrad_product(dw, dq_t, g, d_inv, *kept, side=True)
        if dx_epilogue is None:
            self._product(dinp2, dq, g, d_inv, wq_t, FP8_FWD, w_inv, beta=1.0 if accumulate else 0.0)
        else:
            dx_epilogue(dq, g, d_inv, wq_t, w_inv)
        if not early:
            x_t = x_t if x_t is not None else kept
            if x_t is None:  # X again (with a delayed scale: the forward's, nothing recorded)
                row = self._delayed_row("x", w) if slot is not None else None
                x_t = self._quantise("x", x2, FP8_FWD, transpose=True, row=row, record=False)[1:]
            self._wgrad_product(dw, dq_t, g, d_inv, *x_t, side=False)
        if partial is not None:
            ops._colsum_final(db, partial, chunks, dy2.shape[1])
        elif db is not None:
            ops._colsum_add(db, dy2, dy2.shape[0], dy2.shape[1])

    # ------------------------------------------------------------ the weight-gradient stream
    def _dy_t(self, K, R):
        """Where a cast writes fp8(dY)^T (K, R): the workspace's "fp8_dyt", or with the weight-
        gradient stream (CudaOps.fp8_wgrad_stream) the next of its WGRAD_RING buffers, once the
        stream's last product that read it in this pass is done (the current stream waits)."""
        n = K * R
        if not self.ops.fp8_wgrad_stream:
            return self.ops.workspace.get("fp8_dyt", n, np.uint8).reshape(K, R)
        i = self._ring_next
        self._ring_next = (i + 1) % WGRAD_RING
        busy = self._ring_busy.pop(i, None)
        if busy is not None:
            cp.cuda.get_current_stream().wait_event(busy)
        buf = self.ops.workspace.get("fp8_dyt" if i == 0 else f"fp8_dyt{i}", n, np.uint8)
        self._ring_of[buf.data.ptr] = i
        return buf.reshape(K, R)

    def _wgrad_side(self, dq_t) -> bool:
        """A weight-gradient product reading dq_t may run on the weight-gradient stream: it is on
        (CudaOps.fp8_wgrad_stream), dq_t is one of its buffers (_dy_t) and a parameter-gradient
        pass is open (its close joins the stream: join_wgrad)."""
        ops = self.ops
        return bool(ops.fp8_wgrad_stream) and dq_t.data.ptr in self._ring_of and ops.colsums.depth > 0

    def _wgrad_product(self, dw, dq_t, g, d_inv, xq_t, x_inv, side):
        """dw (+)= fp8(dY).T @ fp8(X) (beta 0 where the pass starts dw). side (the caller checked
        _wgrad_side, and nothing the pass writes again is read: X^T and its 1/scale are the input
        slot's, dY's 1/scale its own delayed row's): on the weight-gradient stream, after what the
        current stream queued so far, while the current stream goes on. Else on the current one."""
        ops = self.ops
        beta = 0.0 if ops._param_write(dw) else 1.0
        if not side:
            self._product(dw, dq_t, g, d_inv, xq_t, FP8_FWD, x_inv, beta=beta)
            return
        ring = self._ring_of[dq_t.data.ptr]
        if self._wg_stream is None:  # a wait on an event uses its latest record: the events are reused
            self._wg_stream = cp.cuda.Stream(non_blocking=True)
            new = lambda: cp.cuda.Event(block=False, disable_timing=True)  # noqa: E731
            self._wg_events = (new(), [new() for _ in range(WGRAD_RING)])
        ws = ops.workspace.get("cublaslt_wgrad", WORKSPACE_BYTES, np.uint8)
        fork, done = self._wg_events[0], self._wg_events[1][ring]
        fork.record(cp.cuda.get_current_stream())
        self._wg_stream.wait_event(fork)
        with self._wg_stream:
            self._product(dw, dq_t, g, d_inv, xq_t, FP8_FWD, x_inv, beta=beta, workspace=ws)
        done.record(self._wg_stream)
        self._ring_busy[ring] = self._wg_last = done
        self.wgrad_side_products += 1

    def join_wgrad(self):
        """The current stream waits for every product the weight-gradient stream took (a
        parameter-gradient pass closes: the optimizer and the next forward pass come after);
        the buffers start again from the first."""
        if self._wg_last is not None:
            cp.cuda.get_current_stream().wait_event(self._wg_last)
        self._wg_last, self._ring_busy, self._ring_next = None, {}, 0

    # ------------------------------------------------------------ the layers (numpy_ref's names)
    def k_fp8_linear_fwd(self, out, inp, w, b):
        """out (B,T,OC) = fp8(inp) @ fp8(w).T + b; E4M3 operands, float32 accumulation."""
        OC, IC = w.shape
        self._made_by[out.data.ptr] = w.data.ptr
        self._fwd_product(out.reshape(-1, OC), inp.reshape(-1, IC), w, b, fallback=lambda: self._bias_add(out, b))

    def _bias_add(self, out, b):
        OC = b.size
        N = out.size // OC
        self.ops.rt.launch("linear.cu", "k_bias_add", out.dtype, min(N, MAX_BLOCKS), THREADS, (out, b, i64(N), i32(OC)))

    def k_fp8_linear_bwd(self, dinp, dw, db, dout, inp, w, grad_fmt=None, accumulate=True):
        """Adds into dinp (B,T,IC), dw (OC,IC) float32, db (OC,) float32 (numpy_ref.k_fp8_linear_bwd;
        accumulate=False writes dinp); grad_fmt: this call's gradient format (default the backend's)."""
        with self._grad_format(grad_fmt):
            self._linear_bwd(dinp, dw, db, dout, inp, w, accumulate)

    def _linear_bwd(self, dinp, dw, db, dout, inp, w, accumulate, db_partials=None):
        """k_fp8_linear_bwd; db_partials = (partials, chunks): the kernel that wrote dout also wrote
        its column partials and put its amax in the dy meta (k_fp8_dgelu_colsum_amax)."""
        OC, IC = w.shape
        dy2 = dout.reshape(-1, OC)
        self._dgrad_wgrad(dinp.reshape(-1, IC), dw, dy2, inp.reshape(-1, IC), w, accumulate=accumulate,
                          dy_amax=db_partials is not None, db=db if db_partials is None else None)
        if db_partials is not None:
            self.ops._colsum_final(db, db_partials[0], db_partials[1], OC)

    @contextmanager
    def _grad_format(self, grad_fmt):
        """This call's gradient format (None: the backend's)."""
        saved = self.grad_fmt
        if grad_fmt is not None and grad_fmt not in FP8_FORMATS:
            raise ValueError(f"FP8 gradient format {grad_fmt!r}: expected one of {', '.join(FP8_FORMATS)}")
        self.grad_fmt = grad_fmt or saved
        try:
            yield
        finally:
            self.grad_fmt = saved

    def k_fp8_mlp_fwd(self, out, pre, act, inp, w1, b1, w2, b2):
        """numpy_ref.k_fp8_mlp_fwd: pre = fp8(inp) @ fp8(w1).T + b1 (saved), then out = fp8(act)
        @ fp8(w2).T + b2 with act = gelu(pre): fp8(act) made from pre (k_fp8_gelu_amax,
        k_fp8_gelu_cast_transpose; with w2's input slot X^T kept too). act (workspace) is not
        written: the FP8 path never stores act in 16 bits."""
        H, C = w1.shape
        pre2 = pre.reshape(-1, H)
        self._fwd_product(pre2, inp.reshape(-1, C), w1, b1, fallback=lambda: self._bias_add(pre, b1))
        aq, a_inv = self._fwd_operand(act.reshape(-1, H), w2, pre=pre2)
        self._fwd_matmul(out.reshape(-1, C), aq, a_inv, w2, b2, fallback=lambda: self._bias_add(out, b2))

    def k_fp8_mlp_bwd(self, dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, grad_fmt=None,
                      accumulate=True):
        """numpy_ref.k_fp8_mlp_bwd: adds into dinp (accumulate=False: writes it), dw1, db1, dw2,
        db2; dact workspace, act unused. fp8(act)^T for dw2 is the one the forward kept, or else
        made again from pre (k_fp8_gelu_amax, k_fp8_gelu_cast_transpose: the same bytes); dact =
        fp8(dout) @ fp8(w2), then dact *= gelu'(pre) with its amax and db1's column partials in one
        pass (k_fp8_dgelu_colsum_amax), or, with CudaOps.dgelu_epilogue, cuBLASLt's dGELU epilogue
        (measured slower for FP8 products, docs/FP8.md)."""
        with self._grad_format(grad_fmt):
            self._mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, accumulate)

    def _mlp_bwd(self, dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, accumulate):
        from .cublaslt import NoAlgorithm
        from .ops import colsum_chunks
        ops = self.ops
        H, C = w1.shape
        ct = pre.dtype
        n_h = pre.size
        dy2, act2, dact2, pre2 = dout.reshape(-1, C), act.reshape(-1, H), dact.reshape(-1, H), pre.reshape(-1, H)
        N = dy2.shape[0]
        slot = self._slot(w2, act2)
        x_t = None
        if slot is None or not slot.ready:  # dw2 needs fp8(act)^T: made again from pre, as the forward made it
            row = self._delayed_row("act", w2)
            meta = self._meta("x") if row is None else row
            if row is None or not self.delayed_live:
                self.k_fp8_gelu_amax(meta, pre2)
            q_t = self.ops.workspace.get("fp8_x", N * H, np.uint8).reshape(H, N)
            self.k_fp8_gelu_cast_transpose(None, q_t, meta, pre2, FP8_FWD)
            x_t = (q_t, meta[META_STRIDE // 2:META_STRIDE // 2 + 1])
        dgelu_done = False  # cuBLASLt's dGELU epilogue ran (CudaOps.dgelu_epilogue, where it has one)

        def dact_product(dq, g, d_inv, wq_t, w_inv):  # dact = fp8(dout) @ fp8(w2) [* gelu'(pre)]
            nonlocal dgelu_done
            if ops.dgelu_epilogue:
                try:
                    self._product(dact2, dq, g, d_inv, wq_t, FP8_FWD, w_inv, "dgelu", aux=pre2)
                    dgelu_done = True
                    return
                except NoAlgorithm:
                    pass
            self._product(dact2, dq, g, d_inv, wq_t, FP8_FWD, w_inv)

        self._dgrad_wgrad(None, dw2, dy2, act2, w2, dx_epilogue=dact_product, x_t=x_t, db=db2)
        row = self._delayed_row("dy", w1)
        if row is not None and not ops.dgelu_epilogue:
            self._dact_delayed(dinp, dw1, db1, dact2, pre2, inp, w1, row, accumulate)
            return
        db_partials = None
        if not ops.dgelu_epilogue:
            rpc, chunks = colsum_chunks(N)
            part = ops._colsum_partials("colsum_b", chunks, H)
            self.k_fp8_dgelu_colsum_amax(part, self._meta("dy"), dact2, pre2, rpc)
            db_partials = (part, chunks)
        elif not dgelu_done:  # no epilogue for this problem: the 16-bit path's pass (its tanh form)
            ops.rt.launch("mlp.cu", "k_mlp_bwd_gelu", ct, blocks(n_h), THREADS, (np.uint64(0), dact, pre, i64(n_h)))
        self._linear_bwd(dinp, dw1, db1, dact, inp, w1, accumulate, db_partials)

    def _dact_delayed(self, dinp, dw1, db1, dact2, pre2, inp, w1, row, accumulate):
        """The rest of the MLP backward with dact's delayed scale: one pass over dact and pre
        (k_fp8_dgelu_cast_transpose_colsum_amax) makes fp8(d) and fp8(d)^T for the two products,
        db1's column partials and d's amax for the history, d = dact * gelu'(pre) never stored;
        the first step takes d's amax in a pass of its own first (the same kernel, writing nothing
        else)."""
        ops = self.ops
        N, H = dact2.shape
        C = w1.shape[1]
        g = self.grad_fmt
        chunks = -(-N // int(ops.fp8_tile_rows))
        part = ops._colsum_partials("colsum_b", chunks, H)
        dq = ops.workspace.get("fp8_dy", N * H, np.uint8).reshape(N, H)
        dq_t = self._dy_t(H, N)
        if not self.delayed_live:
            cp.cuda.runtime.memsetAsync(row.data.ptr, 0, 4, cp.cuda.get_current_stream().ptr)
            self.k_fp8_dgelu_cast_transpose_colsum_amax(None, None, self._meta("dy"), dact2, pre2, g, part, row[0:1])
        self.k_fp8_dgelu_cast_transpose_colsum_amax(dq, dq_t, row, dact2, pre2, g, part, self._record_at(row))
        self._dgrad_wgrad(dinp.reshape(-1, C), dw1, dact2, inp.reshape(-1, C), w1, accumulate=accumulate,
                          dy_q=(dq, dq_t, row[META_STRIDE // 2:META_STRIDE // 2 + 1]))
        ops._colsum_final(db1, part, chunks, H)

    # ------------------------------------------------------------ the classifier (numpy_ref's names)
    def k_fp8_transpose(self, out_t, x):
        """out_t (K, R) = x.T of FP8 bytes x (R, K), R and K multiples of 16, 16-byte aligned."""
        R, K = x.shape
        check("k_fp8_transpose", "x", x, dtype=np.uint8)
        check("k_fp8_transpose", "out_t", out_t, (K, R), np.uint8)
        if R % FP8_MULTIPLE or K % FP8_MULTIPLE or x.data.ptr % 16 or out_t.data.ptr % 16:
            raise ValueError(f"k_fp8_transpose: x {x.shape} at {x.data.ptr:#x}, out_t at {out_t.data.ptr:#x}; "
                             f"expected both sizes multiples of {FP8_MULTIPLE}, 16-byte aligned arrays")
        self.ops.rt.launch("fp8.cu", "k_fp8_transpose", np.float32, (-(-K // TILE), -(-R // TILE)), THREADS,
                           (out_t, x, i32(R), i32(K)))

    def _classifier_input(self, kernel, x, V):
        """x (N, C), lnf's output, gets one amax for all its rows (meta "cx"); each chunk is then
        cast with it (_classifier_logits)."""
        N, C = x.shape
        if not classifier_in_fp8(N, V):
            raise ValueError(f"{kernel}: N = {N} rows and V = {V} classes; the FP8 classifier wants both, and "
                             f"every chunk's rows, multiples of {FP8_MULTIPLE} (classifier_in_fp8)")
        meta = self._meta("cx")
        self.k_fp8_amax(meta, x)
        return meta

    def _classifier_logits(self, z, meta, x, wte, fp8_logits=True, transpose=False):
        """z (n, V) = the logits of a chunk's rows x (n, C): fp8(x) @ fp8(wte).T (the forward's fast
        accumulation; x with the scale of meta, the whole input's amax), or with fp8_logits False
        x @ wte.T in bf16 (cuBLAS, as the 16-bit path). transpose: fp8(x)^T (C, n) too, for dW, cast
        in the same pass. Returns (fp8(x)^T or None, x's 1/scale)."""
        n, C = x.shape
        ws = self.ops.workspace
        xq = ws.get("fp8_cx", n * C, np.uint8).reshape(n, C) if fp8_logits else None
        xq_t = ws.get("fp8_cxt", n * C, np.uint8).reshape(C, n) if transpose else None
        if xq is not None or xq_t is not None:
            self.k_fp8_cast_transpose(xq, xq_t, meta, x, FP8_FWD)
        x_inv = meta[META_STRIDE // 2:META_STRIDE // 2 + 1]
        if fp8_logits:
            wq, w_inv = self._weight(wte)
            self._product(z, xq, FP8_FWD, x_inv, wq, FP8_FWD, w_inv, fast_accum=True)
        else:
            V = wte.shape[0]
            self.ops.blas.gemm(z, x, wte, False, True, n, V, C, C, C, V)
        return xq_t, x_inv

    def k_fp8_loss_fwd(self, losses, lse, logits, inp, wte, targets):
        """numpy_ref.k_fp8_loss_fwd: per chunk logits = fp8(inp) @ fp8(wte).T (E4M3, the forward's
        fast accumulation), then the 16-bit path's row pass."""
        from .ops import _loss_checks
        x, tg, lf, lsef, z_all, N, V, C, ct = _loss_checks("k_fp8_loss_fwd", losses, lse, logits, inp, wte, targets)
        meta = self._classifier_input("k_fp8_loss_fwd", x, V)
        R = z_all.shape[0]
        for r0 in range(0, N, R):
            n = min(R, N - r0)
            z = z_all[:n]
            self._classifier_logits(z, meta, x[r0:r0 + n], wte)
            self.ops._loss_rows(False, n, z, ct, (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V)))

    def k_fp8_loss_bwd(self, losses, lse, dinp, dwte, logits, inp, wte, targets, dloss, dlogits_fmt=None,
                       accumulate=True, fp8_logits=True, rounding=None):
        """numpy_ref.k_fp8_loss_bwd: per chunk of R rows the logits product in FP8, the row pass
        writing loss, lse and FP8 dlogits (loss.cu loss_bwd_fp8*, the bound's scale: no amax pass),
        dinp = dlogits @ fp8(wte) (accumulate=False: written, each chunk its own rows), dlogits
        transposed (k_fp8_transpose, into the logits workspace, which the chunk no longer needs) and
        dwte += dlogits.T @ fp8(inp). dlogits_fmt: "e4m3" or "e5m2" (None: CudaOps.fp8_dlogits).
        fp8_logits False: the logits product in bf16 (cuBLAS, as the 16-bit path), the two
        backward products in FP8. rounding: dlogits' rounding, "nearest" or "stochastic" (None:
        CudaOps.fp8_dlogits_rounding; loss.cu -DFP8_SR)."""
        from .ops import _dloss_args, _loss_checks
        ops = self.ops
        x, tg, lf, lsef, z_all, N, V, C, ct = _loss_checks("k_fp8_loss_bwd", losses, lse, logits, inp, wte, targets)
        check("k_fp8_loss_bwd", "dinp", dinp, inp.shape, ct)
        check("k_fp8_loss_bwd", "dwte", dwte, (V, C), np.float32)
        fmt = dlogits_fmt or ops.fp8_dlogits
        stochastic = fp8_rounding(rounding or ops.fp8_dlogits_rounding) == "stochastic"
        defs = self._defs(fmt) + (f"-DFP8_SR={int(stochastic)}",)
        dl = _dloss_args("k_fp8_loss_bwd", dloss)
        meta = self._classifier_input("k_fp8_loss_bwd", x, V)
        dz_meta = self._meta("dz")
        dz_inv = dz_meta[META_STRIDE // 2:META_STRIDE // 2 + 1]
        dx, R = dinp.reshape(N, C), z_all.shape[0]
        beta = 1.0 if accumulate else 0.0
        beta_w = 0.0 if ops._param_write(dwte) else 1.0  # the first chunk starts dwte in a starting pass
        for r0 in range(0, N, R):
            n = min(R, N - r0)
            z = z_all[:n]
            xq_t, x_inv = self._classifier_logits(z, meta, x[r0:r0 + n], wte, fp8_logits, transpose=True)
            dz = ops.workspace.get("fp8_dz", n * V, np.uint8).reshape(n, V)
            ops._loss_rows(True, n, z, ct, (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V))
                           + dl + (dz, dz_inv, i64(r0)), fp8_defs=defs)
            wq_t, w_inv = self._weight(wte, transpose=True)
            self._product(dx[r0:r0 + n], dz, fmt, dz_inv, wq_t, FP8_FWD, w_inv, beta=beta)
            dz_t = cp.ndarray((V, n), dtype=np.uint8, memptr=z.data)  # the logits are spent
            self.k_fp8_transpose(dz_t, dz)
            self._product(dwte, dz_t, fmt, dz_inv, xq_t, FP8_FWD, x_inv, beta=beta_w if r0 == 0 else 1.0)
