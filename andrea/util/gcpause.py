"""The cyclic garbage collector paused while a block builds many container objects.

Building a task's Requests makes hundreds of thousands of lists (tens of millions of token ids):
every few hundred new containers the collector runs, and its older generations' runs traverse all
of them again, so the build grew quadratically (10-shot language identification: 16 s unpacked with
the collector, 2 s without it). Nothing built there holds a reference cycle.

    with gc_paused():
        reqs = [Request(...) for ...]
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    """Pause the collector for the block (if it was on), and restore it after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
