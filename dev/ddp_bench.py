"""Data-parallel training speed on the GPUs of one host: one JSON line from rank 0.

    python dev/ddp_bench.py --exp ANDREA-120M --precision bf16 --batch 8            # 1 GPU
    mpirun -n 2 python dev/ddp_bench.py --exp ANDREA-120M --precision bf16 --batch 8  # 2 GPUs

Each rank builds the engine for the experiment's model shape at T = context (as andrea.bench) with
--batch sequences per microbatch and one microbatch per rank (train.grad_accum = ranks, so the
global batch grows with the ranks, as PyTorch DDP's does), runs warm-up steps on fixed random
tokens, then times --steps steps (host clock around synchronised steps, rank 0). Printed: ranks,
global tokens/s, ms/step, the memory plan's bytes per rank, and the time of one all-reduce of the
gradients alone (NCCL, the same buffer), which is what the step adds to one GPU's.
Efficiency = tokens/s on N GPUs / (N x tokens/s on one), both in the same job.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from andrea.bench import model_dict  # noqa: E402
from andrea.comm import make_comm, select_gpu  # noqa: E402
from andrea.config import load_run_config  # noqa: E402
from andrea.engine import Engine  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="ANDREA-120M")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", default="cuda", help="numpy: a smoke run of this script on CPU ranks")
    a = ap.parse_args()
    comm = make_comm()
    select_gpu(a.backend, comm)
    m = model_dict(a.exp)
    T = int(m["context"])
    cfg = load_run_config({"exp": a.exp, "model": m, "backend": {"name": a.backend},
                           "train": {"batch_size": a.batch, "seq_len": T, "grad_accum": comm.size,
                                     "precision": a.precision, "steps": a.warmup + a.steps, "warmup_steps": 0}})
    eng = Engine(cfg, comm=comm)
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
    # one all-reduce of the gradients alone, for the scaling estimate
    ar_ms = None
    if comm.size > 1:
        for _ in range(3):
            comm.allreduce_sum(eng.grads)
        eng.be.synchronize()
        t1 = time.perf_counter()
        for _ in range(10):
            comm.allreduce_sum(eng.grads)
        eng.be.synchronize()
        ar_ms = (time.perf_counter() - t1) / 10 * 1e3
    if comm.rank == 0:
        print(json.dumps({"exp": a.exp, "precision": a.precision, "batch_per_rank": a.batch, "T": T,
                          "ranks": comm.size, "tokens_per_s": a.batch * T * comm.size / dt, "ms_per_step": dt * 1e3,
                          "allreduce_ms": ar_ms, "grad_bytes": int(eng.grads.nbytes),
                          "plan_bytes_per_rank": eng.plan.total() + eng.workspace.nbytes(), "loss": loss}), flush=True)


if __name__ == "__main__":
    main()
