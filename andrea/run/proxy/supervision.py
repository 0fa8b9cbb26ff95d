"""Training proxy: supervises the engine process and keeps the run's records.

`supervise(cfg, run_dir)` starts the engine (`python -m andrea.cli engine --config RUN/config.yaml
--run-dir RUN --resume`) as a child process, reads the events it prints on stdout (the engine
protocol, andrea/run/protocol.py) and keeps the run's record files through RunRecords
(andrea/run/proxy/records.py documents their formats).

Signals: SIGTERM, SIGINT (Ctrl-C) or SIGUSR2 to the proxy forwards SIGTERM to the engine, which checkpoints
at the next step boundary and exits 0; the proxy then writes status `stopped` and returns 0. SIGUSR1
is forwarded as is (checkpoint and go on). The engine runs in its own process group, so a Ctrl-C in
the terminal reaches it only once, through the proxy.

Crash recovery: an engine exit other than 0, 2, 3 and 4 (killed, out of memory, a CUDA error) restarts
it with --resume from its newest good checkpoint, after a back-off that doubles with each failure in
a row (backoff_s, 2*backoff_s, ..., at most backoff_max_s); max_restarts failures in a row without a
new checkpoint give up with status `failed`. Exit 2 (bad input: config, shards or checkpoint, which
a restart cannot mend), exit 3 (train.max_bad_steps non-finite steps) and exit 4 (a checkpoint did
not fit on the disk; a restart would only fill it again) end the run with status `failed`, no
restart, the engine's message (its `error` event) in state.json. A stop that reaches an engine
still starting (before its signal handlers) is a stop, not a failure: it had trained nothing.

Kills: the engine is started with ANDREA_PROXY_PID, so it dies with this process. A proxy killed
at any moment may have lost the events of a checkpoint the engine wrote just before; so each
engine life starts with --resume-at-most <last_checkpoint_step of the state file>: the engine
resumes from the newest valid checkpoint at or below it and replays the rest (the same bits), and
the history keeps every step exactly once, with its validation loss and samples. An engine that
starts from step 0 although a checkpoint once backed the history (its checkpoints deleted) never
truncates it: the records are moved to previous/step<N>-<time>/ and the proxy says so in one line.

Checkpoints: when the run folder holds checkpoints but none of them is valid, the proxy refuses
to start (CheckpointError naming each file and why) and writes nothing; a damaged one the engine
skips is reported (`bad_checkpoint`) and listed in state.json's skipped_checkpoints.

Phases: the engine itself writes a checkpoint just before crossing train.phases[i].start_step and
prints a `pivot` event; the checkpoint is taken at the exact step boundary, which a signal from the
proxy could not guarantee. The proxy then archives it (aside.archive_pivot). Training goes on.

`.proxy.lock` in the run folder (an flock, andrea/util/lock.py) keeps a second proxy off a run that is
being supervised; the engine holds `.engine.lock`.

Run: `python -m andrea.run.proxy results/ANDREA-tiny` or `andrea-proxy results/ANDREA-tiny` (the folder
must hold the resolved config.yaml); usually started for you by `python -m andrea.train`.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from andrea.config import ProxyConfig
from andrea.util.lock import run_lock
from andrea.run.protocol import (EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_GAVE_UP, EXIT_NO_SPACE, EXIT_OK, PROXY_PID_ENV,
                             parse)

from .aside import archive_pivot
from .records import FLUSH_S, RecordError, RunRecords, record_names
from .trackers import open_trackers

# defaults when a config carries no proxy group (andrea.config.ProxyConfig documents each)
MAX_RESTARTS = ProxyConfig.max_restarts
BACKOFF_S = ProxyConfig.restart_backoff_s
BACKOFF_MAX_S = ProxyConfig.restart_backoff_max_s
STOP_TIMEOUT_S = 600.0  # how long a stopping engine may take to checkpoint before it is killed


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
        self.own_argv = not engine_argv
        self.lives = 0
        self.rec = RunRecords(cfg.exp, self.run_dir, int(cfg.train.steps), flush_s, int(cfg.train.log_every))
        self.proc: Optional[subprocess.Popen] = None
        self.stop_requested = False
        self.trackers = open_trackers(cfg, self.run_dir, self._say)  # proxy.trackers (opt-in), fed below
        self.bar = tqdm(total=int(cfg.train.steps), initial=self.rec.last_step(), desc=cfg.exp, unit="step",
                        file=sys.stderr, disable=not progress, dynamic_ncols=True,
                        # into a log file (the workflow's train rule), a line every 30 s, not per step
                        mininterval=0.1 if sys.stderr.isatty() else 10.0)

    def _tidy_records(self) -> None:
        """Say what opening the records mended, and remove the temporary files of record writes
        whose process is dead (a SIGKILL cannot run cleanup)."""
        from andrea.core.checkpoint import remove_stale_tmp

        for note in self.rec.notes:
            self._say(note)
        gone = remove_stale_tmp(self.run_dir, names=record_names(self.cfg.exp))
        if gone:
            self._say(f"removed {len(gone)} temporary file(s) of dead processes' record writes: "
                      f"{', '.join(p.name for p in gone)}")

    def _say(self, msg: str) -> None:
        tqdm.write(f"andrea.run.proxy: {msg}", file=sys.stderr)  # above the bar, on stderr like the bar

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
            print("andrea.run.proxy: not in the main thread, so signals are not forwarded", file=sys.stderr)
            return {}
        # SIGUSR2: a stop too, the one mpirun forwards to every rank of a data-parallel launch
        handlers = {signal.SIGTERM: self._on_stop, signal.SIGINT: self._on_stop, signal.SIGUSR2: self._on_stop,
                    signal.SIGUSR1: self._on_usr1}
        return {s: signal.signal(s, h) for s, h in handlers.items()}

    # one engine life -------------------------------------------------------------------------
    def _handle(self, ev: dict, life: dict) -> None:
        kind, rec = ev.get("event"), self.rec
        if kind == "step":
            if not life["stepped"] and life["resume"] is None:
                self._fresh_start(int(ev["step"]))
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
                self._fresh_start(int(ev["step"]))
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
            rec.state["plan_bytes"] = ev.get("total_bytes")
        elif kind == "bad_checkpoint":
            name, reason = Path(str(ev.get("checkpoint", "?"))).name, str(ev.get("reason", "?"))
            skipped = rec.state.setdefault("skipped_checkpoints", [])
            if {"file": name, "reason": reason} not in skipped:
                skipped.append({"file": name, "reason": reason})
            self._say(f"checkpoint {name} is not valid and was skipped: {reason}")
            rec.flush(force=True)
        elif kind == "error":
            life["error"] = str(ev.get("message", ""))
        elif kind == "done":
            life["done"] = ev.get("status")
        self.trackers.feed(ev)  # steps and validations to the trackers' queue: never waits, never raises
        if self.on_event is not None:
            self.on_event(ev, self.proc.pid)

    def _fresh_start(self, step: int) -> None:
        """The engine started from step 0: no checkpoint at or below the resume limit. A history a
        checkpoint once backed (or one without its state file) is never truncated: it is kept in
        previous/ and the run says so in one line. Steps no checkpoint ever covered are replayed
        with the same bits, so those records are simply replaced."""
        rec = self.rec
        said = max(rec.last_step(), rec.state.get("step") or 0)
        if rec.last_step() and (rec.state.get("last_checkpoint_step") or rec.orphan):
            self.trackers.close("stopped")  # the old history's tracker runs end with it
            dest = rec.keep_aside(f"step{said}")
            self._trackers_aside(dest)
            rec.state["message"] = (f"starting over from step 0: no checkpoint found, state says step {said}; "
                                    f"the old history is kept in {dest.relative_to(self.run_dir)}/")
            self._say(rec.state["message"])
            rec.flush(force=True)
        else:
            rec.drop_from(step)

    def _trackers_aside(self, dest: Path) -> None:
        """trackers/ (what the closed trackers wrote) beside the history it belongs to in dest, and
        new tracker runs for the history that starts now, fed from step 1."""
        mine = self.run_dir / "trackers"
        if mine.exists():
            try:
                mine.rename(dest / "trackers")
            except OSError as e:
                self._say(f"trackers: could not move {mine} to {dest}/ ({e.strerror or e}); the new tracker "
                          "runs write beside the old ones")
        self.trackers = open_trackers(self.cfg, self.run_dir, self._say)

    def _restart_bar(self, at: int) -> None:
        """Move the bar to step `at` and start its clock and rate afresh: a resume goes back to
        its checkpoint's step, and a rate measured across that jump would be negative."""
        from tqdm.std import EMA

        bar = self.bar
        bar.n = bar.last_print_n = bar.initial = at
        if bar.disable:
            return
        bar.last_print_t = bar.start_t = bar._time()
        bar._ema_dn, bar._ema_dt, bar._ema_miniters = EMA(bar.smoothing), EMA(bar.smoothing), EMA(bar.smoothing)
        bar.refresh()

    def _progress(self, r: Optional[dict], reset_to: Optional[int] = None) -> None:
        if reset_to is not None:
            self._restart_bar(reset_to)
            return
        if r["step"] <= self.bar.n:
            self._restart_bar(r["step"] - 1)
        self.bar.update(r["step"] - self.bar.n)
        loss, tps = r.get("loss"), r.get("tokens_per_s") or 0.0
        self.bar.set_postfix(loss="nan" if loss is None else f"{loss:.4f}", tok_s=f"{tps:,.0f}",
                             phase=r.get("phase"), refresh=False)

    def _run_engine(self) -> tuple:
        """Start the engine, follow its stdout to the end; returns (exit code, life summary)."""
        life = {"resume": None, "stepped": False, "ckpt": -1, "done": None, "error": None}
        argv = list(self.argv)
        limit = self._resume_limit()
        if self.own_argv and limit is not None:
            argv += ["--resume-at-most", str(limit)]
        self.lives += 1
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     text=True, encoding="utf-8", errors="replace", bufsize=1,
                                     process_group=0, env={**os.environ, PROXY_PID_ENV: str(os.getpid())})
        self.rec.state.update(status="running", engine_pid=self.proc.pid, pid=os.getpid())
        self.rec.flush(force=True)
        if self.stop_requested:  # a signal arrived while no engine was running
            self._send(signal.SIGTERM)
        for line in self.proc.stdout:
            try:
                ev = parse(line)
            except ValueError:  # e.g. the last line of a killed engine, cut in the middle
                self._say(f"ignoring a line that is not JSON: {line.strip()[:120]!r}")
                continue
            if ev is not None:
                self._handle(ev, life)
        rc = self.proc.wait()
        self.rec.state["engine_exit"] = rc
        return rc, life

    def _resume_limit(self) -> Optional[int]:
        """The newest step the engine may resume from: the last checkpoint whose events were all
        recorded (see the module docstring). None: no records to keep whole (a run folder without
        a state file), so the newest checkpoint."""
        step = self.rec.state.get("last_checkpoint_step")
        if step is not None:
            return int(step)
        return 0 if (self.rec.state_loaded or self.lives) else None

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
                return EXIT_OK
            rc, life = self._run_engine()
            if rc == EXIT_OK:
                # the engine's own word wins: a stop that came after the last step is a finish
                stopped = life["done"] == "stopped" or (life["done"] is None and self.stop_requested)
                st.update(status="stopped" if stopped else "finished", message=f"engine done: {life['done']}")
                return EXIT_OK
            if rc == EXIT_ABORTED:
                st.update(status="failed", message="engine aborted: too many non-finite steps in a row (exit 3)")
                return EXIT_ABORTED
            if rc == EXIT_BAD_INPUT:
                st.update(status="failed", message=f"engine refused its input (exit 2): {life['error'] or 'see its error above'}")
                return EXIT_BAD_INPUT
            if rc == EXIT_NO_SPACE:
                st.update(status="failed", message=f"engine stopped, disk full (exit 4): {life['error'] or 'see its error above'}")
                return EXIT_NO_SPACE
            if self.stop_requested and rc == -signal.SIGTERM and not life["stepped"]:
                # the stop reached the engine while it was starting, before its handlers: it had
                # trained nothing in this life, so there was nothing to save
                st.update(status="stopped", message="stopped by a signal while the engine was starting")
                return EXIT_OK
            if self.stop_requested:
                st.update(status="failed", message=f"engine exited with {rc} while stopping")
                return EXIT_GAVE_UP
            progressed = life["ckpt"] > (life["resume"] if life["resume"] is not None else 0)
            failures = 1 if progressed else failures + 1
            if failures > self.max_restarts:
                st.update(status="failed", message=f"engine exited with {rc}; gave up after {failures - 1} "
                                                   f"restarts in a row without a new checkpoint")
                return EXIT_GAVE_UP
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
        self.rec.flush(force=True, whole=True)
        self.trackers.close(self.rec.state["status"])  # waits trackers.CLOSE_WAIT_S at most
        self.bar.close()
        if self.rec.write_error is not None:
            print(f"andrea.run.proxy: the last state could not be written ({self.rec.write_error}); "
                  f"{self.rec.state_path} may be stale", file=sys.stderr)


