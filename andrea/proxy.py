"""Training proxy: supervises the engine process and keeps the run's JSON records.

`supervise(cfg, run_dir)` starts the engine (`python -m andrea.cli engine --config RUN/config.yaml
--run-dir RUN --resume`) as a child process, reads the JSON lines it prints on stdout, and keeps
three files in the run folder, each rewritten atomically (temporary file, fsync, os.replace) so a
reader such as the dashboard never sees half a file:

`<exp>.loss.json`, the whole training history, never truncated and never archived:
    {"format": "andrea-loss/1", "exp": str, "total_steps": int, "history": [record, ...]}
    one record per logged optimizer step, in increasing step order, each step once:
      step          optimizer steps completed (from 1)
      phase         training phase of the step (train.phases[].name, "pretrain" without phases)
      loss          mean training loss of the step (null when not finite)
      val_loss      validation loss, only on steps where it was measured
      lr            learning rate used by the step
      grad_norm     global gradient norm before clipping (null when not finite)
      loss_scale    dynamic loss scale (1.0 in fp32)
      tokens_per_s  training throughput of the step
      wall_s        engine wall time since its run started, as the engine reports it
      skipped       true when the update was skipped (non-finite gradients)
      t             unix time the proxy received the record
    A record holding only step, phase and val_loss marks a validation at a step that was not logged.
    After an engine restart, records past the resume point are dropped before the engine's replay
    of those steps is appended, so each step appears exactly once and the losses are the ones of
    the checkpointed trajectory.

`<exp>.samples.json`: {"exp": str, "samples": [{"step", "phase", "t", "samples": [{"prompt",
    "completion"}]}]}, generations from fixed prompts at train.sample_every.

`<exp>.state.json`: {"exp", "status" (running | stopped | finished | failed), "step", "total_steps",
    "phase", "last_checkpoint" (path relative to the run folder), "last_checkpoint_step",
    "restarts" (engine restarts after a crash, counted over the run's whole life), "pid" (proxy),
    "engine_pid", "engine_exit" (last exit code), "n_params", "archives" (list of {"phase",
    "step", "dir"}), "message", "started_at", "updated_at"}.

Signals: SIGTERM or SIGINT (Ctrl-C) to the proxy forwards SIGTERM to the engine, which checkpoints
at the next step boundary and exits 0; the proxy then writes status `stopped` and returns 0. SIGUSR1
is forwarded as is (checkpoint and go on). The engine runs in its own process group, so a Ctrl-C in
the terminal reaches it only once, through the proxy.

Crash recovery: an engine exit other than 0, 2 (bad input: config, shards or checkpoint, which a
restart cannot mend) and 3 (killed, out of memory, a CUDA error) restarts it
with --resume from its newest good checkpoint, after a back-off that doubles with each failure in a
row (backoff_s, 2*backoff_s, ..., at most backoff_max_s); max_restarts failures in a row without a
new checkpoint give up with status `failed`. Exit 3 (train.max_bad_steps non-finite steps) is an
abort: status `failed`, no restart.

Phases: the engine itself writes a checkpoint just before crossing train.phases[i].start_step and
prints {"event": "pivot", ...}; the checkpoint is taken at the exact step boundary, which a signal
from the proxy could not guarantee. On that event the proxy copies `<exp>.samples.json`,
`<exp>.state.json` and the checkpoint (.bin and its .json sidecar) into
`archive/<from-phase>-<step>/`; `<exp>.loss.json` stays whole in the run folder. Training goes on.

A history, samples or state file that does not parse at start-up stops the proxy with a
RecordError naming the file; it is never silently reset. `.proxy.lock` in the run folder (an flock)
keeps a second proxy off a run that is being supervised.

Run: `python -m andrea.proxy results/ANDREA-tiny` (the folder must hold the resolved config.yaml);
usually started for you by `python -m andrea.train`.
"""
from __future__ import annotations

import argparse
import bisect
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from andrea.atomic import atomic_copy, atomic_write_json
from andrea.config import ProxyConfig

LOSS_FORMAT = "andrea-loss/1"
# defaults when a config carries no proxy group (andrea.config.ProxyConfig documents each)
MAX_RESTARTS = ProxyConfig.max_restarts
BACKOFF_S = ProxyConfig.restart_backoff_s
BACKOFF_MAX_S = ProxyConfig.restart_backoff_max_s
FLUSH_S = ProxyConfig.record_flush_s
STOP_TIMEOUT_S = 600.0  # how long a stopping engine may take to checkpoint before it is killed
ABORT_EXIT = 3  # engine exit code for "aborted after too many non-finite steps"
INPUT_EXIT = 2  # engine exit code for bad input (config, shards, checkpoint): a restart cannot help
STEP_FIELDS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "wall_s")


