"""Benchmark: time training steps of the engine on the GPU, with a per-kernel breakdown.

    python -m andrea.bench --exp ANDREA-120M --precision fp16 --batch 8 --steps 20 \
        [--anchor [path/to/torch_gpt.py]] [--floor] [--json out.json]

Builds the Engine for the experiment's model shape (conf/model/<exp>.yaml) at T = context, runs
warm-up steps on fixed random tokens, then times --steps steps between CUDA events and prints
tokens/s, ms/step, TFLOP/s (6N + 6*L*T*d per token, as the PyTorch anchor counts), the memory plan
against what the device holds, the device time of forward + backward captured as one CUDA graph,
and where the time goes (each backend call captured as its own graph and replayed between CUDA
events, so Python's launch overhead is left out). With --anchor it runs the PyTorch anchor in a
subprocess of the same job and prints our speed as a ratio of each anchor mode and precision; the
anchor is benchmarks/torch_gpt.py of this checkout unless a path is given. --anchor-precision
(a comma list, default --precision; bf16 for --precision fp8, the 16-bit anchor) picks the
anchor's precisions: fp8 is PyTorch bf16 with torchao's float8 training of the linear layers
(torch_gpt.py --fp8 torchao), labelled "pytorch float8 via torchao ..." in the table.
--anchor-runs N runs each anchor N times, each in a process of its own (its own compilation), and
takes the fastest: PyTorch's best in this job, labelled "best of N", with every run's tokens/s in
the JSON (runs_tok_s). It needs a CUDA GPU and CuPy; elsewhere it says so and exits 2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from .common import model_dict

ANCHOR_SHAPES = {"ANDREA-120M": "120m", "ANDREA-12M": "12m", "ANDREA-tiny": "tiny"}  # torch_gpt.py's --shape names
# the repository's PyTorch anchor (a clone or an editable install has it; a wheel does not)
DEFAULT_ANCHOR = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_gpt.py"
# the anchor's precision -> torch_gpt.py's arguments; fp8: bf16 with torchao's float8 linear layers
ANCHOR_ARGS = {"fp32": ["--dtype", "float32"], "fp16": ["--dtype", "float16"], "bf16": ["--dtype", "bfloat16"],
               "fp8": ["--dtype", "bfloat16", "--fp8", "torchao"]}


@contextlib.contextmanager
def pass_closed_by(be, start, closer):
    """be.param_grad_pass(start=start), whose close (a function of no arguments) is handed to
    closer, which runs it: how GraphTimed times the close, and dev/profile_kernels.py annotates it.
    An exception in the block closes it at once."""
    ctx = be.param_grad_pass(start=start)
    ctx.__enter__()
    try:
        yield
    except BaseException:
        ctx.__exit__(*sys.exc_info())
        raise
    closer(lambda: ctx.__exit__(None, None, None))


class GraphTimed:
    """The backend, with every k_* call captured into its own CUDA graph: launched once (so the
    step goes on), then replayed REPS times between CUDA events. That is the device time of the
    call alone, without Python's launch overhead. The replays repeat each call's effect (the
    backward kernels add again), so the numbers of a profiled step are garbage: profile last.
    The close of the backward's param_grad_pass (the column sums it held back) is timed the same
    way, as "param_grad_pass"."""

    REPS = 5

    def __init__(self, be):
        import cupy as cp
        self._be, self.ms = be, defaultdict(float)
        self.stream = cp.cuda.Stream(non_blocking=True)

    def __getattr__(self, name):
        attr = getattr(self._be, name)
        if not name.startswith("k_"):
            return attr
        return lambda *args, **kw: self._timed(name, attr, args, kw)

    def param_grad_pass(self, start=None):
        return pass_closed_by(self._be, start, lambda close: self._timed("param_grad_pass", close, (), {}))

    def _timed(self, name, fn, args, kw):
        import cupy as cp
        cp.cuda.Stream.null.synchronize()  # fills on the default stream come first
        s = self.stream
        g = self._be.capture(lambda: fn(*args, **kw), s)
        from ..backends.cuda.graphs import replay_ms
        self.ms[name] += replay_ms(g, s, self.REPS)


def spy_graphs(eng) -> dict:
    """{kind: key} of the CUDA graphs eng's steps ran last ("passes", "optimizer": the first item
    of a key), kept up to date as eng runs: how a tool finds a step's graphs in eng.graphs to
    replay them (dev/ab_settings.py --replay, dev/graph_probe.py). Every call still runs."""
    used, run = {}, eng._run

    def spied(key, fn):
        used[key[0]] = key
        run(key, fn)
    eng._run = spied
    return used


def graph_step_ms(eng, x, y, reps=5):
    """Device time of one microbatch's forward + backward captured as a single CUDA graph (what
    the step costs once Python launch overhead is gone)."""
    import cupy as cp

    from ..core import model
    eng.be.write(eng.g["tokens"], x)
    eng.be.write(eng.g["targets"], y)
    cp.cuda.Stream.null.synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    n_head = eng.cfg.model.n_head

    def passes():
        model.forward(eng.be, eng.p, eng.layers, eng.g, n_head, loss=False)
        model.backward(eng.be, eng.p, eng.dp, eng.layers, eng.g, n_head, eng.dloss, start=eng.grads)
    from ..backends.cuda.graphs import replay_ms
    return replay_ms(eng.be.capture(passes, s), s, reps)


def profile_step(eng, x, y):
    """Per-kernel device time of one full step (forward, backward, the optimizer kernels)."""
    from ..core import model
    return _profile_calls(eng, eng.be, x, y, model)


def _profile_calls(eng, be, x, y, model):
    gt = GraphTimed(be)
    be.write(eng.g["tokens"], x)
    be.write(eng.g["targets"], y)
    n_head = eng.cfg.model.n_head
    model.forward(gt, eng.p, eng.layers, eng.g, n_head, loss=False)
    model.backward(gt, eng.p, eng.dp, eng.layers, eng.g, n_head, eng.dloss, start=eng.grads)  # a first pass
    gt.k_loss_accum(eng.optim_state, eng.g["losses"])
    t, parts = eng.cfg.train, eng.bufs["norm_partials"]
    gt.k_grad_norm_partial(parts, eng.grads)
    gt.k_step_check(eng.optim_state, eng.dloss, parts, 1, x.size, t.beta1, t.beta2, t.weight_decay,
                    t.grad_clip, t.precision == "fp16", 2000, 2.0 ** 24)
    # the replays above may leave a non-finite norm (a skipped step): time a full update
    from ..backends.interface import S_CLIP, S_DECAY, S_SKIP, S_STEP_SIZE, S_VHAT
    for slot, value in ((S_SKIP, 0.0), (S_CLIP, 1e-3), (S_DECAY, 1.0), (S_STEP_SIZE, 1e-8), (S_VHAT, 1.0)):
        eng._set(slot, value)
    gt.k_adamw_step(eng.params, eng.params_c, eng.grads, eng.m, eng.v, eng.optim_state, t.beta1,
                    t.beta2, t.eps, eng.layout.n_decay, zero_grads=False)
    if eng.fp8_cache:  # the FP8 copies of the weights, rewritten after the update
        gt._timed("fp8_weight_cache", eng.be.refresh_fp8_weight_cache, (), {})
    be.synchronize()
    return dict(gt.ms)


def bench_config(exp, precision, B, steps, lr=None):
    """The run config of a benchmark: exp's model at T = its context, B sequences, no warm-up of
    the lr (lr: its peak, default the experiment's)."""
    from ..config import load_run_config

    m = model_dict(exp)
    train = {"batch_size": B, "seq_len": m["context"], "precision": precision, "steps": steps, "warmup_steps": 0}
    if lr is not None:
        train.update(lr=lr, min_lr=lr)
    return load_run_config({"exp": exp, "model": m, "backend": {"name": "cuda"}, "train": train})


BACKEND_SWITCHES = ("pdl", "graph_edits")  # the CUDA backend's own on/off options --set takes (0 or 1)


def backend_settings(settings) -> tuple:
    """--set's settings as (options of the CUDA backend's constructor, the run's FP8 settings): a
    field of its Tuning (the launch geometry, e.g. ln_blocks=528) goes into its tuning; pdl
    (programmatic dependent launch) and graph_edits (cuda/graph_edit.py), each 0 or 1, are its own
    options (BACKEND_SWITCHES); fp8_classifier, fp8_dlogits, fp8_dlogits_rounding and fp8_scaling
    are the run's FP8 settings (be.set_fp8_run). An unknown name, or a value its field does not
    take, is an error naming it."""
    import dataclasses

    from ..backends.cuda.backend import FP8_RUN_DEFAULTS
    from ..backends.cuda.tuning import Tuning

    settings = dict(settings or {})
    fields = [f.name for f in dataclasses.fields(Tuning)]
    tuning = {k: str(settings.pop(k)) for k in list(settings) if k in fields}
    run = {k: settings.pop(k) for k in list(settings) if k in FP8_RUN_DEFAULTS}
    options = {}
    for name in BACKEND_SWITCHES:
        if name in settings:
            value = str(settings.pop(name))
            if value not in ("0", "1"):
                raise SystemExit(f"--set {name}={value}: expected 0 or 1")
            options[name] = value == "1"
    if settings:
        raise SystemExit(f"--set {', '.join(settings)}: not a setting of the CUDA backend; expected one of "
                         f"{', '.join(fields + list(FP8_RUN_DEFAULTS) + list(BACKEND_SWITCHES))}")
    try:
        options["tuning"] = Tuning().with_settings(tuning)
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None
    return options, run


def cuda_backend(settings=None, **options):
    """A CUDA backend made with --set's settings (backend_settings) and constructor options
    (attention, cublaslt, sources, ...): the benchmark's and the dev/ tools' one way to make one."""
    from ..backends import get_backend

    extra, run = backend_settings(settings)
    be = get_backend("cuda", **options, **extra)
    try:
        be.set_fp8_run(**run)
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None
    return be


def parse_settings(items) -> dict:
    """["ATTR=VALUE", ...] -> {ATTR: VALUE} (an int where VALUE is one, else the text), with an
    error naming the item that is not of that form."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise SystemExit(f"--set {item}: expected ATTR=VALUE, e.g. ln_blocks=528")
        value = value.strip()
        try:
            out[name.strip()] = int(value)
        except ValueError:
            out[name.strip()] = value
    return out


def random_batches(vocab: int, B: int, T: int, n: int = 4):
    """n (inputs, targets) pairs of random tokens, (B, T) int32 each, the same every run: a
    benchmark rotates them (the same tokens every step would flatter the caches)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        xy = rng.integers(0, vocab, (B, T + 1)).astype(np.int32)
        out.append((xy[:, :-1], xy[:, 1:]))
    return out


# The dev tools' learning rate: the weights stay about where they start, so that every round of a
# tool times the same work. At the experiment's own lr, hundreds of steps on four random batches
# diverged at 120M (loss NaN, loss scale 1, every step skipped), and those steps ran 13.1 ms
# against 15.3: less power drawn, higher clocks (the H200 sits at its 700 W cap at 120M).
TOOL_LR = 1e-9


def warmed_engine(exp, precision, B, steps, warmup=4, settings=None, lr=TOOL_LR):
    """(eng, step, graphs): the start the dev tools share. eng is an Engine of bench_config(exp,
    precision, B, steps, lr) on a CUDA backend with --set's settings, after warmup
    Engine.train_step calls on random_batches (the device synchronised); step() queues one more
    (the next step number, the next batch) and returns its record; graphs() gives {kind: the CUDA
    graph of that kind eng's last step ran} ("passes", "optimizer"; spy_graphs)."""
    from ..core.engine import Engine
    cfg = bench_config(exp, precision, B, steps, lr)
    eng = Engine(cfg, backend=cuda_backend(settings))
    used = spy_graphs(eng)
    batches = random_batches(cfg.model.vocab_size, B, cfg.model.context)
    done = [0]

    def step():
        done[0] += 1
        return eng.train_step(done[0], [batches[done[0] % len(batches)]])
    for _ in range(warmup):
        step()
    eng.be.synchronize()
    return eng, step, lambda: {kind: eng.graphs.graphs[key][0] for kind, key in used.items()}


def run_engine(exp, precision, B, steps, warmup, attention="fused", cublaslt=True, settings=None):
    import cupy as cp

    from ..core.engine import Engine

    cfg = bench_config(exp, precision, B, warmup + 2 * steps)
    m, T = cfg.model, cfg.model.context
    be = cuda_backend(settings, attention=attention, cublaslt=cublaslt)
    free0, total = cp.cuda.runtime.memGetInfo()
    eng = Engine(cfg, backend=be)
    batches = random_batches(m.vocab_size, B, T)
    step = 0
    for _ in range(warmup):
        step += 1
        eng.train_step(step, [batches[step % 4]])
    be.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    t0 = time.perf_counter()
    start.record()
    for _ in range(steps):
        step += 1
        rec = eng.train_step(step, [batches[step % 4]])
    end.record()
    end.synchronize()
    wall = time.perf_counter() - t0
    ms = cp.cuda.get_elapsed_time(start, end) / steps
    pool = cp.get_default_memory_pool()
    free1, _ = cp.cuda.runtime.memGetInfo()
    planned = eng.plan.total()
    extra = sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in
                be.workspace_rows(B, T, m.d_model, m.n_head, eng.params_c.dtype, precision == "fp8",
                                  m.n_layer, m.vocab_size))
    graph_ms = graph_step_ms(eng, *batches[0])
    per_kernel = profile_step(eng, *batches[1])
    n = eng.layout.n_params
    tok_s = B * T / (ms / 1e3)
    flops_tok = 6 * n + 6 * m.n_layer * T * m.d_model
    return {"system": "andrea", "exp": exp, "precision": precision, "batch": B, "context": T,
            "attention": be.attention_variant(eng.params_c.dtype, m.d_model // m.n_head),
            "cublaslt": be.used_cublaslt(), "fp8_weight_cache": eng.fp8_cache,
            "fp8_classifier": eng.fp8_classifier, "params": n,
            "ms_step": round(ms, 2), "tok_s": round(tok_s),
            "tflops": round(flops_tok * tok_s / 1e12, 1), "host_ms_step": round(wall / steps * 1e3, 2),
            "loss": rec["loss"], "skipped": eng.skipped,
            "planned_gb": round((planned + extra) / 2**30, 3), "plan_arena_gb": round(planned / 2**30, 3),
            "pool_used_gb": round(pool.used_bytes() / 2**30, 3),
            "device_used_gb": round((free0 - free1) / 2**30, 3),
            "graph_fwd_bwd_ms": round(graph_ms, 2),
            "per_kernel_ms": {k: round(v, 3) for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])}}


