"""The last step of the bias and layer-norm weight gradients: now, or deferred to the end of a pass.

Each of those gradients is the column sum of a (rows, C) array, in two fixed-order passes: a
kernel writes column partials (n_chunks, C) float32, then k_colsum_final (linear.cu) adds the
chunks in order into the float32 gradient. Outside a parameter-gradient pass
(CudaBackend.param_grad_pass, gradpass.py) the partials go to the workspace slots colsum_a / colsum_b, which the
next call reuses, so each final sum runs at once. Inside one, each set of partials gets its own
slice of the workspace buffer DEFERRED (reserved at start-up for the model's layers,
`deferred_floats`) and the final sums wait for the end of the pass, where k_colsum_final_many does
all of them in one launch, each column by one thread in k_colsum_final's order (the same sums and
the same shuffle tree, done in registers; a GPU test checks the bits): the same bits, one launch
instead of about eight per layer. A set that does not fit in what is left of the buffer runs at
once, in the workspace slot, as outside a pass; a second sum into a gradient that still waits for
one flushes the waiting ones first, so the order of the additions into each gradient is always
that of the calls. A sum may write its gradient instead of adding into it (`write`: the first
contribution in a pass that starts the gradients, param_grad_pass(start=...)).

The launch reads a table of segments (gradient, partials, chunks, columns, first block) in device
memory. Each distinct table is uploaded once, outside graph capture, and kept for the life of the
backend (a captured graph holds its address); a pass captured before its table was ever seen
eagerly launches one k_colsum_final per segment instead (the same bits).
"""
from __future__ import annotations

import numpy as np

from .runtime import THREADS, cp, i32

DEFERRED = "colsum_deferred"  # the workspace buffer of the deferred partials
ALIGN = 32  # floats: each set of partials starts on a 128-byte boundary
COLS_PER_BLOCK = THREADS // 32  # columns a block of k_colsum_final sums: one warp each


def deferred_floats(n_layer: int, C: int, partial_rows: int, colsum_chunks: int) -> int:
    """Float32 elements of the deferred buffer for a model of n_layer layers of width C: every
    set of partials of one backward pass at the most rows its kernels write (partial_rows for a
    layer norm's two, colsum_chunks for a bias's), each rounded up to ALIGN. Per layer: two layer
    norms (two sets of C each), the MLP's biases (4C and C), the attention's (3C and C); then the
    final layer norm. 0 without layers: nothing is deferred."""
    if n_layer <= 0:
        return 0
    pad = lambda n: -(-n // ALIGN) * ALIGN  # noqa: E731
    ln = 2 * pad(partial_rows * C)
    layer = 2 * ln + sum(pad(colsum_chunks * k * C) for k in (4, 1, 1, 3))
    return n_layer * layer + ln


class DeferredColsums:
    """The state of one backend's parameter-gradient passes: the reserved buffer, how much of it
    the open pass has handed out, the sums waiting, and the device copies of the tables."""

    def __init__(self, rt):
        self.rt = rt
        self.depth = 0  # nested passes: only the outermost one flushes
        self.buf = None  # the reserved buffer while a pass is open and deferral is on
        self.used = 0
        self.waiting = []  # (out, partials, n_chunks, C) in call order
        self.tables: dict = {}  # table bytes -> its device copy (kept: graphs hold the address)

    # ------------------------------------------------------------ the pass
    def open(self, buf) -> None:
        """Start a pass (or a nested one); buf: the reserved buffer, or None to defer nothing."""
        if self.depth == 0:
            self.buf, self.used, self.waiting = buf, 0, []
        self.depth += 1

    def close(self, flush: bool = True) -> None:
        """End a pass: the outermost one adds every waiting sum (flush=False drops them: the pass
        failed, its gradients are incomplete anyway)."""
        self.depth -= 1
        if self.depth == 0:
            if flush:
                self.flush()
            self.buf, self.used, self.waiting = None, 0, []

    # ------------------------------------------------------------ one column sum
    def take(self, n: int):
        """The next n floats of the reserved buffer for a set of partials, or None (no pass open,
        deferral off, or no room left: the caller uses its workspace slot and the sum runs now)."""
        if self.buf is None or self.used + n > self.buf.size:
            return None
        part = self.buf[self.used:self.used + n]
        self.used += -(-n // ALIGN) * ALIGN
        return part

    def finish(self, out, part, n_chunks: int, C: int, write: bool = False) -> None:
        """out (C,) float32 += the in-order sum of part's n_chunks rows (write: out = the sum, out
        not read): at the end of the pass where part came from take(), else now."""
        lo, hi = out.data.ptr, out.data.ptr + out.nbytes
        if any(o.data.ptr < hi and lo < o.data.ptr + o.nbytes for o, *_ in self.waiting):
            self.flush()  # a second sum into a waiting gradient: the first goes first
        if self._deferred(part):
            self.waiting.append((out, part, n_chunks, C, write))
        else:
            self._final(out, part, n_chunks, C, write)

    def _deferred(self, part) -> bool:
        b = self.buf
        return b is not None and b.data.ptr <= part.data.ptr < b.data.ptr + b.nbytes

    def _final(self, out, part, n_chunks, C, write=False):
        self.rt.launch("linear.cu", "k_colsum_final", np.float32, -(-C // COLS_PER_BLOCK), THREADS,
                       (out, part, i32(n_chunks), i32(C), i32(int(write))))

    # ------------------------------------------------------------ the end of the pass
    def table(self):
        """The waiting sums as k_colsum_final_many's segments (int64 rows: gradient address,
        partials address, n_chunks | C << 32, first block | write << 32), and the launch's block
        count."""
        rows, blocks = [], 0
        for out, part, n_chunks, C, write in self.waiting:
            rows.append((out.data.ptr, part.data.ptr, n_chunks | (C << 32), blocks | (int(write) << 32)))
            blocks += -(-C // THREADS)  # k_colsum_final_many: a thread per column
        return np.array(rows, dtype=np.int64).reshape(-1, 4), blocks

    def flush(self) -> None:
        """Add every waiting sum now: one k_colsum_final_many launch."""
        if not self.waiting:
            return
        table, blocks = self.table()
        key = table.tobytes()
        segs = self.tables.get(key)
        if segs is None and not cp.cuda.get_current_stream().is_capturing():
            segs = self.tables[key] = cp.asarray(table)
        if segs is None:  # first seen inside a capture: no upload there, one launch per sum
            for out, part, n_chunks, C, write in self.waiting:
                self._final(out, part, n_chunks, C, write)
        else:
            self.rt.launch("linear.cu", "k_colsum_final_many", np.float32, blocks, THREADS,
                           (segs, i32(len(table))))
        self.waiting = []
