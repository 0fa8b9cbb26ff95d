"""The engine protocol: what the engine process says on stdout and how it exits.

The engine (`andrea.cli engine`, the loop in `andrea.runner`) writes one JSON object per line on
stdout, each with an "event" key; human text goes to stderr. The proxy (`andrea.proxy`)
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

Exit codes of the engine and of `python -m andrea.train` / `python -m andrea.proxy`:
    0   finished, or stopped by a signal (with a checkpoint)
    1   the proxy gave up (restarts without progress, or the engine failed while stopping)
    2   bad input (config, shards, checkpoint, record files): a restart cannot mend it
    3   aborted after train.max_bad_steps non-finite steps in a row (the checkpoint holds the
        last good weights)
Any other engine exit (killed, out of memory, a CUDA error) is a crash the proxy restarts from.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

EVENTS = ("plan", "resume", "step", "val", "sample", "checkpoint", "pivot", "done")

EXIT_OK = 0
EXIT_GAVE_UP = 1
EXIT_BAD_INPUT = 2
EXIT_ABORTED = 3


def emit(event: str, **fields) -> None:
    """Write one event line on stdout and flush it (the proxy reads it at once)."""
    if event not in EVENTS:
        raise ValueError(f"engine event {event!r}: expected one of {EVENTS}")
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def parse(line: str) -> Optional[dict]:
    """The event of one stdout line; None for a blank line or JSON that is not an object.
    Raises ValueError for a line that is not JSON (e.g. the last line of a killed engine, cut short)."""
    line = line.strip()
    if not line:
        return None
    ev = json.loads(line)
    return ev if isinstance(ev, dict) else None
