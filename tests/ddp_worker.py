"""One rank of the data-parallel equality test (tests/test_ddp.py), started by mpirun.

    mpirun -n N python tests/ddp_worker.py CONFIG.json OUT_PREFIX DTYPE STEPS [ZERO1]

Every rank builds the same engine (andrea.core.comm.make_comm; ZERO1=1: with the Adam state sharded),
draws the same global batches from a fixed seed, runs its own microbatches (rank r: r*k .. r*k+k-1
of grad_accum = N*k) and writes OUT_PREFIX.<rank>.npz: the weights, the Adam moments and the step
records after STEPS steps (under ZeRO-1 rank 0 holds the moments gathered from every shard, the
other ranks their own shard); with train.precision=fp8 and delayed scales also the amax histories
after step 1 (hist1) and after the last step (hist).
"""
import json
import sys

import numpy as np

from andrea.core.comm import make_comm, select_gpu
from andrea.config import load_run_config
from andrea.core.engine import Engine


def global_batches(cfg, step, seed=11):
    """The grad_accum (x, y) microbatches of a step, the same in every process."""
    t, V = cfg.train, cfg.model.vocab_size
    rng = np.random.default_rng([seed, step])
    toks = rng.integers(0, V, (t.grad_accum, t.batch_size, t.seq_len + 1)).astype(np.int32)
    return [(m[:, :-1].copy(), m[:, 1:].copy()) for m in toks]


def main(config_json, out, dtype, steps, zero1="0"):
    cfg = load_run_config(json.loads(open(config_json).read()))
    comm = make_comm()
    select_gpu(cfg.backend.name, comm)  # rank r on GPU r of its host
    eng = Engine(cfg, dtype=dtype, comm=comm, zero1=zero1 == "1")
    k = cfg.train.grad_accum // comm.size
    r = comm.rank
    recs, hist = [], {}
    for step in range(1, int(steps) + 1):
        rec = eng.train_step(step, global_batches(cfg, step)[r * k:(r + 1) * k])
        recs.append([rec["loss"], rec["grad_norm"]])
        if step == 1 and eng.fp8_history() is not None:
            hist["hist1"] = np.array(eng.fp8_history(), np.float32)
    if hist:
        hist["hist"] = np.array(eng.fp8_history(), np.float32)
    n = eng.layout.n_params
    params, m, v = (eng.be.to_numpy(a) for a in (eng.params[:n], eng.m, eng.v))
    if eng.zero1 and r == 0:  # the whole moments, in the engine's dtype (the checkpoint's are float32)
        m, v = (comm.gather(a)[:n] for a in (m, v))
    elif eng.zero1:
        comm.gather(m), comm.gather(v)
    np.savez(f"{out}.{r}.npz", params=params, m=m, v=v, recs=np.array(recs), **hist)


if __name__ == "__main__":
    main(*sys.argv[1:])
