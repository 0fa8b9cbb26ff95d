"""Transposed copies W^T of weights, read by the input-gradient products that run faster that way.

The input gradient of a linear layer, dX (N, IC) = dY (N, OC) @ W (OC, IC), is cuBLAS's "NN" form in
our row-major convention; with a copy W^T (IC, OC) the same product is dY @ (W^T)^T, the layout of
the forward product X @ W^T. On an H200 at ANDREA-120M's shapes the second is faster for the MLP's
weights (down: 0.0747 -> 0.0593 ms, up: 0.0566 -> 0.0532) and the classifier's (the tied
embedding, a chunk of 4,096 rows: 0.494 -> 0.413), no faster or slower for the attention's and at
ANDREA-12M's narrower shapes (dev/cuda/gemm_shapes.py, docs/BENCHMARKS.md). So copies are kept for
weights of at least TRANSPOSED_MIN elements whose sides are both at least TRANSPOSED_MIN_SIDE
(CudaOps.transposed_min; 0: none).

The engine plans the copies in its arena (transposed_rows), hands them over once
(TransposedWeights.use) and has them rewritten whenever the weights change, as it does the FP8
weight cache: after each optimizer update inside the optimizer's CUDA graph, and after a load. One
launch of k_transpose_many (kernels/transpose.cu) rewrites all of them. The products that read a
copy give other bits than those reading W (another cuBLAS kernel), the same bits on every run.
"""
from __future__ import annotations

import numpy as np

from .runtime import THREADS, check, cp

TRANSPOSED_MIN = 1 << 21  # elements of a weight whose input-gradient product reads W^T
TRANSPOSED_MIN_SIDE = 768  # ... if both its sides are at least this long
ALIGN_ELEMENTS = 128  # each copy starts 256-byte aligned (16-bit), as cuBLAS's fast paths like
TABLE_COLS = 4  # int64 per matrix of k_transpose_many: address of W, of W^T, R, K
TILE = 64  # k_transpose_many's tile (TR_TILE)
MAX_BLOCKS = 2048  # blocks per matrix of one launch; a matrix with fewer tiles leaves the rest idle


def wants(shape, min_elements: int, min_side: int = TRANSPOSED_MIN_SIDE) -> bool:
    """Whether a weight of this (R, K) shape gets a transposed copy under those thresholds."""
    R, K = (int(s) for s in shape)
    return 0 < min_elements <= R * K and min(R, K) >= min_side


def _aligned(n: int) -> int:
    return -(-n // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def transposed_rows(shapes, dtype):
    """The arena rows of the copies of weights of these (R, K) shapes: the copies in one row of
    dtype, the compute dtype (each ALIGN_ELEMENTS-aligned), and the launch's table. Pure arithmetic: the memory
    plan calls it without a GPU."""
    n = sum(_aligned(int(R) * int(K)) for R, K in shapes)
    return [("wt_data", (n,), dtype), ("wt_table", (len(shapes), TABLE_COLS), "int64")]


def _grid(shapes):
    """(blocks per matrix, matrices) of a k_transpose_many launch over matrices of these shapes."""
    tiles = max(-(-int(R) // TILE) * -(-int(K) // TILE) for R, K in shapes)
    return (max(1, min(MAX_BLOCKS, -(-tiles // 4))), len(shapes))


def _table_rows(what, pairs, dtype):
    """The table rows of a launch over (x (R, K), out (K, R)) pairs, every array checked."""
    rows = []
    for i, (x, out) in enumerate(pairs):
        check(what, f"x[{i}]", x, dtype=dtype)
        if x.ndim != 2:
            raise ValueError(f"{what}: x[{i}] has shape {x.shape}; expected (R, K)")
        check(what, f"out[{i}]", out, x.shape[::-1], dtype)
        rows.append([x.data.ptr, out.data.ptr, *x.shape])
    return np.array(rows, dtype=np.int64).reshape(-1, TABLE_COLS)


def k_transpose_many(rt, pairs, dtype, table=None):
    """out = x^T for every (x (R, K), out (K, R)) of pairs, in one launch; the table is written
    now (a synchronous copy: outside any graph), into table where given, and returned."""
    host = _table_rows("k_transpose_many", pairs, dtype)
    if table is None:
        table = cp.empty(host.shape, dtype=np.int64)
    check("k_transpose_many", "table", table, host.shape, np.int64)
    table.set(host)
    rt.launch("transpose.cu", "k_transpose_many", dtype, _grid(host[:, 2:]), THREADS, (table,))
    return table


class TransposedWeights:
    """The copies one engine keeps: {weight: W^T view}, and the launch that rewrites them."""

    def __init__(self, rt):
        self.rt = rt
        self.copies: dict = {}
        self._launch = None  # (table, dtype, grid) once use() ran

    def use(self, weights, data, table):
        """Keep W^T of every weight (R, K) in data (the compute dtype, transposed_rows' layout),
        the launch's table in table; fill them now."""
        if not weights:
            raise ValueError("use_transposed_weights: no weights")
        dtype = weights[0].dtype
        shapes = [tuple(w.shape) for w in weights]
        if any(len(s) != 2 for s in shapes):
            raise ValueError(f"use_transposed_weights: shapes {shapes}; expected (R, K) matrices")
        need = {name: shape for name, shape, _ in transposed_rows(shapes, dtype)}
        check("use_transposed_weights", "data", data, need["wt_data"], dtype)
        if data.data.ptr % 256:
            raise ValueError(f"use_transposed_weights: data at {data.data.ptr:#x}; expected 256-byte alignment")
        views, off = [], 0
        for R, K in shapes:
            views.append(data[off:off + R * K].reshape(K, R))
            off += _aligned(R * K)
        k_transpose_many(self.rt, list(zip(weights, views)), dtype, table)
        self.copies = {(w.data.ptr, tuple(w.shape), dtype.name): v for w, v in zip(weights, views)}
        self._launch = (table, dtype, _grid(shapes))

    def refresh(self):
        """Rewrite every copy from its weight: one k_transpose_many; nothing before use()."""
        if self._launch is not None:
            table, dtype, grid = self._launch
            self.rt.launch("transpose.cu", "k_transpose_many", dtype, grid, THREADS, (table,))

    def get(self, w):
        """W^T (K, R) of a weight whose copy is kept (the view the engine handed over), or None."""
        return self.copies.get((w.data.ptr, tuple(w.shape), w.dtype.name)) if self.copies else None
