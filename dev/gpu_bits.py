"""Bits of a few training runs on the CUDA backend, to compare two commits: same output, same bits.

    python dev/gpu_bits.py [--steps 20]          # at one commit, then at the other; diff the outputs

Runs --steps AdamW steps (2 microbatches each, fixed random tokens) of an ANDREA-tiny-shaped and
an ANDREA-12M-shaped model in fp32, fp16 and bf16 (--precisions: fp8 too), the 16-bit ones with
each attention path, and prints a table: the final loss and the sha256 of the final weights and
Adam state. Uses only
what both older and newer commits have (the Engine constructor, train_step and the host state),
and detects how the attention path is chosen (a backend constructor argument, or the older
module flag), so the same file runs at either commit.
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

# the model shapes, written out so both commits run exactly these whatever their configs say
SHAPES = {
    "tiny": {"name": "ANDREA-tiny", "n_layer": 2, "d_model": 64, "n_head": 4, "context": 64, "vocab_size": 512},
    "12M": {"name": "ANDREA-12M", "n_layer": 6, "d_model": 384, "n_head": 6, "context": 256, "vocab_size": 8192},
}
BATCH = {"tiny": (8, 64), "12M": (8, 256)}


def cuda_backend(attention: str):
    """A CUDA backend taking this attention path, through whichever API this commit has."""
    import importlib
    mod = importlib.import_module("andrea.backends.cuda")
    if hasattr(mod, "CudaBackend"):  # the backend is an object with a constructor setting
        return mod.CudaBackend(attention=attention)
    mod.FLASH = attention == "fused"  # older commits: one module, a module flag
    return mod


def final_state(eng):
    state = getattr(eng, "host_state", None)
    if state is not None:
        return state()
    st = eng.state()  # newer engines: a state object or dict with the three blocks
    if isinstance(st, dict):
        return st["params"], st["m"], st["v"]
    return st.params, st.m, st.v


def run(shape: str, precision: str, attention: str, steps: int) -> dict:
    from andrea.config import load_run_config
    try:
        from andrea.core.engine import Engine
    except ImportError:  # trees before the layout of andrea/core
        from andrea.engine import Engine
    B, T = BATCH[shape]
    m = SHAPES[shape]
    cfg = load_run_config({"exp": m["name"], "model": dict(m), "backend": {"name": "cuda"},
                           "train": {"batch_size": B, "seq_len": T, "precision": precision, "steps": steps,
                                     "warmup_steps": 2, "grad_accum": 2, "seed": 1337}})
    eng = Engine(cfg, backend=cuda_backend(attention))
    rng = np.random.default_rng(0)
    rec = None
    for step in range(1, steps + 1):
        batches = []
        for _ in range(2):
            xy = rng.integers(0, m["vocab_size"], (B, T + 1)).astype(np.int32)
            batches.append((xy[:, :-1], xy[:, 1:]))
        rec = eng.train_step(step, batches)
    h = hashlib.sha256()
    for block in final_state(eng):
        h.update(np.ascontiguousarray(block, dtype=np.float32).tobytes())
    return {"shape": shape, "precision": precision, "attention": attention, "steps": steps,
            "final loss": f"{rec['loss']:.9g}", "skipped": eng.skipped, "sha256": h.hexdigest()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/gpu_bits.py", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shapes", default="tiny,12M")
    ap.add_argument("--precisions", default="fp32,fp16,bf16", help="comma list; fp8 too where both trees have it")
    a = ap.parse_args(argv)
    import pandas as pd
    rows = []
    for shape in a.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shapes {shape}: expected {', '.join(SHAPES)}")
        for precision in a.precisions.split(","):
            if precision not in ("fp32", "fp16", "bf16", "fp8"):
                raise SystemExit(f"--precisions {precision}: expected fp32, fp16, bf16 or fp8")
            for attention in (("materialised",) if precision == "fp32" else ("fused", "materialised")):
                rows.append(run(shape, precision, attention, a.steps))
                print(rows[-1], file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_colwidth", 70):
        print(df.to_string(index=False))
    print("all:", hashlib.sha256("".join(df.sha256).encode()).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
