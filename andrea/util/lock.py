"""Run-folder locks: an flock on a file in the run folder, held for as long as a process works
on the run, released by the kernel when that process dies (kill -9 included).

    with run_lock(run_dir, "proxy"):     # .proxy.lock: one proxy (and one andrea.train) per run
        ...
    with run_lock(run_dir, "engine"):    # .engine.lock: one engine per run

Taking a lock this process already holds is a no-op (andrea.train takes the proxy lock before it
touches the folder, then calls the proxy, which asks for it again). A lock held by another
process raises LockHeld at once, without waiting.
"""
from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator

_HELD: Dict[str, int] = {}  # lock file path -> open fd, for the locks this process holds


class LockHeld(RuntimeError):
    """Another process holds the lock."""


def lock_path(run_dir, who: str) -> Path:
    return Path(run_dir) / f".{who}.lock"


@contextmanager
def run_lock(run_dir, who: str, wait_s: float = 0.0) -> Iterator[Path]:
    """Hold .<who>.lock in run_dir; wait_s > 0 retries that long first (a process that was just
    killed may take a moment to be gone)."""
    path = lock_path(run_dir, who)
    key = str(path.resolve())
    if key in _HELD:
        yield path
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < end:
                time.sleep(0.05)
                continue
            os.close(fd)
            what = "proxy already supervises it" if who == "proxy" else f"{who} is already running on it"
            raise LockHeld(f"run folder {run_dir}: another {what} ({path.name} held); nothing was changed") from None
    _HELD[key] = fd
    try:
        yield path
    finally:
        del _HELD[key]
        os.close(fd)
