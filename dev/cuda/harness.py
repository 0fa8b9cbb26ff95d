"""Kernel variants: check a dev/cuda/<op>_vN.cu against the NumPy reference, then time it.

    python dev/cuda/harness.py layernorm                # kernels/layernorm.cu and every layernorm_v*.cu here
    python dev/cuda/harness.py attention v4 --dtype fp16,bf16 --reps 50
    python dev/cuda/harness.py mlp main v1 --no-time    # "main" is the file in kernels/ today
    python dev/cuda/harness.py layernorm main v2 --exp ANDREA-12M   # timed at ANDREA-12M's step shapes

OP is a kernel file of kernels/ (embed, layernorm, linear, attention, mlp, residual, loss, optim).
A variant <op>_vN.cu is a drop-in replacement of kernels/<op>.cu: the CUDA backend's launchers
run it in place of that file (same kernel names and arguments). Where a variant needs another
launch, <op>_vN.py next to it defines functions k_*(be, *args) that replace those launchers for
that variant. For every variant, compute dtype and kernel of the op, the harness runs the kernel
on random odd-sized inputs against backends.ref in float64 (the error is norm(got - ref) / norm(ref)
of every output it writes or adds to, the largest one shown), then times it at ANDREA-120M's
step shapes, or another experiment's with --exp (the call captured as a CUDA graph, replayed
--reps times between CUDA events).
Exit status 1 if any check fails. README.md here has the conventions.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TOL = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 3e-2}  # as the kernel tests in tests/cuda/


def load(path: Path, name: str):
    """A Python file of dev/cuda as a module (the directory is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


cases = load(HERE / "cases.py", "dev_cuda_cases")


def np_dtype(precision: str):
    if precision == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp32": np.float32, "fp16": np.float16}[precision])


def kind_dtype(kind: str, dt):
    return {"ct": dt, "f32": np.dtype(np.float32), "f64": np.dtype(np.float64), "i32": np.dtype(np.int32),
            "u64": np.dtype(np.uint64)}[kind]


def rel_err(got, want) -> float:
    if not np.all(np.isfinite(got)):
        return float("inf")
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (den if den > 0 else 1.0))


def device_array(be, x, dtype):
    a = be.empty(np.shape(x), dtype)
    be.upload(a, np.asarray(x).astype(dtype))
    return a


def check_case(be, case, precision: str, rng):
    """(largest relative error over the outputs, its tolerance, which output) of one kernel
    call on be against backends.ref in float64."""
    from andrea.backends import ref
    dt = np_dtype(precision)
    size = case.size or cases.CHECK_SIZE
    args = case.make(rng, dt, size)
    host = []
    for a in args:
        if isinstance(a, cases.In):
            host.append(a.x)
        elif isinstance(a, (cases.Out, cases.Scratch)):
            host.append(np.zeros(a.shape))
        elif isinstance(a, cases.Acc):
            host.append(np.zeros(a.want_shape))
        elif isinstance(a, cases.InOut):
            host.append(a.x.copy())
        else:
            host.append(a)
    getattr(ref, case.kernel)(*host, **case.kwargs)
    dev, pre = [], {}
    for i, a in enumerate(args):
        if isinstance(a, (cases.In, cases.InOut)):
            dev.append(device_array(be, a.x, kind_dtype(a.kind, dt)))
        elif isinstance(a, cases.Out):
            d = be.empty(a.shape, kind_dtype(a.kind, dt))
            d.fill(np.nan)  # an element the kernel does not write fails the check
            dev.append(d)
        elif isinstance(a, cases.Scratch):
            dev.append(be.empty(a.shape, kind_dtype(a.kind, dt)))
        elif isinstance(a, cases.Acc):  # prefilled, so a kernel that writes instead of adding fails
            adt = kind_dtype(a.kind, dt)
            scale = float(np.sqrt(np.mean(host[i] ** 2))) or 1.0
            pre[i] = cases.rnd(rng, a.want_shape, adt, scale)
            dev.append(device_array(be, pre[i], adt))
        else:
            dev.append(a)
    getattr(be, case.kernel)(*dev, **case.kwargs)
    be.synchronize()
    worst = (0.0, TOL[precision], "")
    for i, a in enumerate(args):
        if not isinstance(a, (cases.Out, cases.Acc, cases.InOut)):
            continue
        got = be.to_numpy(dev[i]).astype(np.float64) - (pre[i] if i in pre else 0.0)
        err, tol = rel_err(got, host[i]), a.tol if a.tol is not None else TOL[precision]
        if err / tol > worst[0] / worst[1] or not np.isfinite(err):
            worst = (err, tol, f"argument {i}")
    return worst


