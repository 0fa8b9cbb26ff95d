"""Version 11's backward (k_attn_flash_bwd11 of dev/cuda/attention_v11.cu: one pass, the dK/dV
kernel of version 7 also adding each query tile's dQ into a float32 accumulator in L2, the key
blocks of a tile in the order that never waits), built for sm_90a with attention_v6.py's NVRTC
pieces, launched after k_attn_flash_D; dev/cuda/attention_bench.py checks and times it
(--variants v8,v11). Head size 64 only; other head sizes launch version 7 (the same module holds it).

    PYTHONPATH=. python dev/cuda/attention_v11.py          # bit-identical reruns, and the distance from version 7
    PYTHONPATH=. python dev/cuda/attention_v11.py --time   # the one pass alone under the diagnostics settings
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from andrea.backends.cuda.runtime import THREADS, i32

# dev/cuda on sys.path (the running script's folder, or put there by attention_bench.load_sidecar
# and the tests): the sidecars beside this file
import attention_v6 as v6
import attention_v7 as v7
import attention_v8

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "attention_v11.cu"
V11_BQ = 64  # queries a tile = keys a block (attention_v11.cu)

is_hopper = v6.is_hopper

# -D settings a launch may change (tune={name: value}): blocks a multiprocessor the registers are
# fitted to three blocks a multiprocessor, wgmma serialised by ptxas; 2: 188, not serialised); diag
# (timing only, dQ wrong: 1 no waits and plain stores for the adds, 2 no dQ accumulation, 3 also no
# dQ product; with bulk, 4 and 5 the ordered bulk additions of half and a quarter of each tile's
# bytes, 6 the bulk additions without the waits, 7 the waits without the additions); bulk (1: each
# tile's addition one bulk reduction from a shared-memory stage; 2: one a warp, each warp's quarter
# ordered by its own counter); membar (0: with bulk, no membar.gl before a release, st.release only);
# defer (1, with bulk 1: a tile's wait and bulk operation issued under the next tile's first products)
TUNABLE = {"blocks": "V11_BLOCKS", "diag": "V11_DIAG", "bulk": "V11_BULK", "membar": "V11_MEMBAR",
           "defer": "V11_DEFER"}


def geometry(hs: int, tune=None) -> dict:
    """k_attn_flash_bwd11's launch (128 threads, V11_SMEM of attention_v11.cu)."""
    stage = 1 if (tune or {}).get("bulk", 0) else 0
    smem = 2 * 64 * hs * 2 + 4 * V11_BQ * hs * 2 + 64 * V11_BQ * 2 + stage * V11_BQ * hs * 4 + 4 * V11_BQ * 4
    return {"threads": 128, "keys": 64, "rows": V11_BQ, "smem": smem}


def build(ct: str, hs: int, tune=None):
    """(cache key, -D options) of SOURCE's sm_90a build (attention_v6.tuned_build)."""
    return v6.tuned_build(SOURCE, TUNABLE, ct, hs, tune)


def module(cache: dict, ct: str, hs: int, tune=None):
    """SOURCE built for sm_90a, once per cache and settings."""
    return v6.tuned_module(cache, SOURCE, TUNABLE, "one-pass backward", ct, hs, tune)


