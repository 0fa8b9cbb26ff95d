"""The engine protocol: what the engine process says on stdout and how it exits.

The engine (`andrea.cli engine`, the loop in `andrea.run.runner`) writes one JSON object per line on
stdout, each with an "event" key; human text goes to stderr. The proxy (`andrea.run.proxy`)
reads those lines and keeps the run's records. This module is the one place that names the events
and the exit codes; both sides import them from here.

Events, in the order a run emits them:
    plan        n_params, total_bytes, rows [{name, bytes}]: the memory plan, once per start
    resume      step, checkpoint: training continues after that checkpoint's step
    step        step, phase, loss, lr, grad_norm, loss_scale, tokens_per_s, wall_s, skipped;
                with data groups also group, mix {group: p}, group_loss {group: smoothed loss}
    val         step, val_loss; with groups that name val_shards also group_val_loss {group: loss}
    sample      step, samples [{prompt, completion}]
    checkpoint  step, path, reason (cadence | signal | final | pivot | abort)
    pivot       step, from, to, checkpoint: a phase boundary, checkpointed at that exact step
    done        step, status (finished | stopped | aborted): the last line of a clean exit
    bad_checkpoint  checkpoint, reason: a damaged checkpoint skipped on resume (one per file)
    error       message: why the engine is about to exit 2 or 4 (for the proxy's state file)

The proxy starts the engine with ANDREA_PROXY_PID set to its own pid: the engine then dies with
it (Linux PR_SET_PDEATHSIG) and exits at once if it is already gone. When its stdout closes, the
engine stops at the next event or checkpoint, writing nothing (exit 5): a checkpoint nobody
records would leave the steps before it out of the history.

Exit codes of the engine and of `python -m andrea.train` / `python -m andrea.run.proxy`:
    0   finished, or stopped by a signal (with a checkpoint)
    1   the proxy gave up (restarts without progress, or the engine failed while stopping)
    2   bad input (config, shards, checkpoint, record files): a restart cannot mend it
    3   aborted after train.max_bad_steps non-finite steps in a row (non-finite weights are never
        written, so the newest checkpoint holds the last good ones)
    4   a checkpoint did not fit on the disk (nothing half-written left, the previous one intact)
    5   (engine) its proxy is gone: stopped without writing a checkpoint
    75  (python -m andrea.train) stopped before the last step (a signal, a preemption): the same
        command resumes it; 0 there means the run finished
Any other engine exit (killed, out of memory, a CUDA error) is a crash the proxy restarts from.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

EVENTS = ("plan", "resume", "step", "val", "sample", "checkpoint", "pivot", "done", "bad_checkpoint", "error")

EXIT_OK = 0
EXIT_GAVE_UP = 1
EXIT_BAD_INPUT = 2
EXIT_ABORTED = 3
EXIT_NO_SPACE = 4
EXIT_ORPHANED = 5
EXIT_STOPPED = 75  # EX_TEMPFAIL of sysexits.h
PROXY_PID_ENV = "ANDREA_PROXY_PID"


def run_command(prog: str, fn, args) -> int:
    """fn(args), a command that uses a model or its files: its exit code, or a bad input or a full
    disk said in one line on stderr as `prog: ...` with EXIT_BAD_INPUT or EXIT_NO_SPACE (the
    commands of andrea/cli.py and `python -m andrea.tasks`)."""
    from ..util.atomic import NoSpace

    try:
        return fn(args)
    except NoSpace as e:  # names the file it was writing, what it needed and what is free
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_NO_SPACE
    except (ValueError, FileNotFoundError) as e:
        print(f"{prog}: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT


def emit(event: str, **fields) -> None:
    """Write one event line on stdout and flush it (the proxy reads it at once)."""
    if event not in EVENTS:
        raise ValueError(f"engine event {event!r}: expected one of {EVENTS}")
    try:
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # the reader (the proxy) is gone: stop now, write nothing
        print(f"engine: stdout is closed (the proxy is gone); stopping at step {fields.get('step', '?')} "
              "without a checkpoint", file=sys.stderr)
        os._exit(EXIT_ORPHANED)


def reader_gone() -> bool:
    """True when stdout is a pipe whose reading end has been closed (the proxy is gone)."""
    import select
    import stat

    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        p = select.poll()
        p.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def parse(line: str) -> Optional[dict]:
    """The event of one stdout line; None for a blank line or JSON that is not an object.
    Raises ValueError for a line that is not JSON (e.g. the last line of a killed engine, cut short)."""
    line = line.strip()
    if not line:
        return None
    ev = json.loads(line)
    return ev if isinstance(ev, dict) else None
