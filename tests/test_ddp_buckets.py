"""The gradient sum over the ranks in buckets issued during the backward pass (andrea/core/buckets.py,
docs/DISTRIBUTED.md): the plan, the moment each bucket is issued, and, over real MPI ranks
(mpirun, NumPy engine), the same bits as the one sum after the backward pass, with and without
ZeRO-1, with more microbatches than ranks.
"""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from andrea.config import load_run_config
from andrea.core import model
from andrea.core.buckets import (BUCKET_ENV, DEFAULT_BUCKET_MB, Bucket, bucket_bytes_requested, make_buckets,
                                 plan_buckets)
from andrea.core.comm import shard_bounds
from andrea.core.engine import Engine
from conftest import small_config

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import global_batches  # noqa: E402


def layout_of(tmp_path, **m):
    d = small_config(tmp_path)
    d["model"].update(m)
    cfg = load_run_config(d)
    return cfg, model.ParamLayout.from_config(cfg.model)


# ------------------------------------------------------------------ the plan

@pytest.mark.parametrize("n_layer, cap, pad", [(3, 1, 0), (3, 10**9, 2), (5, 30000, 1), (1, 1, 0)])
def test_plan_covers_the_buffer_once_in_backward_order(tmp_path, n_layer, cap, pad):
    """The buckets tile [0, total) exactly (ZeRO-1's padding included), are issued from the last
    layer to the first and then at the end of the pass, and each bucket but the one that reaches
    layer 0 holds at least the cap's bytes, of whole layers' matrices."""
    _, lay = layout_of(tmp_path, n_layer=n_layer)
    total = lay.n_params + pad
    plan = plan_buckets(lay, n_layer, total, cap)
    seen = np.zeros(total, np.int32)
    for b in plan:
        for lo, hi in b.ranges:
            seen[lo:hi] += 1
    assert (seen == 1).all(), "a gradient summed twice or never"
    afters = [b.after for b in plan]
    assert afters[-1] is None and afters[:-1] == sorted(afters[:-1], reverse=True)
    assert afters[-2] == 0
    off = {name: o for name, o, _ in lay.entries}
    for b in plan[:-1]:
        (lo, hi), = b.ranges
        assert lo == off[f"h{b.after}.qkv_w"], "a bucket starts at its first layer's matrices"
        if b.after:
            assert (hi - lo) * 4 >= cap
    vectors = plan[-1].ranges[-1]
    assert vectors == (lay.n_decay, total)
    if cap == 1:  # a layer a bucket
        assert afters == list(reversed(range(n_layer))) + [None]
    if cap == 10**9:  # every layer in one bucket, issued after layer 0
        assert afters == [0, None]


def test_no_buckets_with_a_cap_of_zero_or_one_rank(tmp_path):
    _, lay = layout_of(tmp_path)
    assert plan_buckets(lay, 2, lay.n_params, 0) == []

    class Two:
        size, rank = 2, 0
    grads = np.zeros(lay.n_params, np.float32)
    assert make_buckets(Two(), grads, lay, 2, False, 0) is None
    assert make_buckets(Two(), grads, lay, 2, False, 1).plan[0] == Bucket(1, ((lay.entries[2 + 4][1], lay.n_decay),))

    class One:
        size, rank = 1, 0
    assert make_buckets(One(), grads, lay, 2, False, 1) is None


def test_bucket_size_is_read_from_the_environment():
    assert bucket_bytes_requested({}) == int(DEFAULT_BUCKET_MB * 2**20) == 25 * 2**20
    assert bucket_bytes_requested({BUCKET_ENV: "0"}) == 0
    assert bucket_bytes_requested({BUCKET_ENV: " 0.5 "}) == 2**19
    for bad in ("-1", "lots", "nan", "inf"):
        with pytest.raises(ValueError, match=f"{BUCKET_ENV}='{bad}'"):
            bucket_bytes_requested({BUCKET_ENV: bad})


# ------------------------------------------------------------------ when each bucket is issued

