"""CUDA graphs of whole passes: capturing a function of backend kernels, and replaying it.

`capture` records fn() on a stream into a graph; `GraphRunner` (one per engine) keeps the graphs
of the passes it was asked to run, by key.
"""
from __future__ import annotations

import contextlib
import warnings

from .runtime import cp


def capture(fn, stream, blas):
    """fn() (backend kernels only: no host syncs, no allocation) recorded on stream as a CUDA
    graph, not run. The cuBLAS handle is bound to the stream first: handle set-up is not allowed
    inside a capture."""
    with stream:
        blas.bind_stream()
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph


def event_ms(fn, reps: int, warmup: int = 1, stream=None) -> float:
    """Device milliseconds per call of fn (which queues work on the current stream, or on stream):
    warmup calls, then reps calls between two CUDA events. The timing of the benchmarks and the
    dev scripts."""
    with stream if stream is not None else contextlib.nullcontext():
        for _ in range(warmup):
            fn()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / reps


def replay_ms(graph, stream, reps: int) -> float:
    """Device milliseconds per replay of a captured graph on stream: one launch to warm up, then
    reps launches between two CUDA events (no Python launch overhead in the figure)."""
    return event_ms(lambda: graph.launch(stream=stream), reps, stream=stream)


def edited(be, graph):
    """A pass's captured graph with graph_edit.py's edit (cuBLAS(Lt)'s counter memsets replaced by a
    kernel node), or graph itself where the backend's graph_edits is off or there is nothing to edit."""
    if not getattr(be, "graph_edits", False):
        return graph
    from .graph_edit import EditedGraph, store_function
    spaces = [(w.data.ptr, w.data.ptr + w.nbytes) for w in
              [be.blas.workspace] + ([be.lt.workspace] if be.lt is not None else [])]
    try:
        e = EditedGraph(graph, store_function(), spaces)
    except RuntimeError as err:  # a graph the driver will not clone or edit: run it as captured
        warnings.warn(f"graph_edits: the captured graph is run unedited ({err})", RuntimeWarning, stacklevel=2)
        return graph
    if not e.replaced:
        return graph
    be.graph_memsets_replaced += e.replaced
    return e


class GraphRunner:
    """Runs a function of backend kernels as a CUDA graph: the first call with a key runs it
    eagerly (compiles modules, allocates the workspace, creates the cuBLAS handle), the second
    captures it on a private stream and launches the graph, later calls only launch it. The graph
    runs on the caller's current stream, so uploads queued there before it are seen.
    A key must stand for everything the function bakes in (array addresses, host scalars); the
    workspace's addresses are tracked here: when it grows, graphs made before run eagerly again."""

    MAX_GRAPHS = 8  # e.g. one per loss scale seen; older ones are dropped

    def __init__(self, backend):
        self.be = backend
        self.graphs: dict = {}  # key -> (graph, workspace generation)
        self.seen: dict = {}  # key -> workspace generation of its eager run
        self.stream = None

    def run(self, key, fn):
        ws = self.be.workspace
        gen = ws.generation
        entry = self.graphs.get(key)
        if entry is not None and entry[1] == gen:
            entry[0].launch(stream=cp.cuda.get_current_stream())
            return
        if self.seen.get(key) != gen:  # new key, or the workspace moved: eager run first
            fn()
            self.seen[key] = ws.generation
            return
        if self.stream is None:
            self.stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.get_current_stream().synchronize()
        g = capture(fn, self.stream, self.be.blas)
        g = edited(self.be, g)
        if len(self.graphs) >= self.MAX_GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        self.graphs[key] = (g, gen)
        g.launch(stream=cp.cuda.get_current_stream())

    def clear(self):
        """Drop every graph (the next run of a key starts again with an eager run)."""
        self.graphs.clear()
        self.seen.clear()

    def __len__(self):
        return len(self.graphs)
