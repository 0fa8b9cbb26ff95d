"""What a training step's CUDA graphs hold, and how much of the optimizer could hide under the passes.

    python dev/graph_probe.py --exp ANDREA-120M --precision fp8 --batch 8 [--out DIR] [--reps 20]

It builds an Engine, runs a few training steps (so the passes and the optimizer are captured as
graphs, as in training), and then:

1. writes each graph as DOT (cudaGraphDebugDotPrint, through CuPy's Graph.debug_dot_str) to
   --out, and prints a census: nodes by type (kernel, memset, memcpy, event, ...) and the kernels
   by name. Who issues a memset shows in the kernel that follows it;
2. times the graphs by replaying them, between CUDA events: the passes alone, the optimizer alone,
   both one after the other on one stream (what a step does), and both at once on two streams
   (the passes at high priority). The last is only a bound: the two race on the weights and the
   gradients, so its numbers are not a training step's, and the engine is dropped after it. What
   the concurrent pair saves against the serial pair is the most that running the optimizer
   beside the next step's forward pass could gain.

Needs a CUDA GPU and CuPy; elsewhere it says so and exits 2.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NODE = re.compile(r'"([^"]*node_\d+)"\s*\[(.*?)\];', re.S)
TYPES = ("KERNEL", "MEMSET", "MEMCPY", "EVENT_RECORD", "EVENT_WAIT", "EVENT", "HOST", "EMPTY", "GRAPH",
         "MEM_ALLOC", "MEM_FREE", "CONDITIONAL", "BATCH_MEM_OP")
NAME = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]{3,})\s*(?:\\<|<|\()")


def census(dot: str):
    """(types, kernels, after_memset): node counts by type, kernel nodes by function name, and the
    name of the node that follows each memset (by the DOT's edges) counted."""
    labels = {n: body for n, body in NODE.findall(dot)}
    types, kernels, kind_of, name_of = Counter(), Counter(), {}, {}
    for n, body in labels.items():
        up = body.upper()
        kind = next((t for t in TYPES if t in up), "OTHER")
        kind_of[n] = kind
        types[kind] += 1
        if kind == "KERNEL":
            m = NAME.search(body)
            name_of[n] = m.group(1) if m else "?"
            kernels[name_of[n]] += 1
    after = Counter()
    for a, b in re.findall(r'"([^"]*node_\d+)"\s*->\s*"([^"]*node_\d+)"', dot):
        if kind_of.get(a) == "MEMSET":
            after[name_of.get(b, kind_of.get(b, "?"))] += 1
    return types, kernels, after


def timed(cp, fn, reps):
    """Milliseconds per call of fn (which queues work), between events on the current stream."""
    fn()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/graph_probe.py", description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="ANDREA-120M")
    ap.add_argument("--precision", choices=["fp32", "fp16", "bf16", "fp8"], default="fp8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="graph-probe", help="folder for the DOT files")
    a = ap.parse_args(argv)
    from andrea.backends import cuda_available
    if not cuda_available():
        print("dev/graph_probe.py: needs a CUDA GPU and CuPy; none here", file=sys.stderr)
        return 2
    import cupy as cp
    import pandas as pd

    from andrea.backends import get_backend
    from andrea.bench import bench_config, random_batches
    from andrea.engine import Engine
    cfg = bench_config(a.exp, a.precision, a.batch, 16)
    eng = Engine(cfg, backend=get_backend("cuda"))
    batches = random_batches(cfg.model.vocab_size, a.batch, cfg.model.context)
    used = {}
    run = eng._run

    def spy(key, fn):
        used[key[0]] = key
        run(key, fn)
    eng._run = spy
    for s in range(1, 5):
        eng.train_step(s, [batches[s % 4]])["loss"]
    graphs = {kind: eng.graphs.graphs[key][0] for kind, key in used.items()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for kind, g in graphs.items():
        dot = g.debug_dot_str()
        dot = dot.decode() if isinstance(dot, bytes) else dot
        (out / f"{kind}.dot").write_text(dot)
        types, kernels, after = census(dot)
        print(f"\n== graph {kind}: {sum(types.values())} nodes, key {used[kind]!r}")
        print(pd.Series(types, name="nodes").sort_values(ascending=False).to_string())
        print(f"-- kernels by name ({sum(kernels.values())}):")
        print(pd.Series(kernels, name="launches").sort_values(ascending=False).to_string())
        if after:
            print("-- the node after each memset:")
            print(pd.Series(after, name="memsets").sort_values(ascending=False).to_string())

    P, O = graphs["passes"], graphs["optimizer"]
    try:  # the passes at the device's highest priority
        hi = cp.cuda.Stream(non_blocking=True, priority=cp.cuda.runtime.deviceGetStreamPriorityRange()[1])
    except (TypeError, AttributeError):
        hi = cp.cuda.Stream(non_blocking=True)
    lo = cp.cuda.Stream(non_blocking=True)
    rows = []
    with hi:
        rows.append(("passes", timed(cp, lambda: P.launch(stream=hi), a.reps)))
        rows.append(("optimizer", timed(cp, lambda: O.launch(stream=hi), a.reps)))
        rows.append(("passes then optimizer (a step)", timed(cp, lambda: (P.launch(stream=hi), O.launch(stream=hi)),
                                                             a.reps)))

        def both():  # the optimizer on the other stream, joined at the end of each pair
            e = cp.cuda.Event()
            e.record(hi)
            lo.wait_event(e)
            O.launch(stream=lo)
            P.launch(stream=hi)
            f = cp.cuda.Event()
            f.record(lo)
            hi.wait_event(f)
        rows.append(("both at once (racing: a bound only)", timed(cp, both, a.reps)))
    df = pd.DataFrame(rows, columns=["replay", "ms"]).set_index("replay")
    serial = df.loc["passes then optimizer (a step)", "ms"]
    df["vs a step (ms)"] = df["ms"] - serial
    print(f"\n{a.exp} {a.precision} B={a.batch}, {a.reps} replays each")
    print(df.to_string(float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
