"""Where a training step's time goes between its kernels: the step's own CUDA graphs replayed under
CUPTI, every kernel's start and end on the device, and the idle time between each kernel and the next.

    python dev/step_timeline.py --exp ANDREA-120M --precision fp16 --batch 8 [--replays 5] [--hoist] [--csv out.csv]
        [--set ATTR=VALUE]

`python -m andrea.bench --floor` puts each backend call's device time (each call captured and
replayed alone) against its floor, and calls what is left of the step "outside its kernels". This
says where that is: the Engine's last step's two graphs (the passes, then the optimizer) are
replayed --replays times back to back, as the benchmark's steps run, inside torch.profiler (CUPTI
records every kernel of the process, CuPy's and those inside graphs included); then the same for
--replays calls of Engine.train_step, and with --hoist for the passes' graph with cuBLASLt's 4-byte
memsets moved beside the kernel before them by dev/graph_probe.py's edit (full edges; the backend's
own edit, andrea/backends/cuda/graph_edit.py, on by default, has already replaced those memsets by
kernel nodes, so --hoist finds them with --set graph_edits=0). Each run is also timed
between CUDA events without the profiler, before and after the profiled runs. Per step it prints
the period (one replay of both graphs), the kernels' summed durations, and the gaps (the device
idle between one kernel's end and the next one's start), summed by the kind of boundary: our
kernels (the `__global__` names of kernels/*.cu) against library kernels (cuBLAS/cuBLASLt) and
memsets/copies, then the largest gaps by (kernel before, kernel after), and the kernels' in-graph
durations by name. A negative gap is an overlap (the next kernel started while the one before ran:
programmatic dependent launch, or a second stream); it is summed apart. Needs a CUDA GPU, CuPy and
torch (for the profiler).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "dev"))


def our_kernel_names(kernel_dir: Path = ROOT / "kernels") -> set:
    """The names of every `__global__` function in kernel_dir's .cu files."""
    pat = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
    names = set()
    for f in sorted(kernel_dir.glob("*.cu")):
        names.update(pat.findall(f.read_text()))
    return names


def kind_of(name: str, cat: str, ours: set) -> str:
    """"ours", "memset", "memcpy" or "library" for one device event."""
    if cat == "gpu_memset":
        return "memset"
    if cat == "gpu_memcpy":
        return "memcpy"
    base = re.sub(r"^void\s+", "", name.strip()).split("<")[0].split("(")[0].strip()
    return "ours" if base in ours else "library"


def timeline(dev: pd.DataFrame, ours: set, replays: int) -> pd.DataFrame:
    """dev (name, cat, ts, dur in us; the device events of `replays` steps) in start order, with
    each event's kind, its successor's name and kind, and the gap from the end of everything
    started so far (this event's end, or a longer one's that began before it) to the next start:
    idle where positive, an overlap where negative (NaN for the last event)."""
    t = dev.sort_values("ts", kind="stable").reset_index(drop=True).copy()
    if len(t) == 0:
        raise SystemExit("step_timeline: the profiler recorded no device events (is CUPTI available?)")
    t["kind"] = [kind_of(n, c, ours) for n, c in zip(t.name, t.cat)]
    t["next_name"] = t.name.shift(-1)
    t["next_kind"] = t.kind.shift(-1)
    t["gap"] = t.ts.shift(-1) - (t.ts + t.dur).cummax()
    return t


def summary(t: pd.DataFrame, replays: int) -> dict:
    """Per-step figures of a timeline (us): the span from the first start to the last end, the
    kernels' summed durations, idle gaps and overlaps."""
    gaps = t.gap.dropna()
    return {"events_per_step": len(t) / replays,
            "span_us": float((t.ts + t.dur).max() - t.ts.min()) / replays,
            "busy_us": float(t.dur.sum()) / replays,
            "idle_us": float(gaps[gaps > 0].sum()) / replays,
            "overlap_us": float(-gaps[gaps < 0].sum()) / replays}


def gaps_by_boundary(t: pd.DataFrame, replays: int) -> pd.DataFrame:
    """Idle time per step by (kind before -> kind after): count a step, summed us, mean us."""
    g = t.dropna(subset=["gap"]).assign(boundary=lambda d: d.kind + " -> " + d.next_kind,
                                         idle=lambda d: d.gap.clip(lower=0))
    out = g.groupby("boundary").idle.agg(["count", "sum", "mean"])
    out = out.assign(per_step=out["count"] / replays, us_per_step=out["sum"] / replays,
                     us_each=out["mean"])[["per_step", "us_per_step", "us_each"]]
    return out.sort_values("us_per_step", ascending=False)


def short(name, n: int = 48) -> str:
    name = str(name)
    return name if len(name) <= n else name[:n - 3] + "..."


def largest_gaps(t: pd.DataFrame, replays: int, n: int = 25) -> pd.DataFrame:
    """The (kernel before, kernel after) pairs with the most idle time per step."""
    g = t.dropna(subset=["gap"]).assign(before=lambda d: d.name.map(short), after=lambda d: d.next_name.map(short),
                                         idle=lambda d: d.gap.clip(lower=0))
    out = g.groupby(["before", "after"]).idle.agg(["count", "sum", "mean"])
    out = out.assign(per_step=out["count"] / replays, us_per_step=out["sum"] / replays,
                     us_each=out["mean"])[["per_step", "us_per_step", "us_each"]]
    return out.sort_values("us_per_step", ascending=False).head(n)