def refuse_unusable_checkpoints(run_dir: Path) -> None:
    """CheckpointError when run_dir/checkpoints holds checkpoints but none is valid: a fresh start
    would replace the history and overwrite them, so nothing is started and nothing written."""
    from andrea.core.checkpoint import CheckpointError, check_folder, scan

    check_folder(run_dir / "checkpoints")  # a symlink loop, a file, no permission: refused, one line
    best, skipped = scan(run_dir)
    if best is None and skipped:
        names = "; ".join(f"{p.name}: {reason}" for p, reason in skipped)
        raise CheckpointError(f"{run_dir / 'checkpoints'}: {len(skipped)} checkpoint(s) and none is valid ({names}). "
                              "Nothing was started or changed: repair them, or move the folder away to start afresh")


def supervise(cfg, run_dir, *, max_restarts: Optional[int] = None, backoff_s: Optional[float] = None,
              backoff_max_s: Optional[float] = None, flush_s: Optional[float] = None, progress: bool = True,
              on_event: Optional[Callable[[dict, int], None]] = None,
              engine_argv: Optional[Sequence[str]] = None) -> int:
    """Run the engine for cfg in run_dir under supervision until it finishes, stops or fails.

    Restart and flush settings come from cfg.proxy (andrea.config.ProxyConfig); a keyword given
    here wins.

    Returns an exit code of andrea.run.protocol: 0 (finished, or stopped by a signal), 1 (gave up after
    max_restarts restarts in a row without a new checkpoint, or the engine failed while stopping),
    2 (the engine refused its input, or only damaged checkpoints), 3 (the engine aborted after too
    many non-finite steps) or 4 (a checkpoint did not fit on the disk).
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
    with run_lock(run_dir, "proxy"):
        refuse_unusable_checkpoints(run_dir)
        sup = Supervisor(cfg, run_dir, max_restarts=max_restarts, backoff_s=backoff_s,
                         backoff_max_s=backoff_max_s, flush_s=flush_s, progress=progress,
                         on_event=on_event, engine_argv=engine_argv)
        sup._tidy_records()
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    from andrea.core.checkpoint import CheckpointError
    from andrea.config import load_run_config

    ap = argparse.ArgumentParser(prog="python -m andrea.run.proxy", description=__doc__.splitlines()[0])
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
    except (RecordError, CheckpointError, RuntimeError, FileNotFoundError) as e:
        print(f"andrea.run.proxy: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
