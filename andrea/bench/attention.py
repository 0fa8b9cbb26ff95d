"""Attention alone: the engine's k_attn_fwd / k_attn_bwd against PyTorch SDPA, in one job.

    python -m andrea.bench --attention-only [--precision fp16|bf16] [--steps 20]

At the attention shapes of ANDREA-12M (B=32, NH=6, T=256, hs=64, 6 layers) and ANDREA-120M (B=8,
NH=12, T=1024, hs=64, 12 layers), with distinct random buffers per layer as in a training step:
the forward pass of all layers is captured as one CUDA graph, the backward pass of all layers as
another, and each is replayed between CUDA events (device time, no Python launch overhead). PyTorch
`F.scaled_dot_product_attention` (causal) is forced onto each of its backends (flash, cuDNN,
memory-efficient) and captured the same way with torch.cuda.graph: forward alone, and forward +
backward, whose difference is its backward. A backend that cannot run the shape is reported and
skipped. Prints ms per step (all layers) and ours as a ratio of each backend (pandas table).
"""
from __future__ import annotations

import numpy as np

SHAPES = {"ANDREA-12M": (32, 6, 256, 64, 6), "ANDREA-120M": (8, 12, 1024, 64, 12)}  # B, NH, T, hs, layers


def ours_ms(precision: str, shape, reps: int) -> tuple[float, float, str]:
    """(forward ms, backward ms, kernel name) of all layers, each direction one CUDA graph."""
    import cupy as cp

    from ..backends import get_backend
    from ..backends.cuda.graphs import replay_ms
    be = get_backend("cuda")
    dt = np.dtype("bfloat16") if precision == "bf16" else np.dtype(np.float16)
    B, NH, T, hs, L = shape
    C = NH * hs
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, T, 3 * C), dtype=np.float32).astype(dt)
    dout = rng.standard_normal((B, T, C), dtype=np.float32).astype(dt)
    layers = []
    for _ in range(L):  # the same values, distinct buffers: each layer reads its own memory
        layers.append({"qkv": cp.asarray(qkv), "out": cp.empty((B, T, C), dtype=dt),
                       "lse": cp.empty((B, NH, T), dtype=cp.float32), "dout": cp.asarray(dout),
                       "dqkv": cp.zeros((B, T, 3 * C), dtype=dt)})

    def fwd():
        for x in layers:
            be.k_attn_fwd(x["out"], x["lse"], x["qkv"], NH)

    def bwd():
        for x in layers:
            be.k_attn_bwd(x["dqkv"], x["dout"], x["qkv"], x["out"], x["lse"], NH)

    fwd()
    bwd()  # compiles, allocates the workspace: nothing of that may happen inside a capture
    cp.cuda.Stream.null.synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    times = [replay_ms(be.capture(fn, s), s, reps) for fn in (fwd, bwd)]
    return times[0], times[1], f"attention {be.attention_kernels(dt, hs)}"


def sdpa_ms(precision: str, shape, reps: int) -> dict:
    """{backend: (forward ms, backward ms)} of all layers through torch.cuda.graph, or an error text."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, NH, T, hs, L = shape
    dt = torch.bfloat16 if precision == "bf16" else torch.float16
    out = {}
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            qkv = [[torch.randn(B, NH, T, hs, device="cuda", dtype=dt, requires_grad=True) for _ in range(3)]
                   for _ in range(L)]
            dos = [torch.randn(B, NH, T, hs, device="cuda", dtype=dt) for _ in range(L)]

            def fwd():
                return [F.scaled_dot_product_attention(q, k, v, is_causal=True) for q, k, v in qkv]

            def fwd_bwd():
                for (q, k, v), do in zip(qkv, dos):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

            res = []
            with sdpa_kernel(backend):
                for fn in (fwd, fwd_bwd):
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(3):
                            fn()
                    torch.cuda.current_stream().wait_stream(side)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        fn()
                    g.replay()
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(reps):
                        g.replay()
                    b.record()
                    torch.cuda.synchronize()
                    res.append(a.elapsed_time(b) / reps)
            out[name] = (res[0], res[1] - res[0])
            del qkv, dos
            torch.cuda.empty_cache()
        except Exception as ex:  # the backend refuses this shape or dtype, or the capture: say which
            out[name] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:120] if str(ex) else ''}"
    return out


def run(precision: str = "fp16", reps: int = 20) -> "pandas.DataFrame":  # noqa: F821
    import pandas as pd
    rows, notes = [], []
    for exp, shape in SHAPES.items():
        f, b, kernel = ours_ms(precision, shape, reps)
        rows.append({"shape": exp, "kernel": "andrea", "fwd_ms": f, "bwd_ms": b})
        notes.append(f"{exp}: andrea runs {kernel}")
        try:
            theirs = sdpa_ms(precision, shape, reps)
        except ImportError as ex:
            theirs = {"sdpa": f"torch missing ({ex})"}
        for name, r in theirs.items():
            if isinstance(r, str):
                notes.append(f"{exp}: {name} skipped: {r}")
            else:
                rows.append({"shape": exp, "kernel": name, "fwd_ms": r[0], "bwd_ms": r[1]})
    df = pd.DataFrame(rows)
    df["total_ms"] = df["fwd_ms"] + df["bwd_ms"]
    ours = df[df["kernel"] == "andrea"].set_index("shape")["total_ms"]
    df["andrea_over_this"] = ours.reindex(df["shape"]).to_numpy() / df["total_ms"].to_numpy()
    df.attrs["notes"] = notes
    return df


def report(precision: str = "fp16", reps: int = 20) -> str:
    df = run(precision, reps)
    lines = [f"attention alone, {precision}, causal, ms per step (all layers; CUDA graphs replayed {reps}x):"]
    lines.append(df.round(3).to_string(index=False))
    lines += df.attrs["notes"]
    lines.append("andrea_over_this < 1: andrea's forward + backward is faster than that kernel's")
    return "\n".join(lines)