def time_case(be, case, precision: str, reps: int, rng, size=None) -> float:
    """Milliseconds per call at size (default TIME_SIZE): the call captured as a graph and
    replayed reps times (device time without Python's launch overhead). Inputs are random;
    nothing is checked."""
    size = size or cases.TIME_SIZE
    dt = np_dtype(precision)
    args = []
    for a in case.make(cases.TimingRng(rng), dt, size):
        if isinstance(a, (cases.In, cases.InOut)):
            args.append(device_array(be, a.x, kind_dtype(a.kind, dt)))
        elif isinstance(a, (cases.Out, cases.Scratch)):
            args.append(be.zeros(a.shape, kind_dtype(a.kind, dt)))
        elif isinstance(a, cases.Acc):
            args.append(be.zeros(a.want_shape, kind_dtype(a.kind, dt)))
        else:
            args.append(a)
    fn = getattr(be, case.kernel)
    fn(*args, **case.kwargs)  # compiles, allocates workspace, creates the cuBLAS handle: not allowed in a capture
    be.synchronize()
    graph = be.capture(lambda: fn(*args, **case.kwargs))
    try:
        import cupy as cp
        if not isinstance(args[0], cp.ndarray):
            raise ImportError
    except ImportError:  # the NumPy backend: wall time
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.launch()
        return (time.perf_counter() - t0) / reps * 1e3
    from andrea.backends.cuda.graphs import replay_ms
    return replay_ms(graph, cp.cuda.Stream(non_blocking=True), reps)


def exp_size(exp: str, batch=None) -> dict:
    """The timing size of an experiment's training step: B = its train.batch_size (or batch),
    T = its train.seq_len, C, NH and V from its model."""
    from andrea.pipeline.compose import compose_config
    from andrea.paths import experiments
    if exp not in experiments():
        raise SystemExit(f"--exp {exp}: no such experiment (conf/experiment/ has {', '.join(experiments())})")
    cfg = compose_config(exp)
    m = cfg.model
    return {"B": batch or cfg.train.batch_size, "T": cfg.train.seq_len, "C": m.d_model, "NH": m.n_head,
            "V": m.vocab_size}


def variants(op: str, names):
    """[(label, path or None for kernels/<op>.cu, sidecar path or None)]."""
    found = sorted(HERE.glob(f"{op}_v*.cu"), key=lambda p: int(p.stem.rsplit("_v", 1)[1]))
    wanted = names or ["main"] + [p.stem.rsplit("_", 1)[1] for p in found]
    out = []
    for n in wanted:
        if n in ("main", "v0"):
            out.append(("main", None, None))
            continue
        path = HERE / f"{op}_{n}.cu"
        if not path.is_file():
            have = ", ".join(p.stem for p in found) or "none"
            raise SystemExit(f"{path}: no such variant of {op} (variants here: {have}; 'main' is kernels/{op}.cu)")
        side = path.with_suffix(".py")
        out.append((n, path, side if side.is_file() else None))
    return out


def make_backend(op: str, path, sidecar, attention: str, settings=None):
    from andrea.bench.step import cuda_backend
    be = cuda_backend(settings, attention=attention, sources={f"{op}.cu": path} if path else None)
    if sidecar is not None:
        mod = load(sidecar, f"dev_cuda_{sidecar.stem}")
        for name in dir(mod):
            if name.startswith("k_"):
                if not hasattr(be, name):
                    raise SystemExit(f"{sidecar}: {name} is not a kernel of the backend interface")
                setattr(be, name, types.MethodType(getattr(mod, name), be))
    return be


