"""The same update on N GPUs as on one, in fp32 (a check for a machine with N >= 2 GPUs).

    python dev/ddp_equal.py --ranks 2 [--precision fp32] [--zero1] [--out DIR] [--backend numpy]

Runs tests/ddp_worker.py (a small odd-sized model, 3 steps, fixed random batches) on N ranks of
one microbatch each through mpirun (ANDREA_MPIRUN replaces the command), and as one process over
all N microbatches; prints one JSON line and exits 1 when a check fails: every rank holds the same
bits; step 1's loss is the one process's (the same weights and batch); the weights after 3 steps
agree with the one process's to fp32 round-off (relative L2 distance below 1e-4: the order of the
sum over ranks differs, and Adam magnifies round-off in near-zero gradients). With --zero1 the
ranks run a second time with the Adam state sharded (ZeRO-1), against the same one process
(without it): a second JSON line, the same checks on the weights and records every rank holds;
rank 0's Adam m (gathered from the shards) is reported beside the one process's (adam_m_rel_l2).
With --precision fp8 (T = 32: FP8's sizes) the ranks also hold the same delayed scales' amax
histories, and after step 1 those equal the one process's bit for bit (the step's amax is the
largest over its microbatches, which the ranks' allreduce_max makes of theirs).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MODEL = {"n_layer": 2, "d_model": 48, "n_head": 3, "context": 40, "vocab_size": 97}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--out", type=Path, default=Path("ddp-equal"))
    ap.add_argument("--backend", default="cuda", help="numpy: the same check on CPU ranks (fp32)")
    ap.add_argument("--zero1", action="store_true", help="also run the ranks with ZeRO-1 (the Adam state sharded)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    fp8 = a.precision == "fp8"
    cfg = {"exp": "ddp-equal", "results_dir": str(a.out), "model": MODEL, "backend": {"name": a.backend},
           "data": {"train_shards": "unused", "val_shards": "unused", "tokenizer": "unused"},
           "train": {"steps": 3, "batch_size": 3, "seq_len": 32 if fp8 else 37, "lr": 3e-3, "warmup_steps": 1,
                     "grad_accum": a.ranks, "precision": a.precision, "eval_every": 0, "sample_every": 0}}
    (a.out / "cfg.json").write_text(json.dumps(cfg))
    worker = [str(REPO / "tests" / "ddp_worker.py"), str(a.out / "cfg.json")]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    mpirun = shlex.split(os.environ.get("ANDREA_MPIRUN", "mpirun"))
    subprocess.run([sys.executable, *worker, str(a.out / "one"), "float32", "3"], env=env, check=True)
    one = np.load(a.out / "one.0.npz")
    ok = True
    for zero1 in (False, True)[:1 + a.zero1]:
        name = "ranks-zero1" if zero1 else "ranks"
        subprocess.run([*mpirun, "-n", str(a.ranks), sys.executable, *worker, str(a.out / name), "float32", "3",
                        str(int(zero1))], env=env, check=True)
        outs = [np.load(a.out / f"{name}.{r}.npz") for r in range(a.ranks)]
        whole = ("params", "recs") if zero1 else ("params", "m", "v", "recs")  # ZeRO-1: the moments are shards
        hist = tuple(k for k in ("hist1", "hist") if k in one.files)
        same = all(np.array_equal(o[k], outs[0][k]) for o in outs[1:] for k in whole + hist)

        def rel(k):
            p, q = outs[0][k].astype(np.float64), one[k].astype(np.float64)
            return float(np.linalg.norm(p - q) / np.linalg.norm(q))
        loss1 = (float(outs[0]["recs"][0, 0]), float(one["recs"][0, 0]))
        hist1 = bool(hist) and all(k in outs[0].files for k in hist) and np.array_equal(outs[0]["hist1"], one["hist1"])
        good = same and abs(loss1[0] - loss1[1]) <= 1e-6 * abs(loss1[1]) and rel("params") < 1e-4 and (hist1 or not fp8)
        ok = ok and good
        extra = {"fp8_hist1_equal": hist1, "fp8_hist_rel_l2": rel("hist")} if fp8 and hist1 else {}
        print(json.dumps({"ranks": a.ranks, "precision": a.precision, "zero1": zero1, "ranks_identical": same,
                          "step1_loss": loss1, "params_rel_l2": rel("params"), "adam_m_rel_l2": rel("m"),
                          **extra, "ok": good}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
