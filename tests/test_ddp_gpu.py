"""Data parallelism on the CUDA backend with one rank (skipped without a GPU): the gradient sum is a
real NCCL all-reduce (cupy.cuda.nccl, a world of one GPU) inside the optimizer's CUDA graph, and
it changes nothing: the same bits as the engine without a comm. The same for ZeRO-1 in that world
(NCCL reduce-scatter and all-gather in the graph), and for the sums in buckets issued during the
backward pass on a second stream inside the pass's graph (andrea/core/buckets.py). Two GPUs: the
bucketed sums against the one sum, to the bit (mpirun; skipped with one GPU); more:
dev/ddp_gpu_check.sh.

    python -m pytest -m gpu tests/test_ddp_gpu.py -q
"""
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.core.comm import MpiComm
from andrea.config import load_run_config
from andrea.core.engine import Engine
from conftest import small_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import global_batches  # noqa: E402


class OneRankWorld:
    """The MPI calls MpiComm makes before NCCL runs, for a world of one rank (the test process does
    not start MPI)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def bcast(self, obj, root=0):
        return obj

    def Gather(self, send, recv, root=0):  # the moments of a checkpoint under ZeRO-1
        recv[...] = send


def one_rank_against_plain(tmp_path, precision, **engine_kw):
    """An engine in an NCCL world of one GPU (engine_kw: e.g. zero1=True) and one without a comm,
    5 steps of 2 microbatches each: the first replays its optimizer, collectives inside, as a
    captured CUDA graph; both must give the same records and the same bits."""
    d = small_config(tmp_path, precision=precision, grad_accum=2)
    d["model"] = {"n_layer": 2, "d_model": 48, "n_head": 3, "context": 40, "vocab_size": 97}
    d["train"]["seq_len"] = 37
    d["backend"] = {"name": "cuda"}
    cfg = load_run_config(d)
    comm = MpiComm(OneRankWorld())
    ours, plain = Engine(cfg, comm=comm, **engine_kw), Engine(cfg)
    assert comm.nccl is not None and ours.plan.rows == plain.plan.rows  # a communicator of one GPU
    recs = []
    for step in range(1, 6):
        batches = global_batches(cfg, step)
        recs.append((dict(ours.train_step(step, batches)), dict(plain.train_step(step, batches))))
    ours.be.synchronize()
    assert ("optimizer", 2) in ours.graphs.graphs, "the optimizer (with its collectives) was not captured"
    for a, b in recs:
        assert a == b
    for x, y in zip(ours.host_state(), plain.host_state()):
        assert np.array_equal(x, y)
    assert np.array_equal(ours.be.to_numpy(ours.params_c), plain.be.to_numpy(plain.params_c))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_nccl_sum_of_one_rank_in_the_graph_changes_nothing(tmp_path, precision):
    one_rank_against_plain(tmp_path, precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_zero1_of_one_nccl_rank_gives_the_bits_of_no_zero1(tmp_path, precision):
    """ZeRO-1 in an NCCL world of one GPU, the optimizer replayed as a CUDA graph with the
    reduce-scatter and the all-gather inside. Expected: the same records, weights and moments to
    the bit as the engine without ZeRO-1 and without a comm, because with one rank the shard is
    the whole buffer (no padding, the same plan), NCCL's reduce-scatter and all-gather of one rank
    in place leave the buffers as they are, the norm's partials are the same single block, and the
    only other difference, the compute copy cast by k_cast_params after the all-gather instead of
    inside k_adamw_step, rounds each weight the same way."""
    one_rank_against_plain(tmp_path, precision, zero1=True)


# ------------------------------------------------------------------ the sums in buckets (buckets.py)

GPU_MODEL = {"n_layer": 3, "d_model": 48, "n_head": 3, "context": 40, "vocab_size": 97}  # odd sizes, 3 layers

@pytest.mark.parametrize("zero1", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bucketed_sums_of_one_nccl_rank_in_the_graph_change_nothing(tmp_path, precision, zero1):
    """The gradient sums in buckets of a layer each, issued during the last backward pass on the
    second stream (events after the kernels that finish each bucket, a join before the optimizer),
    inside the pass's CUDA graph, in an NCCL world of one GPU: all-reduce by range, or ZeRO-1's
    reduce onto each shard's owner (grouped ncclReduce). Expected: the bits of the engine without a
    comm, and the pass that issues them captured (a capture whose second stream were not joined
    would fail to end)."""
    from andrea.core.buckets import GradBuckets, plan_buckets

    d = small_config(tmp_path, precision=precision, grad_accum=2)
    d["model"] = dict(GPU_MODEL)
    d["train"]["seq_len"] = 37
    d["backend"] = {"name": "cuda"}
    cfg = load_run_config(d)
    comm = MpiComm(OneRankWorld())
    ours, plain = Engine(cfg, comm=comm, zero1=zero1), Engine(cfg)
    assert ours.buckets is None  # one rank: none of its own; made here to run the CUDA path
    ours.buckets = GradBuckets(comm, ours.grads, plan_buckets(ours.layout, 3, ours.grads.size, 1), zero1)
    for step in range(1, 6):
        batches = global_batches(cfg, step)
        assert dict(ours.train_step(step, batches)) == dict(plain.train_step(step, batches))
    ours.be.synchronize()
    assert ("passes", True, False, None, True) in ours.graphs.graphs, "the pass issuing the buckets not captured"
    for x, y in zip(ours.host_state(), plain.host_state()):
        assert np.array_equal(x, y)


def gpu_count():
    import cupy as cp

    return cp.cuda.runtime.getDeviceCount()


def mpi_env():
    """The CPU tests' mpirun environment (tests/test_ddp.py), the bucket setting left to each test,
    NVLink multicast off as dev/ddp_gpu_check.sh sets it."""
    import os

    from test_ddp import ENV

    env = {k: v for k, v in ENV.items() if k != "ANDREA_DDP_BUCKET_MB"}
    env["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE", "0")
    return env


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bucketed_sums_on_several_gpus_against_one_sum(tmp_path, precision, n):
    """n GPUs (mpirun, one rank a GPU; skipped with fewer), fp32 and bf16: the model of
    tests/test_ddp_buckets.py on CUDA, 8 microbatches a step, 3 steps, buckets of a layer each and
    the default (25 MiB) against the one sum after the backward pass, with and without ZeRO-1; the
    bucketed passes captured as graphs. 2 GPUs: the same weights, moments and records to the bit,
    because each element's sum is one addition, a + b, the same bits in any order. 4 and 8: NCCL's
    order per element may depend on the call (docs/DISTRIBUTED.md), so every rank must hold the same
    bits and the weights must agree with the one sum's to 1e-4 relative (dev/ddp_equal.py's bound);
    whether they are equal to the bit is printed (pytest -rP), a figure for the docs."""
    import json
    import subprocess

    if gpu_count() < n:
        pytest.skip(f"needs {n} GPUs")
    from test_ddp import mpirun

    d = small_config(tmp_path, grad_accum=8, precision=precision)
    d["model"] = dict(GPU_MODEL)
    d["train"]["seq_len"] = 37
    d["backend"] = {"name": "cuda"}
    (tmp_path / "cfg.json").write_text(json.dumps(d))
    r = subprocess.run(mpirun(n, Path(__file__).parent / "ddp_bucket_worker.py", tmp_path / "cfg.json",
                              tmp_path / "out", "float32", 3, "0,1,26214400"), env=mpi_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = [np.load(tmp_path / f"out.{k}.npz") for k in range(n)]
    for z in (0, 1):
        for cap in (0, 1, 26214400):
            v = f"z{z}_c{cap}"
            for o in outs[1:]:  # every rank the same weights and records
                assert np.array_equal(o[f"{v}.params"], outs[0][f"{v}.params"]), (v, "ranks differ")
                assert np.array_equal(o[f"{v}.recs"], outs[0][f"{v}.recs"]), (v, "ranks differ")
            if cap:
                assert all(bool(o[f"{v}.captured"]) for o in outs), "the bucketed pass was not captured as a graph"
        for cap in (1, 26214400):
            v, one = f"z{z}_c{cap}", f"z{z}_c0"
            same = all(np.array_equal(o[f"{v}.{k}"], o[f"{one}.{k}"]) for o in outs
                       for k in ("params", "m", "v", "recs"))
            a, b = outs[0][f"{v}.params"].astype(np.float64), outs[0][f"{one}.params"].astype(np.float64)
            rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
            print(f"{n} GPUs {precision} zero1={z} cap={cap}: bit-equal to the one sum: {same}; "
                  f"weights rel L2 {rel:.2e}")
            if n == 2:
                assert same, (z, cap, rel)
            assert rel <= 1e-4, (z, cap, rel)


@pytest.mark.parametrize("zero1", [False, True])
def test_sigterm_to_one_of_two_gpu_ranks_and_resume_is_bit_exact(tmp_path, zero1):
    """2 GPUs, the engine under mpirun with the sums in buckets of a layer each: SIGTERM to rank 1
    before its first step stops both ranks after step 1 with one checkpoint (tests/test_ddp.py's
    stop_rank_1); the same command resumes and ends with the checkpoint bytes and sidecar of an
    uninterrupted 2-GPU run (fp32, 2 microbatches a step, 12 steps)."""
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    import test_ddp as cpu
    from omegaconf import OmegaConf

    from andrea.core import checkpoint as ck
    from conftest import make_shards

    make_shards(tmp_path)

    def run_dir(name):
        d = small_config(tmp_path, steps=12, ckpt_every=6, grad_accum=2)
        d["model"] = dict(GPU_MODEL)  # vocab 97 >= the shards' 61
        d["train"]["seq_len"] = 37
        d["backend"] = {"name": "cuda"}
        run = tmp_path / name
        run.mkdir()
        OmegaConf.save(OmegaConf.create(d), run / "config.yaml")
        return run
    old = dict(cpu.ENV)
    cpu.ENV.update(mpi_env())  # the helpers' mpirun environment, with NVLink multicast off
    try:
        straight = run_dir("straight")
        rc, evs, err = cpu.finish(cpu.engine(2, straight, zero1=zero1))
        assert rc == 0 and evs[-1] == {"event": "done", "step": 12, "status": "finished"}, err[-3000:]
        run = run_dir("interrupted")
        stopped, _ = cpu.stop_rank_1(tmp_path, run, zero1=zero1)
        assert [e["step"] for e in stopped if e["event"] == "checkpoint" and e["reason"] == "signal"] == [1]
        rc, evs, err = cpu.finish(cpu.engine(2, run, zero1=zero1))
        assert rc == 0 and [e["step"] for e in evs if e["event"] == "step"][0] == 2, err[-3000:]
    finally:
        cpu.ENV.clear()
        cpu.ENV.update(old)
    a, b = ck.bin_path(straight / "checkpoints", 12), ck.bin_path(run / "checkpoints", 12)
    assert a.read_bytes() == b.read_bytes()
    assert ck.sidecar_path(a).read_text() == ck.sidecar_path(b).read_text()
