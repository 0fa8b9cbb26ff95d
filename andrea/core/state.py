"""An engine's resumable state and the record of a step.

EngineState is what a checkpoint keeps of an engine (host copies: the weights, the Adam moments,
the loss scale and the counters); StateMixin is the Engine's side of it (the optimizer state's
slots on the device, and the conversions to and from EngineState); StepRecord is what train_step
returns, read from the step's copy of the optimizer state when first used.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..backends.interface import S_BAD, S_GOOD, S_LOSS, S_NORM, S_REC_SCALE, S_SCALE, S_SKIP, S_SKIPPED


@dataclass
class EngineState:
    """An engine's resumable state: host float32 weights and Adam moments, the dynamic loss scale
    and the counters of its growth and of the abort policy. A checkpoint holds exactly this (the
    arrays in its .bin, the counters in its sidecar)."""
    params: np.ndarray
    m: np.ndarray
    v: np.ndarray
    loss_scale: float
    good_streak: int
    bad_streak: int
    skipped: int
    # train.precision=fp8 with delayed scales: the amax history (n, 16), newest first; None where
    # there are none or no step recorded one (the next step takes its amax first)
    fp8_amax_history: Optional[list] = None

    def counters(self) -> dict:
        """The sidecar fields of this state (fp8_amax_history only where there is one)."""
        c = {"loss_scale": self.loss_scale, "good_streak": self.good_streak, "bad_streak": self.bad_streak,
             "skipped": self.skipped}
        if self.fp8_amax_history is not None:
            c["fp8_amax_history"] = self.fp8_amax_history
        return c

    @classmethod
    def from_checkpoint(cls, c, counters: dict) -> "EngineState":
        """The state checkpoint c holds; a counter its sidecar lacks (a checkpoint written by
        `andrea import` or by a test, not by a training run) is taken from counters."""
        s = {**counters, **{k: c.sidecar[k] for k in counters if k in c.sidecar}}
        return cls(c.params, c.m, c.v, float(s["loss_scale"]), int(s["good_streak"]), int(s["bad_streak"]),
                   int(s["skipped"]), c.sidecar.get("fp8_amax_history"))


class StepRecord(Mapping):
    """The record of one step: step, loss, lr, grad_norm, loss_scale (the scale the step ran
    with), skipped. The values come from the step's copy of the optimizer state, read when the
    record is first used."""

    KEYS = ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped")

    def __init__(self, step, lr, pending):
        self._step, self._lr, self._pending, self._rec = step, lr, pending, None

    def _values(self) -> dict:
        if self._rec is None:
            st = self._pending.get()
            self._rec = {"step": self._step, "loss": float(st[S_LOSS]), "lr": self._lr,
                         "grad_norm": float(st[S_NORM]), "loss_scale": float(st[S_REC_SCALE]),
                         "skipped": bool(st[S_SKIP])}
        return self._rec

    def __getitem__(self, key):
        return self._values()[key]

    def __iter__(self):
        return iter(self.KEYS)

    def __len__(self):
        return len(self.KEYS)


class StateMixin:
    """The Engine's base: its optimizer state on the device (interface.STATE_SLOTS: the loss scale,
    the streaks, the skipped count) and its resumable state as host copies (EngineState). The
    Engine supplies what these read: cfg, be, comm, zero1, layout, the buffers (params, m, v,
    optim_state, dloss), its shard (lo, hi), set_state, fp8_history and _load_fp8_history."""

    # ------------------------------------------------------------ the optimizer state (on the device)
    def _get(self, slot) -> float:
        return float(self.be.to_numpy(self.optim_state[slot:slot + 1])[0])

    def _set(self, slot, value):
        self.be.write(self.optim_state[slot:slot + 1], [value])

    @property
    def loss_scale(self) -> float:
        """The dynamic loss scale (1.0 unless fp16); setting it also sets the loss gradient."""
        return self._get(S_SCALE)

    @loss_scale.setter
    def loss_scale(self, value):
        self._set(S_SCALE, value)
        t = self.cfg.train
        self.be.write(self.dloss, [float(value) / (t.batch_size * t.seq_len)])

    good_streak = property(lambda self: int(self._get(S_GOOD)), lambda self, v: self._set(S_GOOD, v),
                           doc="consecutive finite steps, for loss-scale growth")
    bad_streak = property(lambda self: int(self._get(S_BAD)), lambda self, v: self._set(S_BAD, v),
                          doc="consecutive non-finite steps, for the abort policy")
    skipped = property(lambda self: int(self._get(S_SKIPPED)), lambda self, v: self._set(S_SKIPPED, v),
                       doc="total skipped steps")

    # ------------------------------------------------------------ the resumable state (host copies)
    def host_state(self):
        """(params, m, v) as host float32 arrays of n_params, the checkpoint's three blocks. Under
        ZeRO-1 on several ranks a collective (every rank calls it): m and v are gathered from the
        ranks' shards on rank 0, and are None on the other ranks."""
        n = self.layout.n_params
        params = np.ascontiguousarray(self.be.to_numpy(self.params[:n]), dtype=np.float32)
        if not self.zero1:
            return (params, *(np.ascontiguousarray(self.be.to_numpy(a), dtype=np.float32) for a in (self.m, self.v)))
        m, v = (self.comm.gather(np.ascontiguousarray(self.be.to_numpy(a), dtype=np.float32)) for a in (self.m, self.v))
        return params, *((None if a is None else a[:n]) for a in (m, v))

    def state(self) -> "EngineState":
        """Everything a checkpoint keeps of this engine, as host copies (the engine goes on). Under
        ZeRO-1 on several ranks a collective, whose m and v are rank 0's alone (host_state)."""
        # the NumPy backend's host view is the buffer itself: copy it, so the state stays put
        params, m, v = (h.copy() if isinstance(a, np.ndarray) and h is not None and np.shares_memory(h, a) else h
                        for h, a in zip(self.host_state(), (self.params, self.m, self.v)))
        return EngineState(params, m, v, self.loss_scale, self.good_streak, self.bad_streak, self.skipped,
                           self.fp8_history())

    def state_counters(self, history: bool = True) -> dict:
        """The loss scale and the step counters, as in a checkpoint's sidecar (EngineState.counters),
        and (history) the delayed FP8 scales' amax history, which waits for the device."""
        c = {"loss_scale": self.loss_scale, "good_streak": self.good_streak, "bad_streak": self.bad_streak,
             "skipped": self.skipped}
        return {**c, "fp8_amax_history": self.fp8_history()} if history else c

    def load_state(self, st: "EngineState") -> None:
        """Continue from st: weights, Adam moments, loss scale, step counters and the delayed FP8
        scales' amax history (none: the next step takes its amax first) (no new buffers)."""
        self.set_state(st.params, st.m, st.v)
        self.loss_scale = float(st.loss_scale)
        self.good_streak, self.bad_streak, self.skipped = int(st.good_streak), int(st.bad_streak), int(st.skipped)
        self._load_fp8_history(st.fp8_amax_history)