class Recorder:
    """A comm of 2 ranks that sums nothing (every collective leaves its arrays as they are) and
    records, for each sum over a range of the gradient buffer, the range and its values then."""

    size, rank = 2, 0

    def __init__(self):
        self.calls, self.grads = [], None

    def prepare(self, grads):
        self.grads = grads

    def on_close(self, fn):
        pass

    def _log(self, lo, hi):
        self.calls.append((lo, hi, self.grads[lo:hi].copy()))

    def allreduce_sum(self, *arrays):
        for a in arrays:
            if np.shares_memory(a, self.grads):
                lo = (a.__array_interface__["data"][0] - self.grads.__array_interface__["data"][0]) // a.itemsize
                self._log(lo, lo + a.size)

    def reduce_scatter_sum(self, a, lo=0, hi=None):
        self._log(lo, a.size if hi is None else hi)

    def allgather(self, a):
        pass

    def describe(self):
        return "rank 0 of 2 (recorded)"


@pytest.mark.parametrize("zero1", [False, True])
def test_each_bucket_is_issued_once_its_gradients_are_final(tmp_path, zero1):
    """A step of 3 microbatches: the sums are issued in the plan's order during the last one's
    backward pass only, and the values of every bucket when it is issued are the step's final
    gradients (nothing adds into a bucket after its sum starts). Unbucketed: one sum of the
    whole buffer after the last pass."""
    d = small_config(tmp_path, grad_accum=3)
    d["model"]["n_layer"] = 3
    cfg = load_run_config(d)
    rec = Recorder()
    eng = Engine(cfg, comm=rec, zero1=zero1, bucket_bytes=1)
    plan = eng.buckets.plan
    assert [b.after for b in plan] == [2, 1, 0, None]
    for step in (1, 2):
        rec.calls.clear()
        eng.train_step(step, global_batches(cfg, step))
        assert [(lo, hi) for lo, hi, _ in rec.calls] == [r for b in plan for r in b.ranges]
        for lo, hi, then in rec.calls:
            assert np.array_equal(then, eng.grads[lo:hi]), f"[{lo}, {hi}) changed after its sum was issued"
    plain = Recorder()
    eng = Engine(cfg, comm=plain, zero1=zero1, bucket_bytes=0)
    eng.train_step(1, global_batches(cfg, 1))
    assert [(lo, hi) for lo, hi, _ in plain.calls] == [(0, eng.grads.size)]


# ------------------------------------------------------------------ the same bits over MPI ranks

