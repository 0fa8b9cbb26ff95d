"""The Requests of a list of tasks, built in worker processes while the device scores the tasks
before them: a task's prompts and tokens do not depend on the others' scores, and building them
(few-shot prompts of thousands of characters, tens of thousands of items) is the host's part of
scoring, as long as the forward passes on a GPU.

    with Prepared(tok, [("arc_easy", 10), ("piqa", 10)], data_dir, window) as prep:
        items, reqs = prep.get("arc_easy")      # waits for that task's, built in a worker

Workers are forked from a fresh server process that imported this module alone (multiprocessing's
forkserver: never from this process, which holds a CUDA context and the tokenizer's threads; the
caller's script is not re-run in them), at most one a task and one fewer than the CPUs, each
tokenising with its share of them. A worker sends
a task's Requests back as NumPy arrays (the tokens of all of them in one), which the parent turns
back into Requests. With one task, one CPU, or items that do not come from files (the hub), nothing
is spawned: get() builds them in this process when asked.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..util.gcpause import gc_paused
from .data import read_items
from .hub import from_hub, hub_items
from .prompts import Request, requests
from .suites import task_of

_TOKENIZERS: Dict[str, object] = {}  # a worker's tokenizer, loaded once per path


def build(tok, name: str, fewshot: int, data_dir, window: int, limit: int = 0) -> Tuple[List[dict], List[Request]]:
    """(every item of the task's file, the Requests of its first limit, all by default)."""
    task = task_of(name)
    if from_hub(data_dir):
        items = hub_items(name)
    else:
        items = read_items(Path(data_dir) / task.path, task.kind)  # all of them: the few-shot pool
    n = min(limit, len(items)) if limit else len(items)
    with gc_paused():
        return items, requests(tok, items, task.kind, task.delimiter, fewshot, window, range(n))


def pack(reqs: Sequence[Request]) -> dict:
    """Requests as arrays: their fields, and all their tokens in one int32 array."""
    lengths = np.fromiter((len(r.tokens) for r in reqs), np.int64, len(reqs))
    tokens = np.fromiter(chain.from_iterable(r.tokens for r in reqs), np.int32, int(lengths.sum()))
    return {"item": np.array([r.item for r in reqs], np.int64), "option": np.array([r.option for r in reqs], np.int64),
            "n_cont": np.array([r.n_cont for r in reqs], np.int64), "cut": np.array([r.cut for r in reqs], bool),
            "lengths": lengths, "tokens": tokens}


def unpack(a: dict) -> List[Request]:
    """The Requests pack() made arrays of."""
    with gc_paused():
        ends = np.cumsum(a["lengths"]).tolist()
        tokens = a["tokens"].tolist()
        starts = [0] + ends[:-1]
        return [Request(i, o, tokens[s:e], k, c) for i, o, k, c, s, e in
                zip(a["item"].tolist(), a["option"].tolist(), a["n_cont"].tolist(), a["cut"].tolist(), starts, ends)]


def _init(threads: int) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the tokenizer's thread pool starts


def _work(tok_path: str, name: str, fewshot: int, data_dir: str, window: int, limit: int):
    from ..data.tokenizer import load_tokenizer
    tok = _TOKENIZERS.get(tok_path)
    if tok is None:
        tok = _TOKENIZERS[tok_path] = load_tokenizer(tok_path)
    items, reqs = build(tok, name, fewshot, data_dir, window, limit)
    return items, pack(reqs)


@contextmanager
def _main_script_hidden():
    """__main__'s file hidden from multiprocessing while workers start: a worker re-runs the
    parent's script (as __mp_main__) when the parent was started from a file, and a script that
    calls run_tasks without an `if __name__ == "__main__"` guard would run again in every worker.
    The workers need nothing of it (they run this module's _work)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) if getattr(main, "__spec__", None) is None else None
    if path is not None:
        del main.__file__
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


class Prepared:
    """The tasks' Requests, built ahead in worker processes (see the module's docstring)."""

    def __init__(self, tok, entries: Sequence[Tuple[str, int]], data_dir, window: int, limit: int = 0,
                 workers: int = -1):
        self.tok, self.entries, self.data_dir, self.window, self.limit = tok, dict(entries), data_dir, window, limit
        cpus = os.cpu_count() or 1
        if workers < 0:
            workers = min(len(entries), cpus - 1)
        path = getattr(tok, "path", None)
        self.pool, self.futures = None, {}
        self.built_here: List[str] = []  # tasks get() built in this process
        if workers >= 1 and len(entries) > 1 and path is not None and not from_hub(data_dir):
            import multiprocessing as mp
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload([__name__])
            self.pool = ProcessPoolExecutor(workers, ctx, initializer=_init,
                                            initargs=(max(1, cpus // workers),))
            with _main_script_hidden():  # the workers start at the first submit
                self.futures = {name: self.pool.submit(_work, str(path), name, k, str(data_dir), window, limit)
                                for name, k in entries}

    def get(self, name: str) -> Tuple[List[dict], List[Request]]:
        """(items, Requests) of a task: its worker's, or built here."""
        f = self.futures.pop(name, None)
        if f is not None:
            try:
                items, packed = f.result()
                return items, unpack(packed)
            except BrokenProcessPool:  # a worker could not start or died: built here instead
                pass
        self.built_here.append(name)
        return build(self.tok, name, self.entries[name], self.data_dir, self.window, self.limit)

    def close(self) -> None:
        if self.pool is not None:
            for f in self.futures.values():
                f.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
