"""The classifier's row pass alone (kernels/loss.cu without the three matrix products of
k_loss_bwd): version 1 (the package's loss_fwd / loss_bwd, one block of 512 threads per row, the
row read twice; forced for every row by loss_vectors=0) against the package's version 2 (the row
held in registers, read once) under launch settings.

    python dev/cuda/loss_rows.py --shape 4096,50304 --shape 8192,8192 --dtype fp16,bf16 \\
        --setting v1 --setting vectors=8 --setting vectors=16 --setting prefetch=0

A shape is R,V: a chunk of R rows of V logits (ANDREA-120M trains in chunks of 4,096 rows of 50,304,
ANDREA-12M in one chunk of B*T = 8,192 rows of 8,192 at B=32). A setting is v1, or a comma list of
the backend's loss_* tuning fields without the prefix (vectors=16,prefetch=0; Tuning in
andrea/backends/cuda/tuning.py). Per dtype, shape and
setting: the forward row pass (lse, loss) and the backward one (also dlogits in place), each
captured as a CUDA graph and replayed --reps times between CUDA events; GB/s counts the row read
once and, backward, written once. The outputs of one backward launch on the same random logits
are compared with version 1's: norm(diff) / norm(v1) of dlogits, the largest |diff| of lse.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def backend(setting: str):
    """A CUDA backend whose Tuning has this setting's loss_* values (set as python -m andrea.bench
    --set sets them)."""
    from andrea.bench.step import cuda_backend
    values = {}
    for item in ("vectors=0" if setting == "v1" else setting).split(","):
        name, _, value = item.partition("=")
        if not name or not value.isdigit():
            raise SystemExit(f"--setting {setting}: expected v1 or NAME=INT with loss_NAME a tuning field of the backend")
        values["loss_" + name] = int(value)
    be = cuda_backend(values)
    return be


def row_pass(be, setting, bwd, z, losses, lse, targets, dloss):
    """A function that launches the row pass once over chunk z."""
    from andrea.backends.cuda.runtime import i32, i64
    n, V = z.shape
    args = (losses, lse, z, targets, i64(n), i32(V)) + ((np.uint64(0), np.float32(dloss)) if bwd else ())
    return lambda: be._loss_rows(bwd, n, z, z.dtype, args)


def main(argv=None) -> int:
    import cupy as cp
    import pandas as pd
    from andrea.backends.cuda.graphs import replay_ms
    sys.path.insert(0, str(HERE))
    from harness import np_dtype

    ap = argparse.ArgumentParser(prog="python dev/cuda/loss_rows.py", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=[], help="R,V (repeatable; default 4096,50304 and 8192,8192)")
    ap.add_argument("--dtype", default="fp16,bf16")
    ap.add_argument("--setting", action="append", default=[], help="v1 or loss_* settings (repeatable)")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(",")) for s in (a.shape or ["4096,50304", "8192,8192"])]
    settings = a.setting or ["v1", "vectors=8"]
    if settings[0] != "v1":
        settings = ["v1"] + settings
    bes = {s: backend(s) for s in settings}
    rows = []
    for prec in a.dtype.split(","):
        dt = np_dtype(prec)
        for R, V in shapes:
            # on the device: float32 normals * 3, rounded to dt through the host only for bf16
            # (CuPy has no bfloat16 arithmetic)
            x = cp.random.RandomState(R * V).standard_normal((R, V), dtype=np.float32) * 3
            base = x.astype(dt) if prec != "bf16" else cp.asarray(cp.asnumpy(x).astype(dt))
            targets = cp.asarray(np.random.default_rng([R, V]).integers(0, V, R).astype(np.int32))
            ref = None
            for s in settings:
                be = bes[s]
                losses, lse = cp.empty(R, np.float32), cp.empty(R, np.float32)
                z = base.copy()
                row_pass(be, s, True, z, losses, lse, targets, 1.0 / 7)()  # compiles too
                out = (z.view(np.uint16 if dt.itemsize == 2 else np.uint32).copy(), lse.copy())
                if ref is None:
                    ref = out
                f32 = (lambda u: (u.astype(np.uint32) << 16).view(np.float32)) if prec == "bf16" else (
                    lambda u: u.view(dt).astype(np.float32))
                a32, r32 = f32(out[0]), f32(ref[0])
                diff = float(cp.linalg.norm(a32 - r32) / cp.linalg.norm(r32))
                lse_diff = float(cp.abs(out[1] - ref[1]).max())
                for bwd in (False, True):
                    z = base.copy()
                    fn = row_pass(be, s, bwd, z, losses, lse, targets, 1.0 / 7)
                    fn()
                    cp.cuda.runtime.deviceSynchronize()
                    graph = be.capture(fn)
                    ms = replay_ms(graph, cp.cuda.Stream(non_blocking=True), a.reps)
                    moved = R * V * dt.itemsize * (2 if bwd else 1)
                    rows.append({"dtype": prec, "R": R, "V": V, "setting": s, "pass": "bwd" if bwd else "fwd",
                                 "us": ms * 1e3, "GB/s": moved / ms / 1e6, "dlogits vs v1": diff,
                                 "lse vs v1": lse_diff})
                    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                          flush=True)
    df = pd.DataFrame(rows)
    v1 = df[df.setting == "v1"].set_index(["dtype", "R", "V", "pass"])["us"]
    df["speed-up"] = v1.reindex(pd.MultiIndex.from_frame(df[["dtype", "R", "V", "pass"]])).to_numpy() / df["us"]
    with pd.option_context("display.width", 200, "display.max_rows", 500, "display.float_format", "{:.4g}".format):
        print(df.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
