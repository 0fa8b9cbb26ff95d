"""Where two trees' training steps part: the hash of every backend call's arrays, in order.

    python dev/step_trace.py --precision fp8 --out a.json     # in one tree (on the GPU)
    python dev/step_trace.py --precision fp8 --out b.json     # in the other
    python dev/step_trace.py --diff a.json b.json             # the first calls whose arrays differ

dev/gpu_bits.py says whether two trees give the same bits after some steps; this says where they
stop doing so. It runs --steps optimizer steps of --grad-accum microbatches (fixed random tokens,
fixed seed) of the --shape model with the CUDA graphs off (every pass runs eagerly, so each call's
arrays can be read after it) and records, for every k_* call of the backend object (the engine's
calls and the backend's calls to itself), its name and a sha256 of each array argument after the
call: inputs and outputs alike, so an array that a call changed shows up at that call. --set
ATTR=VALUE sets a backend switch first (andrea.bench.step's parsing and checks).
--backend numpy runs it on the CPU (fp32 only): how the tests check the tool.

--diff prints the first differing calls as a table (call index, name, the arguments that differ)
and exits 1 where the traces differ, 0 where they agree.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys

import numpy as np

SHAPES = {  # written out, as in dev/gpu_bits.py, so both trees run exactly these
    "tiny": {"name": "ANDREA-tiny", "n_layer": 2, "d_model": 64, "n_head": 4, "context": 64, "vocab_size": 512},
    "12M": {"name": "ANDREA-12M", "n_layer": 6, "d_model": 384, "n_head": 6, "context": 256, "vocab_size": 8192},
}


def array_hash(a) -> str | None:
    """sha256 (16 hex digits) of an array's bytes (a CuPy array copied to the host), or None."""
    if hasattr(a, "get") and hasattr(a, "data"):  # cupy.ndarray
        a = a.get()
    if not isinstance(a, np.ndarray):
        return None
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()[:16]


def traced(be, log: list) -> None:
    """Wrap every k_* method of the backend object be: after each call (the device synchronised),
    append {"call", "hashes"} to log, hashes one per positional or keyword array argument."""
    sync = getattr(be, "synchronize", lambda: None)
    for name in dir(be):
        method = getattr(be, name, None)
        if not name.startswith("k_") or not callable(method):
            continue

        def wrapper(*args, _method=method, _name=name, **kwargs):
            out = _method(*args, **kwargs)
            sync()
            hashes = [h for h in map(array_hash, list(args) + list(kwargs.values())) if h is not None]
            log.append({"call": _name, "hashes": hashes})
            return out

        setattr(be, name, functools.wraps(method)(wrapper))


def trace(shape: str, precision: str, batch: int, steps: int, grad_accum: int, backend: str, sets: dict) -> list:
    """The calls of `steps` optimizer steps (see the module's doc)."""
    from andrea.backends import get_backend
    from andrea.config import load_run_config
    from andrea.core.engine import Engine
    m = SHAPES[shape]
    T = m["context"]
    cfg = load_run_config({"exp": m["name"], "model": dict(m), "backend": {"name": backend},
                           "train": {"batch_size": batch, "seq_len": T, "precision": precision, "steps": steps,
                                     "warmup_steps": 2, "grad_accum": grad_accum, "seed": 1337}})
    from andrea.bench.step import cuda_backend
    if sets and backend != "cuda":
        raise SystemExit(f"--set {', '.join(sets)}: settings of the CUDA backend; this trace runs --backend {backend}")
    be = cuda_backend(sets) if backend == "cuda" else get_backend(backend)
    eng = Engine(cfg, backend=be)
    eng.graphs.run = lambda key, fn: fn()  # every pass eagerly: the arrays can be read after each call
    log: list = []
    traced(eng.be, log)
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        batches = []
        for _ in range(grad_accum):
            xy = rng.integers(0, m["vocab_size"], (batch, T + 1)).astype(np.int32)
            batches.append((xy[:, :-1], xy[:, 1:]))
        eng.train_step(step, batches)
    return [dict(i=i, **rec) for i, rec in enumerate(log)]


def diff(a: list, b: list, most: int = 12):
    """(rows, count): the first `most` calls where a and b differ (name or any hash), as dicts, and
    how many calls differ in all (calls past the shorter trace count as differing)."""
    rows, count = [], 0
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x is not None and y is not None and x["call"] == y["call"] and x["hashes"] == y["hashes"]:
            continue
        count += 1
        if len(rows) < most:
            args = ([j for j, (p, q) in enumerate(zip(x["hashes"], y["hashes"])) if p != q]
                    if x is not None and y is not None and x["call"] == y["call"] else [])
            rows.append({"i": i, "a": x["call"] if x else "-", "b": y["call"] if y else "-",
                         "arguments that differ": ",".join(map(str, args)) or "-"})
    return rows, count


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/step_trace.py", description=__doc__.splitlines()[0])
    ap.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two traces instead of making one")
    ap.add_argument("--shape", default="12M", choices=sorted(SHAPES))
    ap.add_argument("--precision", default="fp8", choices=("fp32", "fp16", "bf16", "fp8"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--backend", default="cuda", choices=("cuda", "numpy"))
    ap.add_argument("--set", action="append", default=[], metavar="ATTR=VALUE")
    ap.add_argument("--out", help="write the trace here (JSON)")
    a = ap.parse_args(argv)
    if a.diff:
        traces = []
        for path in a.diff:
            try:
                with open(path) as f:
                    traces.append(json.load(f)["calls"])
            except (OSError, ValueError, KeyError) as e:
                raise SystemExit(f"--diff {path}: not a trace of this tool ({e})")
        rows, count = diff(*traces)
        if not count:
            print(f"the traces agree: {len(traces[0])} calls")
            return 0
        import pandas as pd
        print(f"{count} of {max(map(len, traces))} calls differ; the first:")
        print(pd.DataFrame(rows).to_string(index=False))
        return 1
    if not a.out:
        raise SystemExit("--out: where to write the trace (or --diff A B)")
    from andrea.bench.step import parse_settings
    calls = trace(a.shape, a.precision, a.batch, a.steps, a.grad_accum, a.backend, parse_settings(a.set))
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "calls": calls}, f)
    print(f"{len(calls)} calls traced into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
