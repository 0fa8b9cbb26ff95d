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
   beside the next step's forward pass could gain;
3. --hoist: the passes' graph with each 4-byte memset (cuBLASLt's, before some of its products)
   moved up beside the kernel before it (its dependencies become that kernel's; the kernel still
   precedes the product), instantiated through the driver API and timed against the graph as
   captured; the gradients and losses of one replay of each are compared bit for bit;
4. Engine.train_step timed as training queues it (the host ahead), alternated with the bare
   replays of its two graphs on the same stream: what the uploads, the download and the launches
   add to a step.

Needs a CUDA GPU and CuPy; elsewhere it says so and exits 2.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EDGE = re.compile(r'"[^"]*node_(\d+)"\s*->\s*"[^"]*node_(\d+)"')
NODE_TYPES = ("MEMSET", "MEMCPY", "EVENT_RECORD", "EVENT_WAIT", "HOST", "EMPTY", "GRAPH", "MEM_ALLOC",
              "MEM_FREE", "CONDITIONAL", "BATCH_MEM_OP")


def census(dot: str):
    """(types, kernels, after_memset): node counts by type (a kernel node's label is its
    function's name), kernel nodes by name, and the names of the nodes that follow a memset."""
    labels = dot_nodes(dot)
    kind = [a if a in NODE_TYPES else "KERNEL" for a, _ in labels]
    types = Counter(kind)
    kernels = Counter(a for (a, _), k in zip(labels, kind) if k == "KERNEL")
    after = Counter(labels[int(b)][0] for a, b in EDGE.findall(dot)
                    if int(a) < len(kind) and int(b) < len(kind) and kind[int(a)] == "MEMSET")
    return types, kernels, after

def dot_nodes(dot: str):
    """[(label's first line, second line)] of the DOT's nodes in their order (node_0, node_1, ...)."""
    found = {int(i): re.split(r"\n|\\n", label) for i, label in
             re.findall(r'"[^"]*node_(\d+)"\[[^\]]*?label="([^"]*)"', dot, re.S)}
    # a label is "index / name / arguments"; a node whose label has another form is named "?"
    out = []
    for i in range(max(found, default=-1) + 1):
        lines = found.get(i, ["", "?"])
        out.append((lines[1].strip() if len(lines) > 1 else "?", lines[2].strip() if len(lines) > 2 else ""))
    return out


