"""The FP8 linear layers at a model's shapes: error against float32 and speed against fp16.

    python -m andrea.bench --fp8-layers [--exp ANDREA-120M] [--batch 8] [--steps 20]

For each linear layer of the model (QKV, attention output, MLP up, MLP down; N = B*T rows) and each
of its three products (forward Y = X W^T, input gradient dX = dY W, weight gradient dW = dY^T X):
the relative error (Frobenius norm of the difference over the reference's) of the FP8 path, with
the output gradient in E4M3 and in E5M2, and of the 16-bit paths (fp16, bf16), all against the
float32 product of the same float32 data (so each path's own input rounding counts). The data:
X ~ N(0, 1) with 1% of its columns (features) 20x larger (the outlier features of layer-norm
outputs), W ~ N(0, 0.02), dY ~ N(0, 1e-3) with the same shape of outliers over rows.
Then the device time of the layer's forward (product + bias) and backward (both products + bias
gradient), each captured as a CUDA graph and replayed, FP8 (quantisation included) against the
fp16 path (pandas table).
"""
from __future__ import annotations

import numpy as np

from .common import model_dict

OUTLIER_FRACTION, OUTLIER_SCALE = 0.01, 20.0


def layer_shapes(exp: str, B: int):
    m = model_dict(exp)
    C, N = m["d_model"], B * m["context"]
    return N, {"qkv": (C, 3 * C), "attn_out": (C, C), "mlp_up": (C, 4 * C), "mlp_down": (4 * C, C)}


def _data(rng, N, IC, OC):
    x = rng.standard_normal((N, IC), dtype=np.float32)
    x[:, rng.random(IC) < OUTLIER_FRACTION] *= OUTLIER_SCALE
    w = (0.02 * rng.standard_normal((OC, IC), dtype=np.float32))
    b = (0.02 * rng.standard_normal(OC, dtype=np.float32))
    dy = 1e-3 * rng.standard_normal((N, OC), dtype=np.float32)
    dy[rng.random(N) < OUTLIER_FRACTION] *= OUTLIER_SCALE
    return x, w, b, dy


def _time(be, fn, reps):
    import cupy as cp
    fn()  # plans, compiles: nothing of that may happen inside a capture
    cp.cuda.Stream.null.synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    from ..backends.cuda.graphs import replay_ms
    return replay_ms(be.capture(fn, stream=s), s, reps)


