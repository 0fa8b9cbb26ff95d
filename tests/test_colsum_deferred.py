"""The bookkeeping of the deferred column sums (andrea/backends/cuda/colsum.py) on the CPU, with
stand-in device arrays and a launcher that records: what waits, what runs at once, when the waiting
sums are flushed, and the table k_colsum_final_many reads. The kernels themselves are checked on
the GPU (tests/test_cuda_kernels.py, test_param_grad_pass_*)."""
from types import SimpleNamespace

import numpy as np
import pytest

from andrea.backends.cuda import colsum


class Arr:
    """A float32 device array as the bookkeeping sees it: an address, a size, slices."""

    def __init__(self, ptr, size):
        self.data, self.size, self.nbytes = SimpleNamespace(ptr=ptr), size, 4 * size

    def __getitem__(self, s):
        return Arr(self.data.ptr + 4 * s.start, s.stop - s.start)


class Launcher:
    def __init__(self):
        self.calls = []

    def launch(self, fname, kernel, dtype, grid, block, args, **kw):
        self.calls.append((kernel, grid, args))


@pytest.fixture
def q(monkeypatch):
    capturing = {"on": False}
    stream = SimpleNamespace(is_capturing=lambda: capturing["on"])
    fake_cp = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: stream), asarray=lambda a: a.copy())
    monkeypatch.setattr(colsum, "cp", fake_cp)
    d = colsum.DeferredColsums(Launcher())
    d.capturing = capturing
    return d


def kernels(q):
    return [c[0] for c in q.rt.calls]


def test_outside_a_pass_each_sum_runs_at_once(q):
    assert q.take(10) is None
    q.finish(Arr(1 << 20, 8), Arr(1 << 30, 40), 5, 8)
    assert kernels(q) == ["k_colsum_final"]
    assert q.rt.calls[0][1] == 1  # 8 columns: one block of 8 warps


def test_a_pass_waits_and_flushes_once_in_order(q):
    buf = Arr(1 << 30, 10_000)
    q.open(buf)
    outs = [Arr((1 << 20) + 4096 * i, c) for i, c in enumerate((300, 17, 513))]
    parts = [q.take(n * o.size) for n, o in zip((5, 2, 7), outs)]
    assert [p.data.ptr % 128 for p in parts] == [0, 0, 0]  # each set on a 128-byte boundary
    for o, p, n in zip(outs, parts, (5, 2, 7)):
        q.finish(o, p, n, o.size)
    assert kernels(q) == []
    q.close()
    assert kernels(q) == ["k_colsum_final_many"]
    _, grid, (table, n_segs) = q.rt.calls[0]
    assert n_segs == 3 and grid == 2 + 1 + 3  # ceil(C / 256): a thread per column
    assert table[:, 0].tolist() == [o.data.ptr for o in outs]
    assert table[:, 1].tolist() == [p.data.ptr for p in parts]
    assert (table[:, 2] & 0xFFFFFFFF).tolist() == [5, 2, 7] and (table[:, 2] >> 32).tolist() == [300, 17, 513]
    assert table[:, 3].tolist() == [0, 2, 3]  # first blocks
    assert q.buf is None and q.waiting == [] and q.depth == 0


def test_a_second_sum_into_a_waiting_gradient_flushes_first(q):
    q.open(Arr(1 << 30, 10_000))
    g, other = Arr(1 << 20, 16), Arr(1 << 21, 16)
    q.finish(g, q.take(32), 2, 16)
    q.finish(other, q.take(32), 2, 16)
    q.finish(g[4:12], q.take(16), 2, 8)  # overlaps g: the two waiting sums go first
    assert kernels(q) == ["k_colsum_final_many"] and q.rt.calls[0][2][1] == 2
    q.close()
    assert kernels(q) == ["k_colsum_final_many"] * 2 and q.rt.calls[1][2][1] == 1


def test_no_room_runs_at_once_and_a_failed_pass_drops(q):
    q.open(Arr(1 << 30, 100))
    assert q.take(101) is None
    p = q.take(64)
    assert p is not None and q.take(40) is None  # 64 floats used (two 32-float units), 36 left
    q.finish(Arr(1 << 20, 8), Arr(1 << 31, 64), 8, 8)  # not from the buffer: runs now
    assert kernels(q) == ["k_colsum_final"]
    q.finish(Arr(1 << 21, 8), p, 8, 8)
    q.close(flush=False)
    assert kernels(q) == ["k_colsum_final"] and q.waiting == [] and q.buf is None


def test_nested_passes_flush_at_the_outermost(q):
    q.open(Arr(1 << 30, 1000))
    q.open(None)  # an inner pass keeps the outer one's buffer
    q.finish(Arr(1 << 20, 8), q.take(16), 2, 8)
    q.close()
    assert kernels(q) == []
    q.close()
    assert kernels(q) == ["k_colsum_final_many"]


def test_a_table_first_seen_in_a_capture_launches_each_sum(q):
    out, buf = Arr(1 << 20, 8), Arr(1 << 30, 1000)
    q.capturing["on"] = True
    q.open(buf)
    q.finish(out, q.take(16), 2, 8)
    q.finish(Arr(1 << 21, 8), q.take(16), 2, 8)
    q.close()
    assert kernels(q) == ["k_colsum_final", "k_colsum_final"] and q.tables == {}
    q.capturing["on"] = False
    for capturing in (False, True):  # uploaded outside the capture, then reused inside one
        q.capturing["on"] = capturing
        q.open(buf)
        q.finish(out, q.take(16), 2, 8)
        q.finish(Arr(1 << 21, 8), q.take(16), 2, 8)
        q.close()
    assert kernels(q)[2:] == ["k_colsum_final_many"] * 2 and len(q.tables) == 1


def test_deferred_floats_holds_a_backward_pass():
    """The bound against the sets one layer's calls take at the largest chunk counts."""
    C, R, K = 768, 264, 64
    pad = lambda n: -(-n // colsum.ALIGN) * colsum.ALIGN  # noqa: E731
    layer = [R * C] * 4 + [K * 4 * C, K * C, K * C, K * 3 * C]
    need = 12 * sum(pad(n) for n in layer) + 2 * pad(R * C)
    assert colsum.deferred_floats(12, C, R, K) == need
    assert colsum.deferred_floats(0, C, R, K) == 0
