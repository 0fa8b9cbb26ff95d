"""Data-parallel training speed on the GPUs of one host: one JSON line from rank 0.

    python dev/ddp_bench.py --exp ANDREA-120M --precision bf16 --batch 8            # 1 GPU
    mpirun -n 2 python dev/ddp_bench.py --exp ANDREA-120M --precision bf16 --batch 8  # 2 GPUs
    mpirun -n 2 python dev/ddp_bench.py --exp ANDREA-120M --precision bf16 --batch 8 --zero1  # ZeRO-1

Each rank builds the engine for the experiment's model shape at T = context (as andrea.bench.step) with
--batch sequences per microbatch and one microbatch per rank (train.grad_accum = ranks, so the
global batch grows with the ranks, as PyTorch DDP's does), runs warm-up steps on fixed random
tokens, then times --steps steps (host clock around synchronised steps, rank 0). Printed: ranks,
global tokens/s, ms/step, the memory plan's bytes per rank, and the time of one all-reduce of the
gradients alone (NCCL, the same buffer), which is what the step adds to one GPU's; with --zero1
(the Adam state sharded over the ranks) the time of the reduce-scatter of the gradients and the
all-gather of the weights instead. Memory per rank: the plan's bytes (arena + kernel workspace),
its Adam moments' bytes, and the device's own figure after the timed steps (cudaMemGetInfo: total
- free, which also counts the CUDA context, NCCL's buffers and CuPy's pool), the largest over the
ranks. Efficiency = tokens/s on N GPUs / (N x tokens/s on one), both in the same job. buckets: how
many bucketed sums the step issues during the backward pass (andrea/core/buckets.py; 0: the one sum
after it, ANDREA_DDP_BUCKET_MB=0).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from andrea.bench.step import model_dict  # noqa: E402
from andrea.core.comm import make_comm, select_gpu  # noqa: E402
from andrea.config import load_run_config  # noqa: E402
from andrea.core.engine import Engine  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="ANDREA-120M")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16", "fp8"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", default="cuda", help="numpy: a smoke run of this script on CPU ranks")
    ap.add_argument("--zero1", action="store_true", help="shard the Adam state over the ranks (ZeRO-1)")
    a = ap.parse_args()
    comm = make_comm()
    select_gpu(a.backend, comm)
    m = model_dict(a.exp)
    T = int(m["context"])
    cfg = load_run_config({"exp": a.exp, "model": m, "backend": {"name": a.backend},
                           "train": {"batch_size": a.batch, "seq_len": T, "grad_accum": comm.size,
                                     "precision": a.precision, "steps": a.warmup + a.steps, "warmup_steps": 0}})
    eng = Engine(cfg, comm=comm, zero1=a.zero1)
    rng = np.random.default_rng(comm.rank)
    V = int(m["vocab_size"])
    x = rng.integers(0, V, (a.batch, T)).astype(np.int32)
    y = rng.integers(0, V, (a.batch, T)).astype(np.int32)
    for s in range(1, a.warmup + 1):
        eng.train_step(s, [(x, y)])
    eng.be.synchronize()
    comm.any(False)  # every rank starts the clock together
    t0 = time.perf_counter()
    for s in range(a.warmup + 1, a.warmup + a.steps + 1):
        rec = eng.train_step(s, [(x, y)])
    eng.be.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    loss = rec["loss"]
    used = device_used(a.backend)  # before the collectives below, which change nothing in it anyway
    used = comm.gather(np.array([used], dtype=np.int64))

    def comms():  # what the step adds to one GPU's: the gradients' all-reduce, or ZeRO-1's pair
        if a.zero1:
            comm.reduce_scatter_sum(eng.grads)
            comm.allgather(eng.params)
        else:
            comm.allreduce_sum(eng.grads)
    comm_ms = None
    if comm.size > 1:
        for _ in range(3):
            comms()
        eng.be.synchronize()
        t1 = time.perf_counter()
        for _ in range(10):
            comms()
        eng.be.synchronize()
        comm_ms = (time.perf_counter() - t1) / 10 * 1e3
    if comm.rank == 0:
        adam = sum(r.nbytes for r in eng.plan.rows if r.group in ("adam_m", "adam_v"))
        print(json.dumps({"exp": a.exp, "precision": a.precision, "batch_per_rank": a.batch, "T": T,
                          "ranks": comm.size, "zero1": a.zero1,
                          "buckets": len(eng.buckets.plan) if eng.buckets else 0, "tokens_per_s": a.batch * T * comm.size / dt,
                          "ms_per_step": dt * 1e3, ("zero1_comm_ms" if a.zero1 else "allreduce_ms"): comm_ms,
                          "grad_bytes": int(eng.grads.nbytes), "adam_bytes_per_rank": adam,
                          "plan_bytes_per_rank": eng.plan.total() + eng.workspace.nbytes(),
                          "device_used_bytes_per_rank": int(used.max()) if used[0] >= 0 else None,
                          "loss": loss}), flush=True)


def device_used(backend: str) -> int:
    """Bytes in use on this rank's GPU (cudaMemGetInfo: total - free); -1 on the NumPy backend."""
    if backend == "numpy":
        return -1
    import cupy as cp

    free, total = cp.cuda.runtime.memGetInfo()
    return int(total - free)


if __name__ == "__main__":
    main()