def hoist_memsets(drv, g, labels):
    """In graph g: every 4-byte memset whose one predecessor K is not a cuBLASLt product takes K's
    predecessors as its own, and K precedes the memset's successors directly. Returns how many."""
    nodes = drv.nodes(g)
    kinds = [drv.kind(n) for n in nodes]
    if [k == 2 for k in kinds] != [a == "MEMSET" for a, _ in labels]:
        raise RuntimeError("the driver's node order is not the DOT's: cannot name the nodes")
    index = {n: i for i, n in enumerate(nodes)}
    moved = 0
    for i, n in enumerate(nodes):
        if kinds[i] != 2 or labels[i][1] != "(0,4)":
            continue
        pre = [q for q, _ in drv.preds(n)]
        if len(pre) != 1 or labels[index[pre[0]]][0].startswith("nvjet"):
            continue
        k = pre[0]
        drv.edge(g, k, n, add=False)
        for q, _ in drv.preds(k):
            drv.edge(g, q, n)
        for s, _ in drv.succs(n):
            drv.edge(g, k, s)
        moved += 1
    return moved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/graph_probe.py", description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="ANDREA-120M")
    ap.add_argument("--precision", choices=["fp32", "fp16", "bf16", "fp8"], default="fp8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="graph-probe", help="folder for the DOT files")
    ap.add_argument("--hoist", action="store_true", help="also time the passes with the memsets hoisted")
    a = ap.parse_args(argv)
    from andrea.backends import cuda_available
    if not cuda_available():
        print("dev/graph_probe.py: needs a CUDA GPU and CuPy; none here", file=sys.stderr)
        return 2
    import cupy as cp
    import pandas as pd

    from andrea.backends.cuda.graphs import event_ms
    from andrea.bench.step import warmed_engine
    eng, train_step, last_graphs = warmed_engine(a.exp, a.precision, a.batch, 16, warmup=4)
    graphs = last_graphs()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for kind, g in graphs.items():
        dot = g.debug_dot_str()
        dot = dot.decode() if isinstance(dot, bytes) else dot
        (out / f"{kind}.dot").write_text(dot)
        types, kernels, after = census(dot)
        print(f"\n== graph {kind}: {sum(types.values())} nodes")
        print(pd.Series(types, name="nodes").sort_values(ascending=False).to_string())
        print(f"-- kernels by name ({sum(kernels.values())}):")
        print(pd.Series(kernels, name="launches").sort_values(ascending=False).to_string())
        if after:
            print("-- the node after each memset:")
            print(pd.Series(after, name="memsets").sort_values(ascending=False).to_string())

    P, O = graphs["passes"], graphs["optimizer"]
    # the passes at the device's highest priority: a number below every device's range, which
    # cudaStreamCreateWithPriority clamps to its greatest (CuPy's runtime module has no
    # deviceGetStreamPriorityRange)
    hi = cp.cuda.Stream(non_blocking=True, priority=-(1 << 20))
    lo = cp.cuda.Stream(non_blocking=True)
    rows = []
    with hi:
        rows.append(("passes", event_ms(lambda: P.launch(stream=hi), a.reps)))
        rows.append(("optimizer", event_ms(lambda: O.launch(stream=hi), a.reps)))
        rows.append(("passes then optimizer (a step)", event_ms(lambda: (P.launch(stream=hi), O.launch(stream=hi)),
                                                             a.reps)))
    if a.hoist:
        from andrea.backends.cuda.graph_edit import Driver
        drv = Driver()
        dot = (out / "passes.dot").read_text()
        plain = drv.clone(P.graph)
        edited = drv.clone(P.graph)
        moved = hoist_memsets(drv, edited, dot_nodes(dot))
        ex_plain, ex_edited = drv.instantiate(plain), drv.instantiate(edited)
        print(f"\n--hoist: {moved} memsets moved beside the kernel before them")
        bits = {}
        for name, ex in (("plain", ex_plain), ("hoisted", ex_edited)):
            drv.launch(ex, hi.ptr)
            hi.synchronize()
            bits[name] = (eng.grads.get().tobytes(), eng.be.to_numpy(eng.g["losses"]).tobytes())
        print("--hoist: grads and losses " + ("the same bits" if bits["plain"] == bits["hoisted"] else "DIFFER"))
        with hi:
            for _ in range(3):  # alternated: CuPy's instance of the captured graph, ours, ours hoisted
                rows.append(("passes (CuPy's instance)", event_ms(lambda: P.launch(stream=hi), a.reps)))
                rows.append(("passes (captured, own instance)", event_ms(lambda: drv.launch(ex_plain, hi.ptr), a.reps)))
                rows.append(("passes, memsets hoisted", event_ms(lambda: drv.launch(ex_edited, hi.ptr), a.reps)))
    # the same graphs as training queues them: Engine.train_step (uploads, both graphs, the
    # record's download; the host runs ahead), alternated with the bare replays of the two graphs
    def steps():
        for _ in range(a.reps):
            rec = train_step()
        return rec
    for _ in range(3):
        rows.append(("passes then optimizer (a step)", event_ms(lambda: (P.launch(), O.launch()), a.reps)))
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        rec = steps()
        e1.record()
        rec["loss"]
        rows.append(("Engine.train_step", cp.cuda.get_elapsed_time(e0, e1) / a.reps))
    with hi:  # last: the race leaves the weights and gradients as they fall

        def both():  # the optimizer on the other stream, joined at the end of each pair
            e = cp.cuda.Event()
            e.record(hi)
            lo.wait_event(e)
            O.launch(stream=lo)
            P.launch(stream=hi)
            f = cp.cuda.Event()
            f.record(lo)
            hi.wait_event(f)
        rows.append(("both at once (racing: a bound only)", event_ms(both, a.reps)))
    df = pd.DataFrame(rows, columns=["replay", "ms"]).reset_index(drop=True)
    serial = float(df.loc[df.replay == "passes then optimizer (a step)", "ms"].iloc[0])
    df["vs a step (ms)"] = df["ms"] - serial
    print(f"\n{a.exp} {a.precision} B={a.batch}, {a.reps} replays each")
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