def workspace(cache: dict, BH: int, T: int, hs: int):
    """(dq_acc float32 (BH * nq * 64 * hs,), counters int32 (BH * nq * 4: one a tile, or with bulk 2
    one a warp), zeroed once) for this shape; the kernel leaves the counters at 0."""
    import cupy as cp
    nq = -(-T // V11_BQ)
    key = ("v11 workspace", BH, nq, hs)
    if key not in cache:
        cache[key] = (cp.empty((BH * nq * V11_BQ * hs,), dtype=cp.float32), cp.zeros((BH * nq * 4,), dtype=cp.int32))
    return cache[key]


def launch_bwd_parts(cache: dict, ct: str, dqkv, dout, qkv, out, lse, D, B: int, T: int, NH: int, hs: int,
                     tune=None, accumulate=True) -> dict:
    """{kernel: a function that launches it}: k_attn_flash_D, then k_attn_flash_bwd11 (head size 64;
    elsewhere version 7's two kernels)."""
    if hs != 64:
        return v7.launch_bwd_parts(cache, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs, None, accumulate)
    mod, geo, BH = module(cache, ct, hs, tune), geometry(hs, tune), B * NH
    acc, counters = workspace(cache, BH, T, hs)
    args = (dqkv, acc, counters, qkv, dout, lse, D, i32(B), i32(T), i32(NH), np.float32(1.0 / math.sqrt(hs)),
            i32(int(accumulate)))
    return {
        "k_attn_flash_D": lambda: mod.launch("k_attn_flash_D", -(-(BH * T) // THREADS), THREADS,
                                             (D, dout, out, i32(B), i32(T), i32(NH))),
        "k_attn_flash_bwd11": lambda: mod.launch("k_attn_flash_bwd11", (BH, -(-T // geo["keys"])), geo["threads"],
                                                 args, shared_mem=geo["smem"]),
    }


def launch_bwd(cache: dict, ct: str, dqkv, dout, qkv, out, lse, D, B: int, T: int, NH: int, hs: int, tune=None,
               accumulate=True):
    for launch in launch_bwd_parts(cache, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs, tune, accumulate).values():
        launch()


def time_diag(reps: int = 20) -> None:
    """k_attn_flash_bwd11 alone at the 120M and 12M shapes (fp16, times the layers) with the
    diagnostics settings, next to version 7's two kernels: where the one pass's time goes (dQ then
    wrong for diag > 0)."""
    import cupy as cp
    import pandas as pd

    from attention_bench import cuda_ms
    rows, cache = [], {}
    for shape, (B, NH, T, L) in {"120M": (8, 12, 1024, 12), "12M": (32, 6, 256, 6)}.items():
        hs = 64
        C = NH * hs
        rng = np.random.default_rng(3)
        qkv = cp.asarray(rng.standard_normal((B, T, 3 * C)).astype(np.float16).view(np.uint16))
        dout = cp.asarray(rng.standard_normal((B, T, C)).astype(np.float16).view(np.uint16))
        out, lse = cp.empty((B, T, C), dtype=cp.uint16), cp.empty((B, NH, T), dtype=cp.float32)
        attention_v8.launch_fwd(cache, "f16", out, lse, qkv, B, T, NH, hs)
        D, g = cp.empty((B * NH * T,), dtype=cp.float32), cp.zeros_like(qkv)
        p7 = v7.launch_bwd_parts(cache, "f16", g, dout, qkv, out, lse, D, B, T, NH, hs)
        rows.append(dict(shape=shape, kernel="v7 dq + dkv",
                         ms=cuda_ms(lambda: (p7["k_attn_flash_bwd_dq"](), p7["k_attn_flash_bwd_dkv"]()), reps) * L))
        for tune in ({}, {"bulk": 1}, {"bulk": 1, "membar": 0}, {"bulk": 2, "membar": 0}, {"bulk": 1, "defer": 1},
                     {"bulk": 1, "defer": 1, "membar": 0}, {"diag": 2}):
            p11 = launch_bwd_parts(cache, "f16", g, dout, qkv, out, lse, D, B, T, NH, hs, tune)
            rows.append(dict(shape=shape, kernel=f"v11 {tune}", ms=cuda_ms(p11["k_attn_flash_bwd11"], reps) * L))
            workspace(cache, B * NH, T, hs)[1].fill(0)  # diag 6 leaves its counters anywhere
        print(rows[-1], flush=True)
    print(pd.DataFrame(rows).round(3).to_string(index=False))


def main() -> int:
    """Three reruns of version 11 at the 12M, 120M and an odd attention shape (fp16, bf16): bit for
    bit the same, finite, and their distance from version 7 (relative, each of dQ, dK, dV); one table."""
    import cupy as cp
    import pandas as pd
    rows, cache = [], {}
    for ct in ("f16", "bf16"):
        for shape, (B, NH, T) in {"12M": (32, 6, 256), "120M": (8, 12, 1024), "odd": (3, 5, 1000)}.items():
            hs, C = 64, NH * 64
            rng = np.random.default_rng(3)
            host = (lambda x: x.astype(np.float16).view(np.uint16)) if ct == "f16" else \
                (lambda x: (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
            qkv = cp.asarray(host(rng.standard_normal((B, T, 3 * C))))
            dout = cp.asarray(host(rng.standard_normal((B, T, C))))
            out = cp.empty((B, T, C), dtype=cp.uint16)
            lse = cp.empty((B, NH, T), dtype=cp.float32)
            attention_v8.launch_fwd(cache, ct, out, lse, qkv, B, T, NH, hs)
            D = cp.empty((B * NH * T,), dtype=cp.float32)
            g7 = cp.zeros_like(qkv)
            v7.launch_bwd(cache, ct, g7, dout, qkv, out, lse, D, B, T, NH, hs, accumulate=False)
            for tune in ({}, {"bulk": 1}, {"bulk": 2}, {"bulk": 1, "membar": 0}, {"bulk": 1, "defer": 1, "membar": 0}):
                runs = []
                for _ in range(3):
                    g = cp.zeros_like(qkv)
                    launch_bwd(cache, ct, g, dout, qkv, out, lse, D, B, T, NH, hs, tune, accumulate=False)
                    runs.append(g)
                cp.cuda.runtime.deviceSynchronize()
                rows.append(compare(ct, shape, tune, runs, g7, C))
                print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    ok = table["bitwise"].all() and table["finite"].all()
    return 0 if ok else 1


def compare(ct, shape, tune, runs, g7, C) -> dict:
    """One row of main's table: the reruns bit for bit the same, finite, and their distance from
    version 7's gradient g7 (relative, each of dQ, dK, dV)."""
    import cupy as cp

    def f64(a):  # 16-bit patterns -> float64 values
        if ct == "f16":
            return a.view(cp.float16).astype(cp.float64)
        return (a.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
    x11, x7 = f64(runs[0]), f64(g7)
    dist = {p: float(cp.linalg.norm(x11[..., i * C:(i + 1) * C] - x7[..., i * C:(i + 1) * C]) /
                     cp.linalg.norm(x7[..., i * C:(i + 1) * C])) for i, p in enumerate(("dq", "dk", "dv"))}
    return dict(ct=ct, shape=shape, tune=str(tune), bitwise=all(bool((r == runs[0]).all()) for r in runs[1:]),
                finite=bool(cp.isfinite(x11).all()), **{f"v11_vs_v7_{k}": f"{v:.2e}" for k, v in dist.items()})

if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    if "--time" in sys.argv:
        time_diag()
        sys.exit(0)
    sys.exit(main())