class RecordError(ValueError):
    """A run record file (history, samples, state) that is corrupt or does not match the run."""


def _finite(x) -> Optional[float]:
    """JSON has no NaN/Inf (and browsers refuse them), so a non-finite number is recorded as null."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _load_record(path: Path, key: str, exp: str) -> Optional[dict]:
    """The parsed record file at path (None when absent), or a RecordError saying what is wrong."""
    if not path.exists():
        return None
    hint = "It was left untouched: repair it, or move it away to start a new record."
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: not valid JSON ({e}); the file is corrupt or half-written. {hint}")
    if not isinstance(obj, dict) or not isinstance(obj.get(key, []), list):
        raise RecordError(f"{path}: expected a JSON object with a list under {key!r}. {hint}")
    if obj.get("exp", exp) != exp:
        raise RecordError(f"{path}: exp is {obj.get('exp')!r} but this run is {exp!r}; "
                          f"a record of another experiment? {hint}")
    prev = 0
    for i, rec in enumerate(obj.get(key, [])):
        step = rec.get("step") if isinstance(rec, dict) else None
        if not isinstance(step, int) or step <= prev:
            raise RecordError(f"{path}: {key}[{i}].step is {step!r} but expected an integer > {prev} "
                              f"(steps strictly increasing). {hint}")
        prev = step
    return obj


class RunRecords:
    """The three JSON files of one run folder, kept in memory and flushed atomically."""

    def __init__(self, exp: str, run_dir: Path, total_steps: int, flush_s: float = FLUSH_S):
        self.run_dir, self.flush_s = run_dir, flush_s
        self.loss_path = run_dir / f"{exp}.loss.json"
        self.samples_path = run_dir / f"{exp}.samples.json"
        self.state_path = run_dir / f"{exp}.state.json"
        loss = _load_record(self.loss_path, "history", exp)
        samples = _load_record(self.samples_path, "samples", exp)
        state = _load_record(self.state_path, "archives", exp)
        self.history: list = loss["history"] if loss else []
        self.samples: list = samples["samples"] if samples else []
        self.loss_meta = {"format": LOSS_FORMAT, "exp": exp, "total_steps": total_steps}
        self.state = {"exp": exp, "status": "running", "step": self.last_step(), "total_steps": total_steps,
                      "phase": None, "last_checkpoint": None, "last_checkpoint_step": None,
                      "restarts": 0, "pid": os.getpid(), "engine_pid": None, "engine_exit": None,
                      "n_params": None, "archives": [], "message": ""}
        for k in ("phase", "last_checkpoint", "last_checkpoint_step", "restarts", "n_params", "archives"):
            if state and k in state:
                self.state[k] = state[k]
        self.state["started_at"] = self.state["updated_at"] = time.time()
        self._last_flush = 0.0
        self._write_s = 0.0  # how long the last flush took

    def last_step(self) -> int:
        return self.history[-1]["step"] if self.history else 0

    def _steps(self) -> list:
        return [r["step"] for r in self.history]

    def drop_from(self, step: int) -> int:
        """Forget records of steps >= step (a restarted engine replays them); returns how many."""
        i = bisect.bisect_left(self._steps(), step)
        dropped = len(self.history) - i
        del self.history[i:]
        self.samples = [s for s in self.samples if s["step"] < step]
        return dropped

    def add_step(self, ev: dict) -> dict:
        n = int(ev["step"])
        rec = {"step": n, "phase": ev.get("phase", self.state["phase"])}
        rec.update({k: _finite(ev.get(k)) for k in STEP_FIELDS})
        rec["skipped"] = bool(ev.get("skipped", False))
        rec["t"] = time.time()
        if self.history and self.history[-1]["step"] == n and "loss" not in self.history[-1]:
            rec["val_loss"] = self.history[-1].get("val_loss")  # a validation arrived first
            self.history[-1] = rec
        else:
            if self.history and self.history[-1]["step"] >= n:
                self.drop_from(n)  # a replay without a resume event: keep each step once
            self.history.append(rec)
        self.state.update(step=n, phase=rec["phase"])
        return rec

    def add_val(self, ev: dict) -> None:
        n, v = int(ev["step"]), _finite(ev.get("val_loss"))
        steps = self._steps()
        i = bisect.bisect_left(steps, n)
        if i < len(steps) and steps[i] == n:
            self.history[i]["val_loss"] = v
        else:
            self.history.insert(i, {"step": n, "phase": self.state["phase"], "val_loss": v})

    def add_samples(self, ev: dict) -> None:
        n = int(ev["step"])
        self.samples = [s for s in self.samples if s["step"] < n]
        self.samples.append({"step": n, "phase": self.state["phase"], "t": time.time(),
                             "samples": list(ev.get("samples", []))})
        self.write_samples()

    def set_checkpoint(self, path: str, step: int) -> None:
        p = Path(path)
        try:
            p = p.resolve().relative_to(self.run_dir.resolve())
        except ValueError:
            pass  # outside the run folder: keep it as the engine gave it
        self.state.update(last_checkpoint=str(p), last_checkpoint_step=int(step))

    def write_samples(self) -> None:
        atomic_write_json(self.samples_path, {"exp": self.loss_meta["exp"], "samples": self.samples})

    def flush(self, force: bool = False) -> None:
        """Rewrite history and state; unforced rewrites at most once per flush_s seconds, and rarer
        when the history is so long that writing it would take more than 5% of the time."""
        now = time.time()
        if not force and now - self._last_flush < max(self.flush_s, 20 * self._write_s):
            return
        self.state["updated_at"] = now
        atomic_write_json(self.loss_path, {**self.loss_meta, "history": self.history})
        atomic_write_json(self.state_path, self.state)
        self._last_flush = time.time()
        self._write_s = self._last_flush - now


def _safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", str(s)) or "phase"


def archive_pivot(rec: RunRecords, ev: dict) -> Path:
    """Copy samples, state and the pivot checkpoint into archive/<from>-<step>/ (never the history)."""
    step, src_phase = int(ev["step"]), ev.get("from") or rec.state["phase"] or "phase"
    ckpt = Path(ev["checkpoint"])
    if not ckpt.is_absolute() and not ckpt.exists():
        ckpt = rec.run_dir / ckpt
    rec.set_checkpoint(str(ckpt), step)
    rec.state.update(step=max(rec.state["step"] or 0, step), phase=src_phase)
    dest = rec.run_dir / "archive" / f"{_safe_name(src_phase)}-{step}"
    rec.state["archives"] = [a for a in rec.state["archives"] if a["dir"] != str(dest.relative_to(rec.run_dir))]
    rec.state["archives"].append({"phase": src_phase, "step": step, "dir": str(dest.relative_to(rec.run_dir))})
    rec.write_samples()
    rec.flush(force=True)
    dest.mkdir(parents=True, exist_ok=True)
    for src in (rec.samples_path, rec.state_path, ckpt, ckpt.with_suffix(".json")):
        if not src.is_file():
            raise FileNotFoundError(f"pivot at step {step}: {src} does not exist; cannot archive it")
        atomic_copy(src, dest / src.name)
    rec.state["phase"] = ev.get("to", rec.state["phase"])
    rec.flush(force=True)
    return dest


class Supervisor:
    """One supervision session: engine lives, signals, restarts; see the module docstring."""

    def __init__(self, cfg, run_dir: Path, *, max_restarts: int, backoff_s: float, backoff_max_s: float,
                 flush_s: float, progress: bool, on_event: Optional[Callable[[dict, int], None]],
                 engine_argv: Optional[Sequence[str]]):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.max_restarts, self.backoff_s, self.backoff_max_s = max_restarts, backoff_s, backoff_max_s
        self.on_event = on_event
        self.argv = list(engine_argv) if engine_argv else [
            sys.executable, "-m", "andrea.cli", "engine", "--config", str(self.run_dir / "config.yaml"),
            "--run-dir", str(self.run_dir), "--resume"]
        self.rec = RunRecords(cfg.exp, self.run_dir, int(cfg.train.steps), flush_s)
        self.proc: Optional[subprocess.Popen] = None
        self.stop_requested = False
        self.bar = tqdm(total=int(cfg.train.steps), initial=self.rec.last_step(), desc=cfg.exp, unit="step",
                        file=sys.stderr, disable=not progress, dynamic_ncols=True,
                        # into a log file (the workflow's train rule), a line every 30 s, not per step
                        mininterval=0.1 if sys.stderr.isatty() else 30.0)

    def _say(self, msg: str) -> None:
        tqdm.write(f"andrea.proxy: {msg}", file=sys.stderr)  # above the bar, on stderr like the bar

    # signals ---------------------------------------------------------------------------------
    def _send(self, sig: int) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass  # exited between poll and kill

    def _on_stop(self, signum, frame) -> None:
        self.stop_requested = True
        self._send(signal.SIGTERM)

    def _on_usr1(self, signum, frame) -> None:
        self._send(signal.SIGUSR1)

    def _install_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            print("andrea.proxy: not in the main thread, so signals are not forwarded", file=sys.stderr)
            return {}
        handlers = {signal.SIGTERM: self._on_stop, signal.SIGINT: self._on_stop, signal.SIGUSR1: self._on_usr1}
        return {s: signal.signal(s, h) for s, h in handlers.items()}

    # one engine life -------------------------------------------------------------------------
    def _handle(self, ev: dict, life: dict) -> None:
        kind, rec = ev.get("event"), self.rec
        if kind == "step":
            if not life["stepped"] and life["resume"] is None:
                rec.drop_from(int(ev["step"]))  # fresh start (no checkpoint): replaces any old history
            life["stepped"] = True
            r = rec.add_step(ev)
            self._progress(r)
            rec.flush()
        elif kind == "resume":
            life["resume"] = int(ev["step"])
            rec.drop_from(life["resume"] + 1)
            rec.set_checkpoint(ev.get("checkpoint", ""), life["resume"])
            rec.state["step"] = life["resume"]
            self._progress(None, reset_to=life["resume"])
            rec.flush(force=True)
        elif kind == "val":
            if not life["stepped"] and life["resume"] is None:
                rec.drop_from(int(ev["step"]))
            life["stepped"] = True
            rec.add_val(ev)
            rec.flush(force=True)
        elif kind == "sample":
            rec.add_samples(ev)
        elif kind == "checkpoint":
            rec.set_checkpoint(ev["path"], ev["step"])
            life["ckpt"] = max(life["ckpt"], int(ev["step"]))
            rec.flush(force=True)
        elif kind == "pivot":
            life["ckpt"] = max(life["ckpt"], int(ev["step"]))
            try:
                dest = archive_pivot(rec, ev)
                self._say(f"phase {ev.get('from')} -> {ev.get('to')} at step {ev['step']}; archived to {dest}")
            except OSError as e:  # training is worth more than its archive: say it loudly, go on
                rec.state["message"] = f"archiving the pivot at step {ev['step']} failed: {e}"
                self._say(rec.state["message"])
                rec.flush(force=True)
        elif kind == "plan":
            rec.state["n_params"] = ev.get("n_params")
        elif kind == "done":
            life["done"] = ev.get("status")
        if self.on_event is not None:
            self.on_event(ev, self.proc.pid)

    def _progress(self, r: Optional[dict], reset_to: Optional[int] = None) -> None:
        if reset_to is not None:
            self.bar.n = self.bar.last_print_n = reset_to
            self.bar.refresh()
            return
        if r["step"] < self.bar.n:
            self.bar.n = self.bar.last_print_n = r["step"] - 1
        self.bar.update(r["step"] - self.bar.n)
        loss, tps = r.get("loss"), r.get("tokens_per_s") or 0.0
        self.bar.set_postfix(loss="nan" if loss is None else f"{loss:.4f}", tok_s=f"{tps:,.0f}",
                             phase=r.get("phase"), refresh=False)

    def _run_engine(self) -> tuple:
        """Start the engine, follow its stdout to the end; returns (exit code, life summary)."""
        life = {"resume": None, "stepped": False, "ckpt": -1, "done": None}
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     text=True, encoding="utf-8", errors="replace", bufsize=1,
                                     process_group=0)
        self.rec.state.update(status="running", engine_pid=self.proc.pid, pid=os.getpid())
        self.rec.flush(force=True)
        if self.stop_requested:  # a signal arrived while no engine was running
            self._send(signal.SIGTERM)
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except ValueError:  # e.g. the last line of a killed engine, cut in the middle
                self._say(f"ignoring a line that is not JSON: {line[:120]!r}")
                continue
            if isinstance(ev, dict):
                self._handle(ev, life)
        rc = self.proc.wait()
        self.rec.state["engine_exit"] = rc
        return rc, life

    def _wait_backoff(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stop_requested and time.monotonic() < end:
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def run(self) -> int:
        failures, rc, st = 0, 0, self.rec.state
        if not self.rec.samples_path.exists():
            self.rec.write_samples()  # all three records exist from the start, for their readers
        while True:
            if self.stop_requested:
                st.update(status="stopped", message="stopped by a signal before the engine restarted")
                return 0
            rc, life = self._run_engine()
            if rc == 0:
                # the engine's own word wins: a stop that came after the last step is a finish
                stopped = life["done"] == "stopped" or (life["done"] is None and self.stop_requested)
                st.update(status="stopped" if stopped else "finished", message=f"engine done: {life['done']}")
                return 0
            if rc == ABORT_EXIT:
                st.update(status="failed", message="engine aborted: too many non-finite steps in a row (exit 3)")
                return ABORT_EXIT
            if rc == INPUT_EXIT:
                st.update(status="failed", message="engine refused its input (exit 2); see its error above")
                return INPUT_EXIT
            if self.stop_requested:
                st.update(status="failed", message=f"engine exited with {rc} while stopping")
                return 1
            progressed = life["ckpt"] > (life["resume"] if life["resume"] is not None else 0)
            failures = 1 if progressed else failures + 1
            if failures > self.max_restarts:
                st.update(status="failed", message=f"engine exited with {rc}; gave up after {failures - 1} "
                                                   f"restarts in a row without a new checkpoint")
                return 1
            wait = min(self.backoff_max_s, self.backoff_s * 2 ** (failures - 1))
            st["message"] = f"engine exited with {rc}; restart {st['restarts'] + 1} in {wait:.1f} s"
            self._say(st["message"])
            self.rec.flush(force=True)
            self._wait_backoff(wait)
            if not self.stop_requested:
                st["restarts"] += 1

    def close(self, error: Optional[BaseException] = None) -> None:
        """Never leave an engine behind, nor a state that says running, even when the proxy fails."""
        if self.proc is not None and self.proc.poll() is None:
            self._send(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.rec.state["status"] == "running":
            self.rec.state.update(status="failed", message=f"proxy error: {error!r}; engine stopped")
        self.rec.state["engine_pid"] = None
        self.rec.flush(force=True)
        self.bar.close()


def supervise(cfg, run_dir, *, max_restarts: Optional[int] = None, backoff_s: Optional[float] = None,
              backoff_max_s: Optional[float] = None, flush_s: Optional[float] = None, progress: bool = True,
              on_event: Optional[Callable[[dict, int], None]] = None,
              engine_argv: Optional[Sequence[str]] = None) -> int:
    """Run the engine for cfg in run_dir under supervision until it finishes, stops or fails.

    Restart and flush settings come from cfg.proxy (andrea.config.ProxyConfig); a keyword given
    here wins.

    Returns 0 (finished or stopped by a signal), 3 (engine aborted) or 1 (gave up after restarts).
    on_event(event, engine_pid) is called after each engine event is recorded (monitoring, tests).
    Raises RecordError before starting anything if a record file in run_dir is corrupt.
    """
    run_dir = Path(run_dir)
    pc = getattr(cfg, "proxy", None)

    def pick(value, field, default):
        return value if value is not None else getattr(pc, field, default)

    max_restarts = pick(max_restarts, "max_restarts", MAX_RESTARTS)
    backoff_s = pick(backoff_s, "restart_backoff_s", BACKOFF_S)
    backoff_max_s = pick(backoff_max_s, "restart_backoff_max_s", BACKOFF_MAX_S)
    flush_s = pick(flush_s, "record_flush_s", FLUSH_S)
    if not (run_dir / "config.yaml").is_file() and engine_argv is None:
        raise FileNotFoundError(f"run folder {run_dir}: no config.yaml; the engine reads the resolved "
                                f"config from there (python -m andrea.train writes it)")
    lock = open(run_dir / ".proxy.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise RuntimeError(f"run folder {run_dir}: another proxy already supervises it (.proxy.lock held)")
    try:
        sup = Supervisor(cfg, run_dir, max_restarts=max_restarts, backoff_s=backoff_s,
                         backoff_max_s=backoff_max_s, flush_s=flush_s, progress=progress,
                         on_event=on_event, engine_argv=engine_argv)
        old = sup._install_signals()
        error = None
        try:
            return sup.run()
        except BaseException as e:
            error = e
            raise
        finally:
            sup.close(error)
            for s, h in old.items():
                signal.signal(s, h)
    finally:
        lock.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    from andrea.config import load_run_config

    ap = argparse.ArgumentParser(prog="python -m andrea.proxy", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="run folder holding the resolved config.yaml")
    ap.add_argument("--max-restarts", type=int, help="default: the config's proxy.max_restarts")
    ap.add_argument("--backoff", type=float, help="first restart back-off, seconds (proxy.restart_backoff_s)")
    ap.add_argument("--flush", type=float, help="least seconds between history rewrites (proxy.record_flush_s)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = ap.parse_args(argv)
    cfg = load_run_config(a.run_dir / "config.yaml")
    try:
        return supervise(cfg, a.run_dir, max_restarts=a.max_restarts, backoff_s=a.backoff,
                         flush_s=a.flush, progress=not a.no_progress)
    except (RecordError, RuntimeError, FileNotFoundError) as e:
        print(f"andrea.proxy: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