def run(op, names, precisions, reps, timing, attention="fused", seed=0, backend=None, time_size=None):
    """The table (a pandas DataFrame) of every variant x dtype x kernel of op. backend: a
    function (label, path, sidecar) -> backend object (default: CudaBackend with the variant)."""
    import pandas as pd
    if op not in cases.CASES:
        raise SystemExit(f"op {op!r}: expected one of {', '.join(cases.CASES)}")
    rows = []
    for label, path, side in variants(op, names):
        be = backend(label, path, side) if backend else make_backend(op, path, side, attention)
        for prec in precisions:
            for i, case in enumerate(cases.CASES[op]):
                rng = np.random.default_rng([seed, i])
                err, tol, where = check_case(be, case, prec, rng)
                size = case.size or cases.CHECK_SIZE
                row = {"variant": label, "dtype": prec, "kernel": case.label,
                       "check size": "B{B} T{T} C{C} NH{NH} V{V}".format(**size),
                       "rel err": err, "tol": tol, "ok": bool(err < tol), "worst": where}
                if timing:
                    row["ms"] = time_case(be, case, prec, reps, np.random.default_rng([seed, i, 1]), time_size)
                rows.append(row)
    df = pd.DataFrame(rows)
    if timing and len(df):
        base = df[df.variant == df.variant.iloc[0]].set_index(["dtype", "kernel", "check size"])["ms"]
        df["speed-up"] = base.reindex(pd.MultiIndex.from_frame(df[["dtype", "kernel", "check size"]])).to_numpy() / df["ms"]
    return df


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/cuda/harness.py", description=__doc__.splitlines()[0])
    ap.add_argument("op", help="kernel file: " + ", ".join(cases.CASES))
    ap.add_argument("variants", nargs="*", help="main (kernels/<op>.cu) and/or vN (dev/cuda/<op>_vN.cu); "
                                                "default: main and every variant here")
    ap.add_argument("--dtype", default="fp32,fp16", help="comma list of fp32, fp16, bf16 (the GPU tests "
                                                       "check bf16 for attention only)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--no-time", action="store_true", help="check only")
    ap.add_argument("--attention", choices=["fused", "materialised"], default="fused")
    ap.add_argument("--time-size", default="8,1024,768,12,50304", help="B,T,C,NH,V of the timing "
                                                                     "(default: ANDREA-120M's benchmark step, B=8)")
    ap.add_argument("--exp", help="time at this experiment's step shapes instead (its batch_size, seq_len "
                                  "and model), e.g. ANDREA-12M")
    ap.add_argument("--batch", type=int, help="with --exp: B instead of the experiment's batch_size")
    ap.add_argument("--set", action="append", default=[], metavar="ATTR=VALUE",
                    help="a tuning value of every backend, as python -m andrea.bench --set takes it, "
                         "e.g. --set ln_blocks=528 (repeatable)")
    a = ap.parse_args(argv)
    precisions = a.dtype.split(",")
    for p in precisions:
        if p not in TOL:
            raise SystemExit(f"--dtype {p}: expected fp32, fp16 or bf16")
    import pandas as pd
    if a.batch is not None and (a.exp is None or a.batch < 1):
        raise SystemExit(f"--batch {a.batch}: expected a positive B together with --exp")
    if a.exp:
        time_size = exp_size(a.exp, a.batch)
    else:
        try:
            B, T, C, NH, V = (int(x) for x in a.time_size.split(","))
        except ValueError:
            raise SystemExit(f"--time-size {a.time_size}: expected five integers B,T,C,NH,V")
        time_size = {"B": B, "T": T, "C": C, "NH": NH, "V": V}
    from andrea.bench.step import parse_settings
    settings = parse_settings(a.set)

    def backend(label, path, side):
        return make_backend(a.op, path, side, a.attention, settings)
    df = run(a.op, a.variants, precisions, a.reps, not a.no_time, a.attention,
             backend=backend, time_size=time_size)
    if not a.no_time:
        print("timed at " + " ".join(f"{k}={v}" for k, v in time_size.items()) + (f" ({a.exp})" if a.exp else ""))
    with pd.option_context("display.width", 200, "display.max_rows", 500, "display.float_format", "{:.4g}".format):
        print(df.to_string(index=False))
    bad = df[~df.ok]
    if len(bad):
        print(f"{len(bad)} check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
