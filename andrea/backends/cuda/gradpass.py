"""The parameter-gradient pass of one backend, and the column sums its launchers share.

A backward pass (model.backward opens `param_grad_pass`) is where the parameter gradients are
made. Inside it the final column sums of the bias and layer-norm weight gradients wait, each set
of partials in its own slice of the reserved buffer, and run as one launch when the outermost
pass closes (colsum.py); the same bits as when each runs at once. The pass may also start a
gradient buffer: its old contents then count as zero, so the first contribution to each part of
it is written, not added (products with beta 0, column sums that do not read the gradient, the
embedding's gradients zeroed first), and what no kernel wrote is zeroed when the pass closes. So
the optimizer need not zero the gradients after each step.

The launchers (ops/) ask here where a kernel writes its column partials (`partials`), add them
into a gradient (`final`), or take the two-pass column sums of an array (`add`), and whether their
first write into a gradient is a write rather than an add (`first_write`).
"""
from __future__ import annotations

import contextlib

import numpy as np

from .colsum import DEFERRED
from .geometry import colsum_chunks
from .runtime import cp, i32, i64


class GradPass:
    """The open pass's state: the gradient buffer it starts (or None), the address ranges its
    kernels wrote so far, and the deferred column sums (colsum.DeferredColsums)."""

    def __init__(self, rt, workspace, colsums):
        self.rt, self.workspace, self.colsums = rt, workspace, colsums
        self.start = None  # the gradient buffer an open pass starts (open(start=...)), or None
        self.written: list = []

    @contextlib.contextmanager
    def open(self, start=None):
        """The pass (nests: only the outermost one starts a buffer and flushes the sums). Closing
        with an exception drops the waiting sums."""
        buf = self.workspace.reserved(DEFERRED, np.float32)
        outer = self.colsums.depth == 0
        if outer:
            self.start, self.written = start, []
        self.colsums.open(buf)
        try:
            yield
        except BaseException:
            self.colsums.close(flush=False)
            if outer:
                self.start = None
            raise
        self.colsums.close()
        if outer:
            self.zero_unwritten()

    def first_write(self, out) -> bool:
        """True if out (a parameter gradient) lies in the buffer the open pass starts and no kernel
        of the pass has written it yet: its first contribution is then written, not added. Marks
        it written either way."""
        st = self.start
        if st is None:
            return False
        lo, hi = out.data.ptr, out.data.ptr + out.nbytes
        if not (st.data.ptr <= lo and hi <= st.data.ptr + st.nbytes):
            return False
        if any(a < hi and lo < b for a, b in self.written):
            if not any(a <= lo and hi <= b for a, b in self.written):
                raise RuntimeError("param_grad_pass: a gradient written in part by an earlier kernel of the pass")
            return False
        self.written.append((lo, hi))
        return True

    def zero_unwritten(self) -> None:
        """The end of a pass that started a gradient buffer: zero whatever no kernel wrote (e.g. a
        parameter the model did not use, the padding ZeRO-1 adds to the flat buffer)."""
        st, written = self.start, sorted(self.written)
        self.start, self.written = None, []
        if st is None:
            return
        stream = cp.cuda.get_current_stream().ptr
        pos, end = st.data.ptr, st.data.ptr + st.nbytes
        for a, b in written + [(end, end)]:
            if a > pos:
                cp.cuda.runtime.memsetAsync(pos, 0, a - pos, stream)
            pos = max(pos, b)

    # ------------------------------------------------------------ column sums
    def partials(self, slot: str, chunks: int, Cc: int):
        """Where a kernel writes chunks x Cc float32 column partials: the next slice of the
        deferred buffer inside a pass (while it has room), else workspace slot."""
        part = self.colsums.take(chunks * Cc)
        return part if part is not None else self.workspace.get(slot, chunks * Cc, np.float32)

    def final(self, out, part, chunks: int, Cc: int):
        """out (Cc,) float32 += the in-order sum of part's chunks (k_colsum_final; written instead
        where the pass starts out: first_write): now, or at the end of the pass where part is a
        slice of the deferred buffer."""
        self.colsums.finish(out, part, chunks, Cc, self.first_write(out))

    def add(self, out, x, N: int, Cc: int, slot="colsum_a"):
        """out (Cc,) float32 += column sums of x (N, Cc), in two fixed-order passes."""
        rpc, chunks = colsum_chunks(N)
        part = self.partials(slot, chunks, Cc)
        vec = 16 // x.dtype.itemsize  # k_colsum_partial_vec: a 16-byte vector of columns a thread, same bits
        kernel, cols = ("k_colsum_partial_vec", 32 * vec) if Cc % vec == 0 and x.data.ptr % 16 == 0 \
            else ("k_colsum_partial", 32)
        self.rt.launch("linear.cu", kernel, x.dtype, (-(-Cc // cols), chunks), (32, 8),
                       (part, x, i64(N), i32(Cc), i32(rpc)))
        self.final(out, part, chunks, Cc)
