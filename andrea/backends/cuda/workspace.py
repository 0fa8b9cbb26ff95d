"""The kernels' scratch memory beyond their arguments, as an object the engine holds.

Attention scores or statistics, head-major copies, column-sum partials and sort keys live in
named buffers, allocated by `reserve` at start-up for one model shape (or, for shapes nobody
reserved, on first use) and then reused. `generation` counts (re)allocations: a CUDA graph holds
the addresses it was captured with, so the graph runner re-captures after the workspace moved.
"""
from __future__ import annotations

import numpy as np

from .runtime import cp


class Workspace:
    """Named scratch buffers of one backend object, grown on demand, then reused."""

    def __init__(self):
        self.bufs: dict = {}
        self.outside: dict = {}  # name -> bytes of scratch held elsewhere (the cuBLAS workspace)
        self.generation = 0

    def get(self, name: str, n: int, dtype):
        """The first n elements of buffer `name` (dtype), growing it if it is smaller."""
        dt = np.dtype(dtype)
        buf = self.bufs.get((name, dt.name))
        if buf is None or buf.size < n:
            self.bufs.pop((name, dt.name), None)
            buf = self.bufs[(name, dt.name)] = cp.empty(max(int(n), 1), dtype=dt)
            self.generation += 1
        return buf[:n]

    def reserved(self, name: str, dtype):
        """Buffer `name` (dtype) as reserved, or None where nothing reserved it (never grown)."""
        return self.bufs.get((name, np.dtype(dtype).name))

    def reserve(self, rows):
        """Allocate every (name, shape, dtype) row now; rows named in `outside` are counted only."""
        for name, shape, dtype in rows:
            if name in self.outside:
                continue
            self.get(name, int(np.prod(shape)), dtype)

    def nbytes(self) -> int:
        """Bytes held: the buffers here and the scratch held elsewhere for the same kernels."""
        return sum(b.nbytes for b in self.bufs.values()) + sum(self.outside.values())