def anchor_precisions(text: str) -> list[str]:
    """--anchor-precision's comma list, e.g. "bf16,fp8" -> ["bf16", "fp8"]; an unknown name is an error."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in ANCHOR_ARGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {', '.join(ANCHOR_ARGS)}")
    return names


def run_anchor(path, exp, precisions, B, steps, modes, runs: int = 1):
    """The anchor per precision and mode, each run in its own subprocess, runs times: the fastest
    run's JSON record, with anchor_precision, anchor_mode and runs_tok_s (every run's tokens/s, in
    order) added. A run that fails is reported on stderr and left out; an anchor with no run left
    is left out."""
    out = []
    for precision in precisions:
        for mode in modes:
            compile_, tmode = (0, "default") if mode == "eager" else (1, mode)
            cmd = [sys.executable, path, "--shape", ANCHOR_SHAPES[exp], "--batch", str(B), *ANCHOR_ARGS[precision],
                   "--compile", str(compile_), "--mode", tmode, "--steps", str(steps)]
            recs = []
            for _ in range(runs):
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"anchor {precision} {mode} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
                    continue
                recs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            if not recs:
                continue
            rec = max(recs, key=lambda x: x["tok_s"])
            rec["anchor_precision"], rec["anchor_mode"] = precision, mode
            rec["runs_tok_s"] = [x["tok_s"] for x in recs]
            out.append(rec)
    return out


def anchor_label(a) -> str:
    """The table's name of an anchor row: torchao's FP8 rows say so (they are not our engine)."""
    best = f" best of {len(a['runs_tok_s'])}" if len(a.get("runs_tok_s", ())) > 1 else ""
    if a.get("fp8"):
        return f"pytorch float8 via {a['fp8']} {a['anchor_mode']}{best}"  # e.g. "... via torchao 0.17.0 tensorwise"
    return f"pytorch {a['dtype']} {a['anchor_mode']}{best}"


def table(ours, anchors) -> str:
    """Ours and each anchor: tokens/s, ms per step, TFLOP/s and ours over theirs (ratio), then the memory line."""
    import pandas as pd

    rows = [{"system": f"andrea {ours['precision']} attn {ours['attention']}", **ours}]
    rows += [{"system": anchor_label(a), **a} for a in anchors]
    df = pd.DataFrame(rows).set_index("system")[["tok_s", "ms_step", "tflops"]]
    df["ratio"] = ours["tok_s"] / df["tok_s"]
    text = df.to_string(formatters={"tok_s": "{:,}".format, "ms_step": "{:.2f}".format,
                                    "tflops": "{:.1f}".format, "ratio": "{:.2f}".format},
                        header=["tok/s", "ms/step", "TFLOP/s", "ratio"], index_names=False)
    return text + (f"\nmemory: planned {ours['planned_gb']} GB (arena {ours['plan_arena_gb']} + kernel "
                   f"workspace), CuPy pool {ours['pool_used_gb']} GB, device {ours['device_used_gb']} GB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m andrea.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="ANDREA-120M", help="model shape: conf/model/<exp>.yaml")
    ap.add_argument("--precision", choices=["fp32", "fp16", "bf16", "fp8"], default="fp16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--attention", choices=["fused", "materialised"], default="fused",
                    help="attention version 4 (fused, 16-bit only) or version 1 (scores in memory)")
    ap.add_argument("--attention-only", action="store_true",
                    help="time attention alone at the 12M and 120M shapes against PyTorch SDPA's backends "
                         "(andrea/bench/attention.py) and exit")
    ap.add_argument("--fp8-layers", action="store_true",
                    help="FP8 linear layers alone at --exp's shapes: error against float32 and time against "
                         "fp16, per product (andrea/bench/fp8.py), and exit")
    ap.add_argument("--cublaslt", choices=["on", "off"], default="on",
                    help="matrix-product epilogues through cuBLASLt, or cuBLAS + separate kernels")
    ap.add_argument("--anchor", nargs="?", const=str(DEFAULT_ANCHOR),
                    help="run the PyTorch anchor in this job and print the ratio (default benchmarks/torch_gpt.py)")
    ap.add_argument("--anchor-modes", default="eager,reduce-overhead",
                    help="comma list of eager, default (torch.compile), reduce-overhead")
    ap.add_argument("--anchor-precision", type=anchor_precisions, metavar="LIST",
                    help="comma list of the anchor's precisions, each run in turn: fp32, fp16, bf16 (its best "
                         "16-bit), fp8 (bf16 + torchao's float8 training); default --precision, bf16 for fp8")
    ap.add_argument("--anchor-runs", type=int, default=1, metavar="N",
                    help="run each anchor N times (each its own process and compilation) and take the fastest")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting of the CUDA backend first: a Tuning field (e.g. --set ln_blocks=528), an FP8 "
                         "run setting (e.g. --set fp8_dlogits_rounding=nearest), pdl=0 or graph_edits=0 (repeatable)")
    ap.add_argument("--floor", action="store_true",
                    help="also print each kernel's floor (products at cuBLAS's rate for their shapes, attention at "
                         "the dense peak, other bytes at copy bandwidth) beside ours, largest gap first "
                         "(andrea/bench/floor.py; 16-bit precisions)")
    ap.add_argument("--json", help="also write all figures here")
    a = ap.parse_args(argv)
    settings = parse_settings(a.set)
    if a.anchor_runs < 1:
        print(f"andrea.bench.step: --anchor-runs {a.anchor_runs}: expected 1 or more", file=sys.stderr)
        return 2
    from ..backends import cuda_available

    if not cuda_available():
        print("andrea.bench.step: needs a CUDA GPU and CuPy (pip install -e '.[cuda12]' or '.[cuda13]' on a GPU "
              "machine); none here", file=sys.stderr)
        return 2
    if a.anchor and not Path(a.anchor).is_file():
        print(f"andrea.bench.step: --anchor {a.anchor}: no such file (benchmarks/torch_gpt.py of a clone)", file=sys.stderr)
        return 2
    if a.attention_only:
        if a.precision == "fp32":
            raise SystemExit("--attention-only: --precision must be fp16 or bf16 (SDPA's fused backends are 16-bit)")
        from .attention import report
        print(report(a.precision, a.steps))
        return 0
    if a.fp8_layers:
        from .fp8 import report as fp8_report
        print(fp8_report(a.exp, a.batch, a.steps))
        return 0
    ours = run_engine(a.exp, a.precision, a.batch, a.steps, a.warmup, a.attention, a.cublaslt == "on", settings)
    if settings:
        ours["settings"] = settings
    print("per-kernel device time (ms/step; each call captured as a CUDA graph and replayed):")
    total = sum(ours["per_kernel_ms"].values())
    for k, v in ours["per_kernel_ms"].items():
        print(f"  {k:<22}{v:>9.3f}{100 * v / total:>7.1f}%")
    if a.floor and a.precision in ("fp16", "bf16"):
        from . import floor
        m = bench_config(a.exp, a.precision, a.batch, 1).model
        print(floor.report(m, a.batch, m.context, ours["params"], ours["per_kernel_ms"], ours["ms_step"]))
    elif a.floor:
        print(f"--floor: the floor table is of 16-bit steps; --precision {a.precision} has none", file=sys.stderr)
    anchors = []
    if a.anchor:
        precisions = a.anchor_precision or [{"fp8": "bf16"}.get(a.precision, a.precision)]
        anchors = run_anchor(a.anchor, a.exp, precisions, a.batch, a.steps, a.anchor_modes.split(","), a.anchor_runs)
    if a.json:
        Path(a.json).write_text(json.dumps({"andrea": ours, "anchors": anchors}, indent=1))
    print(json.dumps({k: v for k, v in ours.items() if k != "per_kernel_ms"}))
    print(table(ours, anchors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
