"""Data parallelism on the CUDA backend with one rank (skipped without a GPU): the gradient sum is a
real NCCL all-reduce (cupy.cuda.nccl, a world of one GPU) inside the optimizer's CUDA graph, and
it changes nothing: the same bits as the engine without a comm. Two or more GPUs: dev/ddp_gpu_check.sh.

    python -m pytest -m gpu tests/test_ddp_gpu.py -q
"""
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.comm import MpiComm
from andrea.config import load_run_config
from andrea.engine import Engine
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


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_nccl_sum_of_one_rank_in_the_graph_changes_nothing(tmp_path, precision):
    d = small_config(tmp_path, precision=precision, grad_accum=2)
    d["model"] = {"n_layer": 2, "d_model": 48, "n_head": 3, "context": 40, "vocab_size": 97}
    d["train"]["seq_len"] = 37
    d["backend"] = {"name": "cuda"}
    cfg = load_run_config(d)
    comm = MpiComm(OneRankWorld())
    ours, plain = Engine(cfg, comm=comm), Engine(cfg)
    assert comm.nccl is not None  # a communicator of one GPU
    recs = []
    for step in range(1, 6):
        batches = global_batches(cfg, step)
        recs.append((dict(ours.train_step(step, batches)), dict(plain.train_step(step, batches))))
    ours.be.synchronize()
    assert ("optimizer", 2) in ours.graphs.graphs, "the optimizer (with the all-reduce) was not captured"
    for a, b in recs:
        assert a == b
    for x, y in zip(ours.host_state(), plain.host_state()):
        assert np.array_equal(x, y)
