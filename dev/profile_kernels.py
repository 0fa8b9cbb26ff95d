"""Every device kernel of a training step, by backend call: which cuBLAS/cuBLASLt kernels and our own
kernels one `k_*` call launches, how long each runs, and at what rate the matrix products go.

    python dev/profile_kernels.py --exp ANDREA-120M --precision fp16 --batch 8 [--torch bf16] [--csv out.csv]
        [--set ln_blocks=528]

andrea.bench.step gives one figure per backend call; this splits a call into the kernels it launches
(CUPTI, through torch.profiler, which records every kernel of the process, CuPy's included). The
engine runs its steps eagerly here (no CUDA graphs) and waits after every backend call, so each
kernel is attributed to the call that launched it by time; device durations are those the kernels
have inside the graphs; the kernels that close the backward's param_grad_pass (the column sums it
held back) count as the call "param_grad_pass". --set ATTR=VALUE sets an attribute of the backend
first, as dev/cuda/harness.py's does. With --torch DTYPE the repository's PyTorch anchor (benchmarks/torch_gpt.py,
eager, autocast DTYPE) is profiled in the same process for comparison, by kernel name.
Needs a CUDA GPU, CuPy and torch.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
GPU_EVENTS = ("kernel", "gpu_memset", "gpu_memcpy")


def trace_events(prof):
    """The profiler's chrome trace as (annotations, device events) DataFrames (ts, dur in us)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        ev = json.loads(path.read_text())["traceEvents"]
    rows = [{"cat": e.get("cat", ""), "name": e.get("name", ""), "ts": float(e["ts"]), "dur": float(e.get("dur", 0)),
             "grid": str(e.get("args", {}).get("grid", ""))} for e in ev if e.get("ph") == "X"]
    df = pd.DataFrame(rows)
    return df[df.cat == "user_annotation"].sort_values("ts"), df[df.cat.isin(GPU_EVENTS)].sort_values("ts")


def attribute(ann, dev):
    """Each device event gets the annotation (backend call) whose host range holds its start."""
    starts, ends, names = ann.ts.to_numpy(), (ann.ts + ann.dur).to_numpy(), ann.name.to_numpy()
    i = np.searchsorted(starts, dev.ts.to_numpy(), side="right") - 1
    ok = (i >= 0) & (dev.ts.to_numpy() <= ends[np.clip(i, 0, None)] + 1.0)
    out = dev.copy()
    out["call"] = np.where(ok, names[np.clip(i, 0, None)], "(outside any call)")
    return out


class Annotated:
    """The backend with every k_* call inside a profiler range, followed by a device sync; the
    close of a param_grad_pass too."""

    def __init__(self, be):
        self._be = be

    def param_grad_pass(self, start=None):
        import cupy as cp
        from torch.profiler import record_function

        from andrea.bench.step import pass_closed_by

        def closer(close):
            with record_function("param_grad_pass"):
                close()
                cp.cuda.get_current_stream().synchronize()
        return pass_closed_by(self._be, start, closer)

    def __getattr__(self, name):
        attr = getattr(self._be, name)
        if not name.startswith("k_"):
            return attr

        def call(*args, **kw):
            import cupy as cp
            from torch.profiler import record_function
            with record_function(name):
                out = attr(*args, **kw)
                cp.cuda.get_current_stream().synchronize()
            return out
        return call


def profile_andrea(exp, precision, B, steps, settings=None):
    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    from andrea.bench.step import bench_config, cuda_backend
    from andrea.core.engine import Engine

    cfg = bench_config(exp, precision, B, 2 + steps)
    m, T = cfg.model, cfg.model.context
    be = cuda_backend(settings)
    eng = Engine(cfg, backend=be)
    eng._run = lambda key, fn: fn()  # eager: the kernels are those the graphs hold
    rng = np.random.default_rng(0)
    xy = rng.integers(0, m.vocab_size, (B, T + 1)).astype(np.int32)
    batch = [(xy[:, :-1], xy[:, 1:])]
    for s in (1, 2):
        eng.train_step(s, batch)
    cp.cuda.Device().synchronize()
    eng.be = Annotated(eng.be)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in range(3, 3 + steps):
            eng.train_step(s, batch)
        cp.cuda.Device().synchronize()
    ann, dev = trace_events(prof)
    return attribute(ann, dev), eng.layout.n_params


