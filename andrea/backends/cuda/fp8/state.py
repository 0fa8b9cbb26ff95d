"""The FP8 state of one backend (Fp8): the quantisation launchers (quant.py) plus what the layers'
FP8 forms share: the weight cache, the input slots and delayed scales, the operand buffers of the
workspace, the gradient format, and the FP8 product on cuBLASLt.

    be.reserve_workspace(B, T, C, n_head, "bfloat16", fp8=True)   # be.fp8 is an Fp8 now
    # the backend's k_attn_qkv_*, k_attn_out_*, k_mlp_*, k_loss_* then run their FP8 forms (ops/)

Each operand of a product is quantised with its own per-tensor scale (a power of two), taken from
the tensor's amax just before (current scaling) or from an amax history (delayed scaling,
scales.py). cuBLASLt's FP8 products want both operands contiguous along the summed axis, so
dW = dY.T @ X takes dY and X transposed and dX = dY @ W takes W transposed. The output gradient
dY is quantised in the gradient format (grad_fmt). Products accumulate in float32 and write the
compute dtype (bf16) or, for the weight gradients, add into the float32 grads. The operands live
in the backend's workspace ("fp8_*" rows, plan.fp8_rows), reused by every layer; the scales of
the operands that have no row of their own live in "fp8_meta" (META_SLOTS).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ...interface import FP8_FORMATS, FP8_FWD
from ..cublas import cuda_type
from ..runtime import check, cp
from .cache import WeightCache
from .plan import CACHE_ALIGN, DELAYED_CUR, FP8_CUDA_TYPES, META_SLOTS, META_STRIDE, _aligned, input_slot_rows
from .quant import Quant
from .scales import DelayedScales, InputSlot


class Fp8(Quant):
    """The FP8 state of one CudaBackend: its Runtime, Tuning, cuBLASLt binding (lt), workspace and
    parameter-gradient pass (grads), handed over by reserve_workspace(fp8=True). The Tuning is the
    backend's, fixed at its construction (a test that times another value sets both). grad_fmt:
    the format of the output gradients ("e4m3" or "e5m2")."""

    def __init__(self, rt, tuning, lt, workspace, grads, grad_fmt: str):
        if grad_fmt not in FP8_FORMATS:
            raise ValueError(f"FP8 gradient format {grad_fmt!r}: expected one of {', '.join(FP8_FORMATS)}")
        if lt is None:
            raise RuntimeError("train.precision=fp8 needs cuBLASLt (the backend was made with cublaslt=False, "
                               "or libcublasLt could not be loaded)")
        super().__init__(rt, tuning)
        self.lt, self.workspace, self.grads, self.grad_fmt = lt, workspace, grads, grad_fmt
        self.cache = WeightCache(self)
        # input slots (use_input_slots): address of a weight -> InputSlot of its product's input X;
        # address of an input -> the same slot (the layer-norm launchers ask by their output)
        self.slots, self.slot_of_input = {}, {}
        self._slot_block = None  # every slot's meta rows, (n, META_STRIDE): zeroed by one memset
        self._producer_amax = False  # the layer norms writing a slot's input reduce its amax (producer_amax)
        self.delayed = None  # the DelayedScales of use_delayed_scales
        # address of a forward product's output -> its weight's (k_fp8_linear_fwd): the attention
        # backward finds the QKV weight of the qkv it differentiates (attention_grad_operand)
        self.made_by = {}
        # (dqkv, w, fp8 dY, fp8 dY^T, delayed row, partial, chunks, format) that the attention
        # backward wrote for w's product backward (attention_grad_operand), or None
        self.pending_dy = None

    # ------------------------------------------------------------ the weight cache (cache.py)
    def use_weight_cache(self, weights, data, meta, table, alone=0):
        """FP8 copies of weights in the engine's rows (WeightCache.use)."""
        self.cache.use(weights, data, meta, table, alone)

    def refresh_weight_cache(self):
        """The copies rewritten from the weights as they are now (WeightCache.refresh)."""
        self.cache.refresh()

    def cached(self, w):
        """(fp8(w) (R, K), fp8(w)^T (K, R), meta row: amax at 0, 1/scale at META_STRIDE // 2) of a
        weight the cache keeps, or None."""
        return self.cache.get(w)

    def dy_t(self, K, R):
        """Where a cast writes fp8(dY)^T (K, R): the workspace's "fp8_dyt"."""
        return self.workspace.get("fp8_dyt", K * R, np.uint8).reshape(K, R)

    # ------------------------------------------------------------ input slots and delayed scales
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

    def delayed_row(self, role, w):
        return self.delayed.rows.get((role, w.data.ptr)) if self.delayed is not None else None

    @property
    def delayed_live(self) -> bool:
        return self.delayed is not None and self.delayed.live

    def record_at(self, row):
        """Where a pass reduces its amax: row's current step, while recording."""
        return row[DELAYED_CUR:DELAYED_CUR + 1] if self.delayed.record else None

    def arm(self, slot):
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

    def slot_written(self, out):
        """The input slot whose whole input is out (a layer norm's output), or None."""
        slot = self.slot_of_input.get(out.data.ptr) if self.slot_of_input else None
        return slot if slot is not None and out.size == slot.x[1] * slot.x[2] else None

    def producer_amax(self, out):
        """Where a layer-norm forward that writes out reduces max |out| (its amax argument): the
        meta row of out's input slot, zeroed first, or None where out has no slot (or the
        producers' amax is off). The slot's next product then skips its k_fp8_amax."""
        slot = self.slot_written(out) if self._producer_amax else None
        if slot is None or slot.delayed:  # a delayed one: its cast's
            return None
        self.arm(slot)
        slot.state = "amax"
        return slot.meta

    def layernorm_operand(self, out):
        """Where a layer-norm forward writing out (N, C) writes it as its product's FP8 operand
        instead (ops/layernorm.py k_layernorm_fwd_fp8): written_operand's."""
        return self.written_operand(out)

    def attention_operand(self, out):
        """Where the attention forward writing out (B, T, C) writes it as the attention
        projection's FP8 operand too (ops/attention.py k_attn_fwd_fp8): as layernorm_operand (out
        itself is still written: the backward reads it)."""
        return self.written_operand(out)

    def written_operand(self, out):
        """Where the kernel that writes out (N, C) writes it as its product's FP8 operand itself:
        out is the input of a slot with a delayed scale that holds a history, and the
        slot keeps X^T. Returns (q (N, C) in the workspace, where the product takes it, X^T, the
        delayed row, where the kernel records its amax or None), marking the slot "cast" and
        ready; else None (the operand is cast from out as before)."""
        slot = self.slot_written(out)
        if slot is None or not slot.delayed or slot.xt is None or not self.delayed_live or slot.x[1] % 8:
            return None
        N, IC = slot.x[1], slot.x[2]
        q = self.workspace.get("fp8_x", N * IC, np.uint8).reshape(N, IC)
        slot.state, slot.ready = "cast", True
        return q, slot.xt, slot.meta, self.record_at(slot.meta)

    def attention_grad_operand(self, dqkv, qkv):
        """Where the attention backward writing dqkv (B, T, 3C) writes it as the FP8 output
        gradient of the QKV product instead (ops/attention.py k_attn_bwd_fp8): qkv was made by a
        forward product here, whose output gradient has a delayed scale holding a history, and the
        casts of dY write the bias gradient's column partials in 64-row tiles (the kernels'
        tile; Tuning.fp8_tile_rows 64). Returns (fp8 dY (B*T, 3C), fp8 dY^T, the delayed row, where the kernels
        record the amax or None, the column partials (B*T / 64, 3C), the gradient format) and
        keeps them for that product's backward (ops/linear.py _fp8_dgrad_wgrad, which then reads
        dqkv no more: it is
        not written); else None (dqkv is written as before)."""
        w = self.made_by.get(qkv.data.ptr)
        if w is None or not self.delayed_live or self.tuning.fp8_tile_rows != 64:
            return None
        row = self.delayed.rows.get(("dy", w))
        if row is None:
            return None
        N, K = dqkv.size // dqkv.shape[-1], dqkv.shape[-1]
        chunks = N // 64
        partial = self.grads.partials("colsum_a", chunks, K)
        q = self.workspace.get("fp8_dy", N * K, np.uint8).reshape(N, K)
        q_t = self.dy_t(K, N)
        self.pending_dy = (dqkv.data.ptr, w, q, q_t, row, partial, chunks, self.grad_fmt)
        return q, q_t, row, self.record_at(row), partial.reshape(chunks, K), self.grad_fmt

    def drop_pending_dy(self):
        """Forget what attention_grad_operand kept (a backward of attention starts: its dqkv is
        either written in 16 bits or kept anew)."""
        self.pending_dy = None

    def take_pending_dy(self, dy2, w):
        """(fp8 dY, fp8 dY^T, 1/scale, partial, chunks) the attention backward wrote for w's
        product with output gradient dy2 (attention_grad_operand), or None."""
        pend, self.pending_dy = self.pending_dy, None
        if pend is None or pend[0] != dy2.data.ptr:
            return None
        dqkv, wp, q, q_t, row, partial, chunks, fmt = pend
        if wp != w.data.ptr or fmt != self.grad_fmt:
            raise RuntimeError(f"the attention backward wrote dqkv at {dqkv:#x} as the FP8 output gradient of "
                               f"another product or format ({fmt}) than the one reading it now ({self.grad_fmt})")
        return q, q_t, row[META_STRIDE // 2:META_STRIDE // 2 + 1], partial, chunks

    def slot(self, w, x2, forward=False):
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

    # ------------------------------------------------------------ operands and products
    def weight(self, w, transpose=False):
        """fp8(w) (R, K), or with transpose fp8(w)^T (K, R), and its 1/scale (a (1,) view): the
        cached copy where w is a cached weight, else quantised now into the workspace."""
        hit = self.cached(w)
        if hit is None:
            q, q_t, inv = self.quantise("w", w, FP8_FWD, transpose=transpose)
            return (q_t if transpose else q), inv
        q, q_t, row = hit
        return (q_t if transpose else q), row[META_STRIDE // 2:META_STRIDE // 2 + 1]

    def meta_of(self, role):
        """The meta row (amax at 0, 1/scale at META_STRIDE // 2) of an operand role of the products."""
        m = self.workspace.get("fp8_meta", len(META_SLOTS) * META_STRIDE, np.float32)
        i = META_SLOTS[role] * META_STRIDE
        return m[i:i + META_STRIDE]

    def quantise(self, role, x2, fmt, transpose=False, both=False, amax_done=False, partial=None, row=None,
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
                raise ValueError("quantise: a delayed scale's cast transposes (its kernels are the tile casts)")
            return self._quantise_delayed(role, x2, fmt, both, partial, row, record)
        meta = self.meta_of(role)
        slot = {"x": "fp8_x", "w": "fp8_w", "dy": "fp8_dy"}[role]
        if not amax_done:
            self.k_fp8_amax(meta, x2)
        if not transpose:
            q = self.workspace.get(slot, R * K, np.uint8).reshape(R, K)
            self.k_fp8_cast(q, meta, x2, fmt)
            return q, None, meta[META_STRIDE // 2:META_STRIDE // 2 + 1]
        q_t = self.dy_t(K, R) if role == "dy" else self.workspace.get(slot, R * K, np.uint8).reshape(K, R)
        q = self.workspace.get(slot, R * K, np.uint8).reshape(R, K) if both else None
        if partial is None:
            self.k_fp8_cast_transpose(q, q_t, meta, x2, fmt)
        else:
            self.k_fp8_cast_transpose_colsum(q, q_t, meta, x2, fmt, partial)
        return q, q_t, meta[META_STRIDE // 2:META_STRIDE // 2 + 1]

    def _quantise_delayed(self, role, x2, fmt, both, partial, row, record):
        R, K = x2.shape
        slot = {"x": "fp8_x", "dy": "fp8_dy"}[role]
        q_t = self.dy_t(K, R) if role == "dy" else self.workspace.get(slot, R * K, np.uint8).reshape(K, R)
        q = self.workspace.get(slot, R * K, np.uint8).reshape(R, K) if both else None
        if not self.delayed_live:
            self.k_fp8_amax(row, x2)
        rec = self.record_at(row) if record else None
        if partial is None:
            self.k_fp8_cast_transpose_amax(q, q_t, row, x2, fmt, rec)
        else:
            self.k_fp8_cast_transpose_colsum_amax(q, q_t, row, x2, fmt, partial, rec)
        return q, q_t, row[META_STRIDE // 2:META_STRIDE // 2 + 1]

    def product(self, D, A, a_fmt, a_inv, B, b_fmt, b_inv, epilogue="none", bias=None, aux=None,
                beta=0.0, fast_accum=False):
        """D (M, N) [+]= A (M, K) @ B (N, K).T times both inverse scales (cuBLASLt, FP8 operands).
        Raises NoAlgorithm where cuBLASLt has none for this problem and epilogue."""
        M, K = A.shape
        N = B.shape[0]
        lt = self.lt
        lt.matmul(D, A, B, False, True, M, N, K, K, K, N, FP8_CUDA_TYPES[a_fmt], cuda_type(D.dtype),
                  epilogue, bias=bias, bias_type=cuda_type(bias.dtype) if bias is not None else None,
                  aux=aux, aux_ld=N if aux is not None else 0, beta=beta, b_type=FP8_CUDA_TYPES[b_fmt],
                  scales=(a_inv, b_inv), fast_accum=fast_accum)

    @contextmanager
    def grad_format(self, grad_fmt):
        """This call's gradient format (None: the backend's)."""
        saved = self.grad_fmt
        if grad_fmt is not None and grad_fmt not in FP8_FORMATS:
            raise ValueError(f"FP8 gradient format {grad_fmt!r}: expected one of {', '.join(FP8_FORMATS)}")
        self.grad_fmt = grad_fmt or saved
        try:
            yield
        finally:
            self.grad_fmt = saved
