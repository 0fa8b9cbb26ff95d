"""The batched decoder's streams, one kernel file or products path against another, in one process (GPU).

    python dev/decode_ab.py                       # kernels/decode.cu ("main"), both products paths
    python dev/decode_ab.py --models ANDREA-120M --sources main,v3 --tokens 200   # against dev/cuda/decode_v3.cu
    python dev/decode_ab.py --models ANDREA-120M --slots 1,2,4,8   # where the few-row products stop paying

For each model (random weights, fp16), kernel file and products path (the few-row kernels, "gemv",
or the training's layers on cuBLAS, "cublas"): a decoder of one slot, a 16-token prompt, --tokens
new tokens, greedy (--slots: decoders of that many slots, all of them busy, each with its own
prompt); tokens/s of the steps, all slots' (median of 3 runs after one untimed), the step's graph
replayed alone at 100 cached positions (us, CUDA events), and how many of the greedy tokens differ
from the first configuration's (16-bit sums in another order may change a near tie). One table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from andrea.backends import get_backend  # noqa: E402
from andrea.config import ModelConfig  # noqa: E402
from andrea.core.model import count_params  # noqa: E402
from andrea.paths import model_config  # noqa: E402
from andrea.use.batch import BatchDecoder, Request  # noqa: E402


def source_map(name: str) -> dict:
    return {} if name == "main" else {"decode.cu": str(ROOT / "dev" / "cuda" / f"decode_{name}.cu")}


def run(m, params, source: str, path: str, tokens: int, slots: int = 1) -> dict:
    import cupy as cp
    be = get_backend("cuda", sources=source_map(source))
    bd = BatchDecoder(m, be, slots, m.context, "float16")
    bd.gemv = path == "gemv"
    bd.load(params)
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, m.vocab_size, 16))) for _ in range(slots)]
    out = []

    def once():
        out.clear()
        for p in prompts:
            bd.admit(Request(p, tokens))
        while bd.free() < bd.slots:
            out.extend(t for _, t, _ in bd.step())
    once()
    times = []
    for _ in range(3):
        be.synchronize()
        t0 = time.perf_counter()
        once()
        be.synchronize()
        times.append(time.perf_counter() - t0)
    made = list(out)
    # the step's graph alone, 100 cached positions
    bd.admit(Request(list(map(int, rng.integers(0, m.vocab_size, 100))), tokens))
    a, b = cp.cuda.Event(), cp.cuda.Event()
    bd.graph.launch()
    a.record()
    for _ in range(50):  # positions 100..149 (the sampler advances them)
        bd.graph.launch()
    b.record()
    b.synchronize()
    graph_us = cp.cuda.get_elapsed_time(a, b) * 1e3 / 50
    while bd.free() < bd.slots:
        bd.step()
    return {"tok_s": slots * tokens / statistics.median(times), "graph_us": graph_us, "tokens": made}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="ANDREA-12M,ANDREA-120M")
    ap.add_argument("--sources", default="main")
    ap.add_argument("--paths", default="gemv,cublas")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--slots", default="1", help="comma list: decoders of this many slots, all busy")
    a = ap.parse_args(argv)
    print(f"{'model':<13}{'kernels':<8}{'slots':>6} {'path':<8}{'tokens/s':>10}{'graph us':>10}{'differ':>8}")
    for name in a.models.split(","):
        m = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(model_config(name))))
        params = np.random.default_rng(0).normal(0, 0.02, count_params(m)).astype(np.float32)
        for slots in map(int, a.slots.split(",")):
            first = None
            for source in a.sources.split(","):
                for path in a.paths.split(","):
                    r = run(m, params, source, path, a.tokens, slots)
                    first = first or r["tokens"]
                    differ = sum(x != y for x, y in zip(first, r["tokens"]))
                    print(f"{name:<13}{source:<8}{slots:>6} {path:<8}{r['tok_s']:>10,.0f}{r['graph_us']:>10.1f}"
                          f"{differ:>8}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