def profile_torch(exp, dtype, B, steps):
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    spec = importlib.util.spec_from_file_location("torch_gpt", ROOT / "benchmarks" / "torch_gpt.py")
    tg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tg)
    L, d, H, ctx, V = tg.SHAPES[{"ANDREA-120M": "120m", "ANDREA-12M": "12m", "ANDREA-tiny": "tiny"}[exp]]
    dt = tg.DTYPES[{"bf16": "bfloat16", "fp16": "float16"}[dtype]]
    torch.manual_seed(0)
    model = tg.GPT(L, d, H, ctx, V).cuda()
    opt = tg.optimizer(model, 3e-4, fused=True)
    x = torch.randint(0, V, (B, ctx), device="cuda")
    y = torch.randint(0, V, (B, ctx), device="cuda")

    def step():
        with record_function("forward"), torch.autocast("cuda", dtype=dt):
            loss = model(x, y)
        with record_function("backward"):
            loss.backward()
            torch.cuda.synchronize()
        with record_function("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ann, dev = trace_events(prof)
    return attribute(ann[ann.name.isin(["forward", "backward", "optimizer"])], dev)


def short(name: str, n: int = 70) -> str:
    return name if len(name) <= n else name[:n - 3] + "..."


def report(df, steps, title):
    df = df.assign(kernel=df.name.map(short))
    per_call = (df.groupby("call").dur.sum() / steps / 1e3).sort_values(ascending=False)
    total = per_call.sum()
    print(f"\n== {title}: device time per step {total:.3f} ms ({len(df) // steps} device events per step)")
    print((pd.DataFrame({"ms": per_call, "share": per_call / total})
           .to_string(formatters={"ms": "{:.3f}".format, "share": "{:.1%}".format})))
    by = (df.groupby(["call", "kernel", "grid"]).dur.agg(["count", "sum", "mean"])
          .assign(n=lambda t: t["count"] / steps, ms=lambda t: t["sum"] / steps / 1e3, us_each=lambda t: t["mean"])
          [["n", "ms", "us_each"]].sort_values("ms", ascending=False))
    print(f"\n-- {title}: kernels by call (the 45 largest)")
    print(by.head(45).to_string(formatters={"n": "{:.0f}".format, "ms": "{:.3f}".format, "us_each": "{:.1f}".format}))
    names = (df.groupby("kernel").dur.agg(["count", "sum"])
             .assign(n=lambda t: t["count"] / steps, ms=lambda t: t["sum"] / steps / 1e3)[["n", "ms"]]
             .sort_values("n", ascending=False))
    print(f"\n-- {title}: kernels by name over all calls (the 20 launched most)")
    print(names.head(20).to_string(formatters={"n": "{:.0f}".format, "ms": "{:.3f}".format}))
    return by


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="ANDREA-120M")
    ap.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32", "fp8"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--torch", choices=["bf16", "fp16"], help="also profile the PyTorch anchor (eager)")
    ap.add_argument("--csv", help="write every kernel event (ours, and the anchor's) here")
    ap.add_argument("--set", action="append", default=[], metavar="ATTR=VALUE",
                    help="a setting of the backend first, as python -m andrea.bench --set takes it, e.g. --set ln_blocks=528 (repeatable)")
    a = ap.parse_args(argv)
    from andrea.bench.step import parse_settings
    settings = parse_settings(a.set)
    ours, n_params = profile_andrea(a.exp, a.precision, a.batch, a.steps, settings)
    title = f"andrea {a.exp} {a.precision} B={a.batch}" + "".join(f" {s}" for s in a.set)
    tables = [report(ours, a.steps, title).assign(system="andrea")]
    if a.torch:
        theirs = profile_torch(a.exp, a.torch, a.batch, a.steps)
        tables.append(report(theirs, a.steps, f"pytorch eager {a.torch} B={a.batch}").assign(system="pytorch"))
    if a.csv:
        pd.concat(tables).to_csv(a.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