def kernels_by_name(t: pd.DataFrame, replays: int, n: int = 30) -> pd.DataFrame:
    out = t.assign(kernel=t.name.map(short)).groupby(["kind", "kernel"]).dur.agg(["count", "sum", "mean"])
    out = out.assign(per_step=out["count"] / replays, us_per_step=out["sum"] / replays,
                     us_each=out["mean"])[["per_step", "us_per_step", "us_each"]]
    return out.sort_values("us_per_step", ascending=False).head(n)


def record(exp, precision, B, replays, settings=None, warmup=4, hoist=False):
    """{label: device events of `replays` steps}, {label: ms a step between CUDA events, timed
    before and after the profiled runs}: the last step's two graphs replayed (with hoist, also
    the passes' graph with cuBLASLt's memsets moved beside the kernel before them, as
    dev/graph_probe.py --hoist makes it), and Engine.train_step."""
    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    from andrea.bench.step import warmed_engine
    from profile_kernels import trace_events

    eng, train_step, graphs = warmed_engine(exp, precision, B, warmup + 4 * replays + 4, warmup, settings)
    P, O = (graphs()[k] for k in ("passes", "optimizer"))
    stream = cp.cuda.get_current_stream()
    runs = {"graphs replayed": lambda: (P.launch(stream=stream), O.launch(stream=stream))}
    if hoist:
        from andrea.backends.cuda.graph_edit import Driver
        from graph_probe import dot_nodes, hoist_memsets
        drv = Driver()
        dot = P.debug_dot_str()
        edited = drv.clone(P.graph)
        moved = hoist_memsets(drv, edited, dot_nodes(dot.decode() if isinstance(dot, bytes) else dot))
        ex = drv.instantiate(edited)
        bits = []
        for launch in (lambda: P.launch(stream=stream), lambda: drv.launch(ex, stream.ptr)):
            launch()
            stream.synchronize()
            bits.append((eng.grads.get().tobytes(), eng.be.to_numpy(eng.g["losses"]).tobytes()))
        print(f"--hoist: {moved} memsets moved beside the kernel before them; gradients and losses of one "
              f"replay: {'the same bits as the graph replayed' if bits[0] == bits[1] else 'DIFFER'}")
        runs["memsets hoisted"] = lambda: (drv.launch(ex, stream.ptr), O.launch(stream=stream))

    runs["Engine.train_step"] = train_step

    from andrea.backends.cuda.graphs import event_ms

    def timed(fn):
        return event_ms(fn, replays, warmup=2)

    ms = {k: [timed(fn)] for k, fn in runs.items()}
    events = {}
    for k, fn in runs.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                fn()
            cp.cuda.Device().synchronize()
        events[k] = trace_events(prof)[1]
    for k, fn in runs.items():
        ms[k].append(timed(fn))
    return events, ms


def report(t: pd.DataFrame, replays: int, title: str) -> None:
    s = summary(t, replays)
    print(f"\n== {title}: {s['events_per_step']:.0f} device events a step; span {s['span_us'] / 1e3:.3f} ms, "
          f"kernels {s['busy_us'] / 1e3:.3f} ms, idle between them {s['idle_us'] / 1e3:.3f} ms, "
          f"overlapped {s['overlap_us'] / 1e3:.3f} ms")
    fmt = {"per_step": "{:.1f}".format, "us_per_step": "{:.1f}".format, "us_each": "{:.2f}".format}
    print("-- idle by boundary (kind before -> kind after)")
    print(gaps_by_boundary(t, replays).to_string(formatters=fmt))
    print("-- the largest idle boundaries")
    print(largest_gaps(t, replays).to_string(formatters=fmt))
    print("-- kernels by in-graph time")
    print(kernels_by_name(t, replays).to_string(formatters=fmt))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="ANDREA-120M")
    ap.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32", "fp8"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--csv", help="write every device event (with kind, gap and run) here")
    ap.add_argument("--hoist", action="store_true",
                    help="also the passes' graph with cuBLASLt's 4-byte memsets moved beside the kernel before them")
    ap.add_argument("--set", action="append", default=[], metavar="ATTR=VALUE",
                    help="a setting of the backend, as python -m andrea.bench --set takes it (repeatable)")
    a = ap.parse_args(argv)
    try:
        import cupy  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        print(f"step_timeline: needs CuPy and torch on a CUDA GPU ({e})", file=sys.stderr)
        return 2
    from andrea.bench.step import parse_settings
    ours = our_kernel_names()
    events, ms = record(a.exp, a.precision, a.batch, a.replays, parse_settings(a.set), hoist=a.hoist)
    title = f"{a.exp} {a.precision} B={a.batch}" + "".join(f" {s}" for s in a.set)
    for label, (before, after) in ms.items():
        print(f"{title}, {label}: {before:.3f} ms a step between CUDA events before the profiled run, "
              f"{after:.3f} after it")
    tables = []
    for label, dev in events.items():
        t = timeline(dev, ours, a.replays)
        report(t, a.replays, f"{title}, {label}")
        tables.append(t.assign(run=label))
    if a.csv:
        pd.concat(tables).to_csv(a.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
