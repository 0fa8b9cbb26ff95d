"""The engine process: trains one run from token shards and speaks JSON lines on stdout.

    python -m andrea.cli engine --config RUN/config.yaml --run-dir RUN [--resume]

stdout carries only JSON objects, one per line, each with an "event" key: plan, resume, step,
val, sample, checkpoint, pivot, done (andrea/run/protocol.py defines each). Human text goes to stderr.
Signals are handled at step boundaries: SIGTERM / SIGINT / SIGUSR2 write a checkpoint and exit 0; SIGUSR1
writes one and training goes on. A signal that arrives while a checkpoint is being written only
sets a flag, so the write always completes. Exit codes: 0 finished or stopped, 3 aborted after
train.max_bad_steps non-finite steps in a row (the newest checkpoint holds the last finite state:
weights that are not finite are never written), 4 a checkpoint did not fit on the disk (nothing
half-written is left, the previous checkpoint is intact).

On --resume every checkpoint newer than the newest valid one is reported (stderr, and a
`bad_checkpoint` event with its path and the reason); when checkpoints exist but none is valid the
engine exits 2 before writing anything.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from ..core import checkpoint as ck
from ..core.comm import SINGLE
from ..config import AndreaConfig, config_hash
from ..data.loader import train_loader, val_windows
from ..core.engine import Engine, phase_of
from ..core.state import EngineState
from .protocol import EXIT_ABORTED, EXIT_ORPHANED, emit, reader_gone


class Signals:
    """Flags set by signal handlers, read at step boundaries."""

    def __init__(self):
        self.stop = False
        self.save = False

    def install(self):
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGUSR2, self._stop)  # mpirun forwards it to every rank (docs/DISTRIBUTED.md)
        signal.signal(signal.SIGUSR1, self._save)

    def _stop(self, signum, frame):
        self.stop = True

    def _save(self, signum, frame):
        self.save = True


def die_with_parent(expected_parent: int) -> None:
    """Linux: the kernel sends this process SIGKILL when its parent (the proxy) dies, so an
    orphaned engine never trains on, nor writes a checkpoint the proxy will not record. If the
    parent is already gone, exit at once."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            print(f"engine: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()})", file=sys.stderr)
    gone = False
    if os.getppid() != expected_parent:  # reparented, or a wrapper sits between the proxy and us
        try:
            os.kill(expected_parent, 0)
        except ProcessLookupError:
            gone = True
        except PermissionError:
            pass
    if gone:
        print("engine: the proxy that started it is gone; stopping", file=sys.stderr)
        os._exit(EXIT_ORPHANED)


def _quiet(event: str, **fields) -> None:
    """emit() of the ranks other than 0: they say nothing on stdout."""