def ranks_bucketed(tmp_path, n, caps):
    from test_ddp import ENV, mpirun

    d = small_config(tmp_path, grad_accum=6)
    d["model"]["n_layer"] = 3
    (tmp_path / "cfg.json").write_text(json.dumps(d))
    r = subprocess.run(mpirun(n, Path(__file__).parent / "ddp_bucket_worker.py", tmp_path / "cfg.json",
                              tmp_path / "out", "float32", 3, ",".join(map(str, caps))),
                       env={k: v for k, v in ENV.items() if k != BUCKET_ENV}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, [np.load(tmp_path / f"out.{k}.npz") for k in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_bucketed_sums_give_the_bits_of_one_sum(tmp_path, n):
    """fp32, 6 microbatches a step (3 or 2 per rank), 3 steps, 3 layers: buckets of a layer each
    (cap 1 byte), of two layers (cap 2 layers' bytes: 2 buckets of layers + the last) and the
    default (one bucket of every layer + the last) give every rank the weights, moments, losses
    and norms of the one sum after the backward pass, to the bit, without and with ZeRO-1; 3 ranks
    pad the buffers to a multiple of 3 and cut the buckets at the shards' bounds unevenly."""
    layer = 12 * 32 * 32 * 4  # one layer's matrices in bytes (d_model 32)
    d, outs = ranks_bucketed(tmp_path, n, [0, 1, 2 * layer, 25 * 2**20])
    for z in (0, 1):
        base = f"z{z}_c0"
        assert int(outs[0][f"{base}.buckets"]) == 0
        assert [int(outs[0][f"z{z}_c{c}.buckets"]) for c in (1, 2 * layer, 25 * 2**20)] == [4, 3, 2]
        for r, o in enumerate(outs):
            for cap in (1, 2 * layer, 25 * 2**20):
                for k in ("params", "m", "v", "recs"):
                    assert np.array_equal(o[f"z{z}_c{cap}.{k}"], o[f"{base}.{k}"]), (r, z, cap, k)
            assert np.array_equal(o[f"{base}.params"], outs[0][f"{base}.params"]), "the ranks differ"
    # ZeRO-1's moments of rank 0 (gathered) are the whole buffer's; the runs trained (loss moved)
    n_params = model.count_params(load_run_config(d).model)
    assert outs[0]["z1_c1.m"].size == n_params and shard_bounds(n_params, n, 0)[0] % n == 0
    recs = outs[0]["z0_c1.recs"]
    assert recs[-1, 0] != recs[0, 0]


def test_without_bucket_bytes_the_engine_reads_the_environment(tmp_path, monkeypatch):
    """Engine(bucket_bytes=None) reads BUCKET_ENV: 0 gives no buckets, a size gives its plan, unset
    the default, a bad value a ValueError naming the variable (the engine command: exit 2); the
    memory plan's data-parallel line says which."""
    import io

    cfg = load_run_config(small_config(tmp_path, grad_accum=2))
    monkeypatch.setenv(BUCKET_ENV, "0")
    eng = Engine(cfg, comm=Recorder())
    assert eng.buckets is None
    out = io.StringIO()
    eng.print_plan(file=out)
    assert "rank 0 of 2 (recorded), gradients summed after the backward pass;" in out.getvalue()
    monkeypatch.setenv(BUCKET_ENV, "0.000001")  # 1 byte: a layer a bucket
    eng = Engine(cfg, comm=Recorder())
    assert [b.after for b in eng.buckets.plan] == [1, 0, None]
    eng.print_plan(file=out)
    assert "gradients summed in 3 buckets during the backward pass;" in out.getvalue()
    monkeypatch.setenv(BUCKET_ENV, "lots")
    with pytest.raises(ValueError, match=f"{BUCKET_ENV}='lots'"):
        Engine(cfg, comm=Recorder())
    monkeypatch.delenv(BUCKET_ENV)
    assert [b.after for b in Engine(cfg, comm=Recorder()).buckets.plan] == [0, None]
    assert os.environ.get(BUCKET_ENV) is None


# ------------------------------------------------------------------ the CUDA path's calls, without a GPU

class FakeCuda:
    """The parts of cupy (cupy.cuda: streams, events; cupy.cuda.nccl: group calls) that
    GradBuckets and MpiComm's NCCL calls use, recording every call in `log` as a tuple. It checks
    the order and the arguments of the CUDA path here; the GPU tests run it for real."""

    def __init__(self):
        log, fake = [], self
        self.log, self.current = log, "compute"

        class Stream:
            count = 0

            def __init__(self, non_blocking=False):
                Stream.count += 1
                self.name, self.ptr = f"side{Stream.count}", 1000 + Stream.count

            def wait_event(self, ev):
                log.append(("wait", self.name, ev.name))

            def __enter__(self):
                self.prev, fake.current = fake.current, self.name

            def __exit__(self, *exc):
                fake.current = self.prev

        class Event:
            count = 0

            def __init__(self, disable_timing=False):
                Event.count += 1
                self.name = f"ev{Event.count}"

            def record(self, stream):
                log.append(("record", self.name, stream.name))

        class Current:
            @property
            def name(self):
                return fake.current

            def wait_event(self, ev):
                log.append(("wait", fake.current, ev.name))

            ptr = 7
        nccl = types.ModuleType("cupy.cuda.nccl")
        nccl.NCCL_FLOAT32, nccl.NCCL_FLOAT64, nccl.NCCL_FLOAT16, nccl.NCCL_SUM = 7, 8, 6, 0
        nccl.groupStart = lambda: log.append(("groupStart",))
        nccl.groupEnd = lambda: log.append(("groupEnd",))
        self.cupy = types.ModuleType("cupy")
        self.cupy.cuda = types.SimpleNamespace(Stream=Stream, Event=Event, get_current_stream=lambda: Current(),
                                               nccl=nccl)
        self.nccl = nccl


class DeviceArray:
    """A flat float32 device array as the NCCL calls see it: an address, a size; slices are views."""

    def __init__(self, size, ptr=4096):
        self.size, self.itemsize, self.dtype = size, 4, np.dtype(np.float32)
        self.data = types.SimpleNamespace(ptr=ptr)

    def __getitem__(self, s):
        return DeviceArray(s.stop - s.start, self.data.ptr + 4 * s.start)


class Communicator:
    """cupy's NcclCommunicator: records its calls (addresses as element offsets from base)."""

    def __init__(self, fake, base):
        self.fake, self.base = fake, base

    def _at(self, ptr):
        return (ptr - self.base) // 4

    def allReduce(self, send, recv, count, kind, op, stream):
        self.fake.log.append(("allReduce", self._at(send), self._at(recv), count, self.fake.current))

    def reduce(self, send, recv, count, kind, op, root, stream):
        self.fake.log.append(("reduce", self._at(send), self._at(recv), count, root, self.fake.current))

    def reduceScatter(self, send, recv, count, kind, op, stream):
        self.fake.log.append(("reduceScatter", self._at(send), self._at(recv), count, self.fake.current))


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", fake.cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", fake.nccl)
    return fake


def nccl_comm(fake, rank, size, base):
    from andrea.core.comm import MpiComm

    class World:
        def Get_rank(self):
            return rank

        def Get_size(self):
            return size
    c = MpiComm(World())
    c.nccl = Communicator(fake, base)
    return c


@pytest.mark.parametrize("zero1", [False, True])
def test_cuda_buckets_fork_onto_the_second_stream_and_join_before_the_optimizer(tmp_path, fake_cuda, zero1):
    """Each bucket: an event recorded on the compute stream when it is issued, the second stream
    waiting for it, then the bucket's NCCL calls on the second stream (all-reduce of each range in
    place; ZeRO-1: one reduce onto each owner of a part of it, grouped); at the end of the pass an
    event on the second stream that the compute stream waits for. 3 ranks, rank 1, padded buffer."""
    from andrea.core.buckets import GradBuckets

    _, lay = layout_of(tmp_path, n_layer=3)
    total = -(-lay.n_params // 3) * 3
    grads = DeviceArray(total)
    comm = nccl_comm(fake_cuda, 1, 3, grads.data.ptr)
    plan = plan_buckets(lay, 3, total, 1)
    gb = GradBuckets(comm, grads, plan, zero1)
    for l in (2, 1, 0, None):
        gb.ready(l)
    S = total // 3
    want = []
    for i, b in enumerate(plan):
        ev = f"ev{i + 1}"
        want += [("record", ev, "compute"), ("wait", "side1", ev)]
        for lo, hi in b.ranges:
            if not zero1:
                want.append(("allReduce", lo, lo, hi - lo, "side1"))
                continue
            want.append(("groupStart",))
            for q in range(3):
                a, z = max(lo, q * S), min(hi, (q + 1) * S)
                if z > a:
                    want.append(("reduce", a, a, z - a, q, "side1"))
            want.append(("groupEnd",))
    want += [("record", f"ev{len(plan) + 1}", "side1"), ("wait", "compute", f"ev{len(plan) + 1}")]
    assert fake_cuda.log == want
    if zero1:  # a bucket that straddles a shard bound: a reduce onto each of the two owners
        assert any(a[0] == "reduce" and a[4] != b[4] for a, b in zip(want, want[1:]) if b[0] == "reduce")


def test_nccl_reduce_scatter_of_the_whole_buffer_is_one_call(fake_cuda):
    """Without a range (or the whole one) ZeRO-1's reduce-scatter stays NCCL's in-place
    reduceScatter: recvbuff = sendbuff + rank * S."""
    grads = DeviceArray(12)
    comm = nccl_comm(fake_cuda, 2, 3, grads.data.ptr)
    comm.reduce_scatter_sum(grads)
    comm.reduce_scatter_sum(grads, 0, 12)
    assert fake_cuda.log == [("reduceScatter", 0, 8, 4, "compute")] * 2
