"""Settings of the CUDA backend timed against each other in one process, interleaved.

    python dev/ab_settings.py --exp ANDREA-120M --precision fp8 --batch 8 \
        --variant base: --variant t128:fp8_tile_rows=128 \
        --variant ln32:fp8_layernorm_rows=32,fp8_layernorm_warps=16 [--rounds 7 --steps 20] [--json f]

A difference of 0.5 % in a 13 ms step is below what separate jobs (or separate runs of
`python -m andrea.bench` in one job) resolve: clocks and the machine drift between them. Here
every variant (NAME:ATTR=VALUE,...; the same ATTRs as `andrea.bench.step --set`) gets its own backend
and Engine in this one process, is warmed up, and then the variants take turns: each round times
--steps training steps of every variant between CUDA events, in an order rotated round by round.
The host queues a round's steps as training does, without waiting for each step's record (only the
last one's loss is read), so the figures are those of `andrea.bench.step`. The table gives each variant's
median, fastest and slowest round (ms a step), tokens/s at the median, and its difference from the
first variant's median, with the spread of the paired per-round differences. Every variant runs the
same batches in the same order, so settings that claim the same bits must end with the same loss:
the last column says which variants' last loss is bit-equal to the first's (with --replay, the
last loss of the warm-up steps). --replay times the step's two CUDA graphs replayed back to back
instead of Engine.train_step: the device's time alone, without what the host's uploads, launches
and Python add (which varied by up to 0.6 ms a step between rounds on an H200). Needs a CUDA GPU
and CuPy; elsewhere it says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_variant(text: str):
    """"NAME:ATTR=VALUE,ATTR=VALUE" (NAME: for none) -> (NAME, {ATTR: VALUE})."""
    from andrea.bench.step import parse_settings
    name, colon, rest = text.partition(":")
    if not colon or not name.strip():
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME:ATTR=VALUE,... (NAME: for the defaults)")
    items = [t for t in rest.split(",") if t.strip()]
    return name.strip(), parse_settings(items)


def build(cfg, settings):
    """An Engine of cfg on a backend of its own with settings applied."""
    from andrea.bench.step import cuda_backend
    from andrea.core.engine import Engine
    be = cuda_backend(settings)
    return Engine(cfg, backend=be)


def paired(diffs):
    """(median, min, max) of a list, rounded for the table."""
    d = np.asarray(diffs, float)
    return round(float(np.median(d)), 3), round(float(d.min()), 3), round(float(d.max()), 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/ab_settings.py", description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="ANDREA-120M")
    ap.add_argument("--precision", choices=["fp32", "fp16", "bf16", "fp8"], default="fp8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variant", type=parse_variant, action="append", required=True,
                    help="NAME:ATTR=VALUE,... (repeatable; the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="steps a variant times in a round")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--json", help="also write every round's figures here")
    ap.add_argument("--replay", action="store_true",
                    help="time the step's two CUDA graphs replayed (passes, then optimizer) instead of "
                         "Engine.train_step: the device's time alone, without the host's uploads and launches")
    a = ap.parse_args(argv)
    names = [n for n, _ in a.variant]
    if len(set(names)) != len(names):
        raise SystemExit(f"--variant: names repeat ({', '.join(names)}); each needs its own")
    from andrea.backends import cuda_available
    if not cuda_available():
        print("dev/ab_settings.py: needs a CUDA GPU and CuPy; none here", file=sys.stderr)
        return 2
    import cupy as cp
    import pandas as pd

    from andrea.bench.step import TOOL_LR, bench_config, random_batches, spy_graphs
    cfg = bench_config(a.exp, a.precision, a.batch, a.warmup + a.rounds * a.steps, TOOL_LR)  # stationary weights
    engines, used = {}, {}
    for name, settings in a.variant:
        t0 = time.perf_counter()
        engines[name] = build(cfg, settings)
        used[name] = spy_graphs(engines[name])
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s ({settings or 'defaults'})", flush=True)
    m, T = cfg.model, cfg.model.context
    batches = random_batches(m.vocab_size, a.batch, T)
    steps = {n: 0 for n in names}
    last = {}

    def run(name, k):  # k steps queued as training queues them (the host runs ahead); the last's loss read
        eng = engines[name]
        for _ in range(k):
            steps[name] += 1
            rec = eng.train_step(steps[name], [batches[steps[name] % 4]])
        last[name] = rec["loss"]

    for name in names:
        run(name, a.warmup)
        engines[name].be.synchronize()
    step_graphs = {n: [engines[n].graphs.graphs[used[n][k]][0] for k in ("passes", "optimizer")]
                   for n in names} if a.replay else {}

    def replay(name, k):  # k replays of the graphs of the variant's last step, back to back
        for _ in range(k):
            for g in step_graphs[name]:
                g.launch(stream=cp.cuda.get_current_stream())
    timed_run = replay if a.replay else run
    rounds = []
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            timed_run(name, a.steps)
            end.record()
            end.synchronize()
            rounds.append({"round": r, "variant": name, "ms": cp.cuda.get_elapsed_time(start, end) / a.steps})
        print(f"round {r}: " + ", ".join(f"{x['variant']} {x['ms']:.3f}" for x in rounds[-len(names):]), flush=True)
    df = pd.DataFrame(rounds)
    wide = df.pivot(index="round", columns="variant", values="ms")[names]
    base = names[0]
    tab = pd.DataFrame({"median ms": wide.median(), "min": wide.min(), "max": wide.max()})
    tab["tok/s"] = (a.batch * T / (tab["median ms"] / 1e3)).round().astype(int)
    tab["vs " + base + " (ms)"] = [paired(wide[n] - wide[base]) for n in names]
    tab["vs %"] = (100 * (tab["median ms"] / tab.loc[base, "median ms"] - 1)).round(2)
    bits = {n: np.float32(last[n]).tobytes() for n in names}
    tab["last loss"] = [f"{last[n]:.6f}" + (" =" if bits[n] == bits[base] else " !=") for n in names]
    tab["settings"] = [json.dumps(dict(a.variant)[n]) for n in names]
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(tab.to_string(float_format=lambda v: f"{v:.3f}"))
    print(f"({a.rounds} rounds of {a.steps} steps each, {a.exp} {a.precision} B={a.batch} T={T}; "
          f"'vs' is the median (min, max) of the paired per-round differences; '=' a last loss with "
          f"{base}'s bits)")
    if a.json:
        Path(a.json).write_text(json.dumps({"rounds": rounds, "settings": dict(a.variant),
                                            "last_loss": last}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