class Run:
    """The training loop of one run: cadence, checkpoints, signals, records.

    With a comm of several ranks (data parallelism, andrea/core/comm.py) every rank runs this loop on
    its own slice of each step's microbatches: the loader reads the whole step on every rank (so
    its position and the data mix stay global and identical) and rank r keeps microbatches
    r*k .. r*k+k-1 of the step's grad_accum = size*k. Rank 0 alone resumes (then sends the state
    to the others), validates, samples, writes checkpoints and speaks the protocol on stdout; a
    stop or save signal that reaches any rank is agreed on at the step boundary, so every rank
    stops after the same step. Under ZeRO-1 (zero1; the Adam moments sharded over the ranks) a
    checkpoint is written by every rank together: each sends its shard of the moments to rank 0."""

    def __init__(self, cfg: AndreaConfig, run_dir, engine: Engine = None, comm=None, zero1: bool = False):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.hash = config_hash(cfg)
        self.comm = comm if comm is not None else (engine.comm if engine is not None else SINGLE)
        self.root = self.comm.rank == 0
        self.emit = emit if self.root else _quiet
        t = cfg.train
        if t.grad_accum % self.comm.size:
            raise ValueError(f"train.grad_accum={t.grad_accum} is not a multiple of the {self.comm.size} ranks: "
                             f"each rank runs grad_accum/ranks microbatches of train.batch_size, so that the "
                             f"global batch stays grad_accum x batch_size (set train.grad_accum to a multiple "
                             f"of {self.comm.size})")
        self.micro = t.grad_accum // self.comm.size  # microbatches of each rank per step
        # zero1: the Adam state sharded over the ranks (ZeRO-1; not part of the config: a run may
        # resume with or without it, on any number of ranks)
        self.eng = engine or Engine(cfg, comm=self.comm, zero1=zero1)
        V = cfg.model.vocab_size
        self.loader = train_loader(cfg, V)  # with data.groups: the mixer picks each step's group
        self.val = None  # the validation batches (the report's windows too: data.loader.val_windows)
        if t.eval_every:
            self.val = val_windows(cfg.data.val_shards, t.batch_size, t.seq_len, t.eval_batches, V)
        # held-out loss per data group, for groups that name their own validation shards
        self.group_val = [(g.name, val_windows(g.val_shards, t.batch_size, t.seq_len, t.eval_batches, V))
                          for g in cfg.data.groups if g.val_shards and t.eval_every]
        self.step = 0
        self.loaded = None  # rank 0: the EngineState it resumed from (whole, whatever ZeRO-1 shards)
        self.status = None  # finished | stopped | aborted, once train() returns
        self.resumed_reason = None
        self.sig = Signals()
        self.tokenizer = None

    def _tidy_checkpoints(self) -> None:
        """Before anything is read or written: refuse a checkpoints folder that cannot be listed
        or written, remove the temporary files of dead writers (a SIGKILL leaves them), and move
        aside anything named like a checkpoint that is not a file (its save would fail)."""
        ck.check_folder(self.ckpt_dir)
        gone = ck.remove_stale_tmp(self.ckpt_dir)
        if gone:
            print(f"engine: removed {len(gone)} temporary file(s) of dead processes' checkpoint writes in "
                  f"{self.ckpt_dir}: {', '.join(p.name for p in gone)}", file=sys.stderr)
        for old, new in ck.move_obstacles(self.ckpt_dir):
            print(f"engine: {old} is not a file (a checkpoint is written there); moved it aside to {new.name}",
                  file=sys.stderr)

    def resume(self, at_most=None) -> bool:
        """Load the newest valid checkpoint (of step <= at_most when given: the proxy recorded
        the run's history up to that checkpoint, so a newer one would leave a gap in it)."""
        path, skipped = ck.scan(self.run_dir, self.eng.layout.n_params, max_step=at_most)
        for bad, reason in skipped:
            print(f"engine: skipping checkpoint {bad.name}: {reason}", file=sys.stderr)
            self.emit("bad_checkpoint", checkpoint=str(bad), reason=reason)
        if path is None:
            if skipped:
                names = ", ".join(f"{b.name} ({r})" for b, r in skipped)
                raise ck.CheckpointError(
                    f"{self.ckpt_dir}: {len(skipped)} checkpoint(s) and none is valid: {names}. Nothing was "
                    "changed; repair them, or move the folder away to start afresh")
            return False
        c = self.eng.load_checkpoint(path, self.hash)  # refuses a checkpoint of other settings
        self.loaded = EngineState(c.params, c.m, c.v, **self.eng.state_counters())
        s = c.sidecar
        self.loader.load_state(s["data"], source=str(ck.sidecar_path(path)))
        self.step = c.step
        self.resumed_reason = s.get("reason")
        print(f"engine: resuming from step {c.step} (checkpoint {path}, config hash {self.hash})", file=sys.stderr)
        self.emit("resume", step=c.step, checkpoint=str(path))
        return True

    def _share_start(self) -> None:
        """Every rank starts from rank 0's state: its config hash (checked), step, data position
        and weights, Adam moments and counters (resumed or freshly initialised)."""
        loaded, self.loaded = self.loaded, None  # the checkpoint's host arrays are not kept
        if self.comm.size == 1:
            return
        head = self.comm.bcast({"hash": self.hash, "step": self.step, "reason": self.resumed_reason,
                                "data": self.loader.state(), "counters": self.eng.state_counters(),
                                "resumed": loaded is not None})
        if head["hash"] != self.hash:
            raise ValueError(f"rank {self.comm.rank}: its config (config_hash {self.hash[:12]}…) differs from rank "
                             f"0's ({head['hash'][:12]}…); every rank must run the same command")
        if head["resumed"]:  # rank 0's engine may keep only its shard of the moments it loaded
            n = self.eng.layout.n_params
            st = loaded if self.root else EngineState(*(np.empty(n, np.float32) for _ in "pmv"), **head["counters"])
        else:
            st = self.eng.state()  # under ZeRO-1 a collective: the moments whole on rank 0 only
        if not self.root:
            st.m, st.v = (a if a is not None else np.empty_like(st.params) for a in (st.m, st.v))
        self.comm.bcast_arrays([st.params, st.m, st.v])
        if not self.root:
            self.step, self.resumed_reason = head["step"], head["reason"]
            self.loader.load_state(head["data"], source="rank 0's data position")
            st.loss_scale, st.good_streak, st.bad_streak, st.skipped = (head["counters"][k] for k in (
                "loss_scale", "good_streak", "bad_streak", "skipped"))
            st.fp8_amax_history = head["counters"].get("fp8_amax_history")
            self.eng.load_state(st)

    def save(self, reason: str):
        """Write a checkpoint of the current state; None (and a message) when the state is not
        finite, so the newest checkpoint stays the last finite one. A full disk raises NoSpace.
        When the proxy is gone (stdout closed) the engine stops here, writing nothing: the proxy
        would never record this checkpoint, and the steps before it would be missing from the
        history when a new proxy resumes from it."""
        if not self.root and not self.eng.zero1:
            return None  # rank 0 writes the run's checkpoints
        if self.root and reader_gone():
            print(f"engine: stdout is closed (the proxy is gone); stopping at step {self.step} without "
                  "a checkpoint", file=sys.stderr)
            os._exit(EXIT_ORPHANED)
        st = self.eng.state()  # under ZeRO-1 every rank is here: the moments are gathered on rank 0
        if not self.root:
            return None
        side = {"reason": reason, "data": self.loader.state(), **st.counters(),
                "config_hash": self.hash, "precision": self.cfg.train.precision,
                "backend": self.eng.be.name, "exp": self.cfg.exp,
                "rng": {"weights_seed": self.cfg.train.seed, "data_seed": self.loader.seed}}
        try:
            path = ck.write_checkpoint(self.ckpt_dir, self.step, st.params, st.m, st.v, side)
        except ck.NotFinite as e:
            print(f"engine: {e}", file=sys.stderr)
            return None
        ck.prune(self.ckpt_dir, self.cfg.train.keep_last, protect=[path])
        self.emit("checkpoint", step=self.step, path=str(path), reason=reason)
        return path

    def _maybe_pivot(self):
        """Before the first step of a new phase: checkpoint, and announce the pivot."""
        nxt, cur = phase_of(self.cfg, self.step + 1), phase_of(self.cfg, self.step)
        if nxt is None or nxt is cur or self.step == 0:
            return
        if self.resumed_reason == "pivot" and self.step == self._resume_step:
            return  # the pivot checkpoint we resumed from already marks it
        path = self.save("pivot")
        if path is None:  # not finite: nothing to archive; the abort policy decides what comes next
            return
        self.emit("pivot", step=self.step, **{"from": cur.name if cur else "pretrain", "to": nxt.name},
             checkpoint=str(path))

    def train(self, resume: bool = False, resume_at_most=None) -> int:
        t = self.cfg.train
        self.sig.install()
        if self.root:
            self.eng.print_plan()
        plan = self.eng.plan
        self.emit("plan", n_params=self.eng.layout.n_params, total_bytes=plan.total(),
             rows=[{"name": g, "bytes": b} for g, b in plan.by_group().items()])
        if self.root:
            self._tidy_checkpoints()
        if resume and self.root:
            self.resume(resume_at_most)
        self._share_start()
        self._resume_step = self.step
        r, k = self.comm.rank, self.micro
        tokens = t.batch_size * t.seq_len * t.grad_accum
        t0 = time.perf_counter()
        while self.step < t.steps:
            self._maybe_pivot()
            batches = self.loader.next_step(t.grad_accum)[r * k:(r + 1) * k]  # this rank's part
            ts = time.perf_counter()
            rec = self.eng.train_step(self.step + 1, batches)
            self.eng.be.synchronize()
            dt = time.perf_counter() - ts
            self.step += 1
            mix = self.loader.feedback(rec)
            ph = phase_of(self.cfg, self.step)
            if self.step % max(1, t.log_every) == 0 or rec["skipped"] or self.step == t.steps:
                self.emit("step", phase=ph.name if ph else "pretrain", tokens_per_s=tokens / dt,
                     wall_s=time.perf_counter() - t0, **rec, **mix)
            if self.eng.bad_streak >= t.max_bad_steps:  # the same on every rank: one global step
                saved = self.save("abort")
                if self.root:
                    where = (f"{saved.name} holds the last good weights" if saved is not None else
                             f"the newest checkpoint ({self._newest_name()}) holds the last finite weights")
                    print(f"aborting: {self.eng.bad_streak} non-finite steps in a row (train.max_bad_steps="
                          f"{t.max_bad_steps}); {where}", file=sys.stderr)
                self._done("aborted")
                return EXIT_ABORTED
            self._cadence()
            # a signal on any rank holds for all of them (one small collective per step)
            # (the agreed flags decide; a flag this rank's handler raised while the collective ran
            # stays set, so the next step's agreement carries it: assigning the result would lose it)
            stop, save = self.comm.any(self.sig.stop, self.sig.save)
            if stop:
                self.save("signal")
                self._done("stopped")
                return 0
            if save:
                self.sig.save = False
                self.save("signal")
        # a signal save may have just written the final checkpoint
        final = self.root and not ck.is_valid(ck.bin_path(self.ckpt_dir, self.step))
        if self.eng.zero1:  # every rank takes part in the save
            final = self.comm.bcast(final)
        if final:
            if self.save("final") is None and self.root:
                print(f"aborting: the final weights are not finite; the newest checkpoint "
                      f"({self._newest_name()}) holds the last finite weights", file=sys.stderr)
                self._done("aborted")
                return EXIT_ABORTED
        self._done("finished")
        return 0

    def _done(self, status: str) -> None:
        self.status = status
        self.emit("done", step=self.step, status=status)

    def _newest_name(self) -> str:
        p = ck.latest_checkpoint(self.run_dir)
        return p.name if p is not None else "none: the run wrote no checkpoint"

    def _cadence(self):
        t, s = self.cfg.train, self.step
        if self.root:  # validation and samples are rank 0's
            self._evaluate(s)
        if t.ckpt_every and s % t.ckpt_every == 0 and s != t.steps:
            self.save("cadence")  # rank 0 writes (under ZeRO-1 every rank gathers its moments to it)

    def _evaluate(self, s: int):
        t = self.cfg.train
        if self.val is not None and t.eval_every and (s % t.eval_every == 0 or s == t.steps):
            extra = {}
            if self.group_val:
                extra["group_val_loss"] = {n: self.eng.val_loss(v) for n, v in self.group_val}
            self.emit("val", step=s, val_loss=self.eng.val_loss(self.val), **extra)
        if t.sample_every and (s % t.sample_every == 0 or s == t.steps):
            self.emit("sample", step=s, samples=self.samples())

    def samples(self):
        """Completions of the eval prompts (andrea.use.sampling, as in the report), when a tokenizer is present."""
        if self.tokenizer is None:
            path = Path(self.cfg.data.tokenizer)
            if not path.is_file():
                return []
            from ..data.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(path)
        from ..use.sampling import sample_prompts
        return sample_prompts(self.eng.generate, self.tokenizer, self.cfg.eval)