def run(exp: str = "ANDREA-120M", B: int = 8, reps: int = 20) -> "pandas.DataFrame":  # noqa: F821
    import cupy as cp
    import pandas as pd

    from ..backends import get_backend
    N, layers = layer_shapes(exp, B)
    C = layers["attn_out"][0]
    bf16 = np.dtype("bfloat16")
    be8, be16 = get_backend("cuda"), get_backend("cuda")
    be8.reserve_workspace(B, N // B, C, 1, bf16, fp8=True)
    be16.reserve_workspace(B, N // B, C, 1, np.float16)
    rng = np.random.default_rng(0)
    rows = []
    for name, (IC, OC) in layers.items():
        x, w, b, dy = _data(rng, N, IC, OC)
        gx, gw, gb, gdy = (cp.asarray(a) for a in (x, w, b, dy))
        ref = {"Y": gx @ gw.T + gb, "dX": gdy @ gw, "dW": gdy.T @ gx}  # float32 products (no TF32)
        res = {}
        for path in ("fp8 e4m3", "fp8 e5m2", "bf16", "fp16"):
            dt = np.float16 if path == "fp16" else bf16
            be = be16 if path == "fp16" else be8
            X, W, Bb, DY = (cp.asarray(a.astype(dt)) for a in (x, w, b, dy))
            out = cp.empty((N, OC), dtype=dt)
            dX, dW, db = cp.zeros((N, IC), dtype=dt), cp.zeros((OC, IC), np.float32), cp.zeros(OC, np.float32)
            if path.startswith("fp8"):
                g = path.split()[1]
                be.fp8.k_fp8_linear_fwd(out, X, W, Bb)
                be.fp8.k_fp8_linear_bwd(dX, dW, db, DY, X, W, grad_fmt=g)
            else:
                fp8, be.fp8 = be.fp8, None  # the 16-bit launchers of the same backend
                try:
                    be._linear_fwd("bench", out, X, W, Bb)
                    be._linear_bwd("bench", dX, dW, db, DY, X, W)
                finally:
                    be.fp8 = fp8
            for k, v in (("Y", out), ("dX", dX), ("dW", dW)):
                r = ref[k]
                res[(path, k)] = float(cp.linalg.norm(v.astype(cp.float32) - r) / cp.linalg.norm(r))
        # device time of the whole layer: FP8 (quantisation included) against the fp16 path
        X8, W8, B8, DY8 = (cp.asarray(a.astype(bf16)) for a in (x, w, b, dy))
        X6, W6, B6, DY6 = (cp.asarray(a.astype(np.float16)) for a in (x, w, b, dy))
        o8, o6 = cp.empty((N, OC), dtype=bf16), cp.empty((N, OC), dtype=np.float16)
        dX8, dX6 = cp.zeros((N, IC), dtype=bf16), cp.zeros((N, IC), dtype=np.float16)
        dW_, db_ = cp.zeros((OC, IC), np.float32), cp.zeros(OC, np.float32)
        t = {"fp8 fwd": _time(be8, lambda: be8.fp8.k_fp8_linear_fwd(o8, X8, W8, B8), reps),
             "fp8 bwd": _time(be8, lambda: be8.fp8.k_fp8_linear_bwd(dX8, dW_, db_, DY8, X8, W8), reps),
             "fp16 fwd": _time(be16, lambda: be16._linear_fwd("bench", o6, X6, W6, B6), reps),
             "fp16 bwd": _time(be16, lambda: be16._linear_bwd("bench", dX6, dW_, db_, DY6, X6, W6), reps)}
        for k in ("Y", "dX", "dW"):
            M_, N_, K_ = {"Y": (N, OC, IC), "dX": (N, IC, OC), "dW": (OC, IC, N)}[k]
            rows.append({"layer": name, "product": k, "M x N x K": f"{M_}x{N_}x{K_}",
                         **{f"err {p}": res[(p, k)] for p in ("fp8 e4m3", "fp8 e5m2", "bf16", "fp16")}})
        rows.append({"layer": name, "product": "time", "M x N x K": "",
                     "fp16 fwd ms": t["fp16 fwd"], "fp8 fwd ms": t["fp8 fwd"],
                     "fwd speed-up": t["fp16 fwd"] / t["fp8 fwd"], "fp16 bwd ms": t["fp16 bwd"],
                     "fp8 bwd ms": t["fp8 bwd"], "bwd speed-up": t["fp16 bwd"] / t["fp8 bwd"]})
    return pd.DataFrame(rows)


def report(exp: str = "ANDREA-120M", B: int = 8, reps: int = 20) -> str:
    df = run(exp, B, reps)
    err = df[df["product"] != "time"].dropna(axis=1, how="all")
    tim = df[df["product"] == "time"].dropna(axis=1, how="all").drop(columns=["product", "M x N x K"])
    tot = tim[["fp16 fwd ms", "fp8 fwd ms", "fp16 bwd ms", "fp8 bwd ms"]].sum()
    lines = [f"FP8 linear layers at {exp} shapes, B*T = {B} x context: relative error against the float32 product",
             err.to_string(index=False, float_format=lambda v: f"{v:.2e}"), "",
             f"device time per layer (ms; CUDA graph replayed {reps}x; FP8 includes amax + cast + transposes)",
             tim.to_string(index=False, float_format=lambda v: f"{v:.3f}"),
             f"one of each layer: fwd {tot['fp16 fwd ms']:.3f} -> {tot['fp8 fwd ms']:.3f} ms "
             f"({tot['fp16 fwd ms'] / tot['fp8 fwd ms']:.2f}x), bwd {tot['fp16 bwd ms']:.3f} -> "
             f"{tot['fp8 bwd ms']:.3f} ms ({tot['fp16 bwd ms'] / tot['fp8 bwd ms']:.2f}x)"]
    return "\n".join(lines)
