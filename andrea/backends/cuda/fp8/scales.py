"""The per-tensor scale state of the FP8 path: the input slots of the products whose input the
model saves, and the delayed scales (an amax history a tensor).

Input slots: the inputs X of the layers whose X the model saves for the backward pass (ln1 for
QKV, the attention output for its projection, ln2 for the first MLP product) and act (the second
MLP product's, made from the saved pre) each have a slot (Fp8.use_input_slots, rows
plan.input_slot_rows in the engine's arena): the (amax, 1/scale) of its X for the current
microbatch and FP8 X^T. The forward product quantises X once into both X and X^T and the
backward's weight-gradient product reads that X^T instead of quantising X again: the same tensor,
amax, scale and rounding, so the same bytes.

Delayed scaling (train.fp8_scaling=delayed, the default): act, dact, the attention output, dqkv,
the residual stream's two gradients, ln1 and ln2 of every layer take their scale from the largest
amax of the last FP8_HIST optimizer steps, kept in the engine's arena (a row a tensor) and the
checkpoint's sidecar; the pass that makes or casts each of them reduces its amax into the row as
it casts, and k_fp8_delayed_roll moves the histories at the end of each optimizer step, in its
CUDA graph (not on a skipped step). The first step, with no history, takes each amax first.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ...interface import FP8_HIST
from .plan import DELAYED_HIST_AT, delayed_history_array


class InputSlot:
    """The input slot of one product (Fp8.use_input_slots): x, its input's (address, N, IC);
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
    """The delayed scales of one engine (Fp8.use_delayed_scales): block (n, META_STRIDE), a row
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
