"""One rank of the bucketed gradient sum's equality test (tests/test_ddp_buckets.py), under mpirun.

    mpirun -n N python tests/ddp_bucket_worker.py CONFIG.json OUT_PREFIX DTYPE STEPS CAPS

For ZeRO-1 off and on, and each bucket cap of CAPS (bytes, comma-separated; 0: no buckets, the one
sum after the backward pass), every rank trains a fresh engine for STEPS steps on its own
microbatches of the same global batches (ddp_worker.global_batches) and writes
OUT_PREFIX.<rank>.npz with, per variant "z<0|1>_c<cap>": the weights, the Adam moments (rank 0's
gathered from every shard under ZeRO-1), the step records and how many bucket sums the engine's
plan issues per step (and, on CUDA, whether a pass that issues them was captured as a graph).
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import global_batches  # noqa: E402

from andrea.config import load_run_config  # noqa: E402
from andrea.core.comm import make_comm, select_gpu  # noqa: E402
from andrea.core.engine import Engine  # noqa: E402


def run(cfg, comm, dtype, steps, zero1, cap):
    eng = Engine(cfg, dtype=dtype, comm=comm, zero1=zero1, bucket_bytes=cap)
    k, r = cfg.train.grad_accum // comm.size, comm.rank
    recs = []
    for step in range(1, steps + 1):
        rec = eng.train_step(step, global_batches(cfg, step)[r * k:(r + 1) * k])
        recs.append([rec["loss"], rec["grad_norm"]])
    n = eng.layout.n_params
    params, m, v = (eng.be.to_numpy(a) for a in (eng.params[:n], eng.m, eng.v))
    if zero1:
        m, v = comm.gather(m), comm.gather(v)
        m, v = (m[:n], v[:n]) if r == 0 else (np.zeros(0), np.zeros(0))
    buckets = len(eng.buckets.plan) if eng.buckets else 0
    captured = any(k[0] == "passes" and k[-1] for k in getattr(eng.graphs, "graphs", {}))  # CUDA: a graph
    return {"params": params, "m": m, "v": v, "recs": np.array(recs), "buckets": np.array(buckets),
            "captured": np.array(captured)}


def main(config_json, out, dtype, steps, caps):
    cfg = load_run_config(json.loads(open(config_json).read()))
    comm = make_comm()
    select_gpu(cfg.backend.name, comm)  # CUDA (tests/test_ddp_gpu.py): rank r on GPU r of its host
    got = {}
    for zero1 in (False, True):
        for cap in (int(c) for c in caps.split(",")):
            for key, a in run(cfg, comm, dtype, int(steps), zero1, cap).items():
                got[f"z{int(zero1)}_c{cap}.{key}"] = a
    np.savez(f"{out}.{comm.rank}.npz", **got)


if __name__ == "__main__":
    main(*sys.argv[1:])
