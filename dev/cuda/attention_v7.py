"""attention_v7.cu's launches: version 6's wgmma forward and version 7's wgmma backward
(k_attn_flash_bwd_dq, k_attn_flash_bwd_dkv), both from one sm_90a build of attention_v7.cu.

Compiling and loading are attention_v6.py's (NVRTC, -arch=sm_90a -DV6_SM90A, a cubin loaded with
the driver); this file adds the backward's geometry and launch. k_attn_flash_D, which the
backward reads, is launched from the same module (it is the package's kernel, unchanged). Where
the device is not compute capability 9.0, or version 4's fused path does not apply (dtype, head
size, alignment), the backend's own launchers run, from the Runtime's build of attention_v7.cu, in
which the wgmma code is compiled out and version 4's kernels remain.
"""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np

from andrea.backends.cuda.runtime import THREADS, check, ct_name, i32

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "attention_v7.cu"
V7_WG = 2  # warpgroups per dQ block (V7_WG in attention_v7.cu); dK/dV: tune "kwg", default 2


def _load_v6():
    name = "dev_cuda_attention_v6"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "attention_v6.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


v6 = _load_v6()
is_hopper = v6.is_hopper


# -D settings of attention_v7.cu a launch may change (tune={name: value}): warpgroups (64 keys each)
# per dK/dV block, queries per dK/dV tile,
# keys per dQ tile, blocks per multiprocessor each kernel is compiled to fit, overlap (0: every
# product group waited for at once), swizzle (0: version 6's core-matrix tiles instead of 128-byte
# swizzled ones at head size 64)
TUNABLE = {"kwg": "V7_KWG", "bq": "V7_BQ", "bn": "V7_BN", "dkv_blocks": "V7_DKV_BLOCKS",
           "dq_blocks": "V7_DQ_BLOCKS", "overlap": "V7_OVERLAP", "swizzle": "V7_SWIZZLE"}


def geometry(hs: int, tune=None) -> dict:
    """Version 7's backward launch for head size hs, as attention_v7.cu defines it (V7_DKV_THREADS,
    V7_DQ_THREADS, V7_BK, V7_QM, V7_DKV_SMEM, V7_DQ_SMEM; the kernels trap on another block size or
    less shared memory); tune as module's."""
    tune = tune or {}
    kwg = tune.get("kwg", 2)
    keys, rows = 64 * kwg, 64 * V7_WG
    bq, bn = tune.get("bq", 64 if hs <= 64 else 32), tune.get("bn", 64)
    return {"dkv_threads": 128 * kwg, "dq_threads": 128 * V7_WG, "keys": keys, "rows": rows,
            "dkv_smem": 2 * keys * hs * 2 + 4 * bq * hs * 2 + 4 * bq * 4,
            "dq_smem": 2 * rows * hs * 2 + 4 * bn * hs * 2}


def module(cache: dict, ct: str, hs: int, tune=None):
    """attention_v7.cu built for sm_90a (forward and backward), once per cache and settings; tune
    ({TUNABLE key: int}) overrides the file's defaults."""
    tune = tune or {}
    unknown = set(tune) - set(TUNABLE)
    if unknown:
        raise ValueError(f"attention_v7 tune: unknown {sorted(unknown)}; expected some of {sorted(TUNABLE)}")
    key = (str(SOURCE), ct, hs, tuple(sorted(tune.items())))
    if key not in cache:
        defs = (f"-DHS={hs}",) + tuple(f"-D{TUNABLE[k]}={v}" for k, v in sorted(tune.items()))
        cache[key] = v6.Sm90aModule(v6.compile_sm90a(v6.source(SOURCE), SOURCE.name, ct, defs))
        print(f"{SOURCE.name}: compiled for sm_90a (wgmma forward and backward), CT={ct} {' '.join(defs)}",
              file=sys.stderr)
    return cache[key]


def launch_fwd(cache: dict, ct: str, out, lse, qkv, B: int, T: int, NH: int, hs: int, tune=None):
    """Version 6's k_attn_flash_fwd, from this file's build (with tune's settings: the forward is the
    same kernel, one module serves both directions)."""
    geo = v6.geometry(hs)
    module(cache, ct, hs, tune).launch("k_attn_flash_fwd", (B * NH, -(-T // geo["rows"])), geo["threads"],
                                 (out, lse, qkv, i32(B), i32(T), i32(NH), np.float32(1.0 / math.sqrt(hs))),
                                 shared_mem=geo["smem"])


def launch_bwd_parts(cache: dict, ct: str, dqkv, dout, qkv, out, lse, D, B: int, T: int, NH: int, hs: int,
                     tune=None) -> dict:
    """{kernel: a function that launches it} for the three kernels of the backward, in order:
    k_attn_flash_D (D (B*NH*T,) float32), then version 7's dQ and dK/dV, which add into dqkv."""
    mod, geo, BH = module(cache, ct, hs, tune), geometry(hs, tune), B * NH
    args = (dqkv, qkv, dout, lse, D, i32(B), i32(T), i32(NH), np.float32(1.0 / math.sqrt(hs)))
    return {
        "k_attn_flash_D": lambda: mod.launch("k_attn_flash_D", -(-(BH * T) // THREADS), THREADS,
                                             (D, dout, out, i32(B), i32(T), i32(NH))),
        "k_attn_flash_bwd_dq": lambda: mod.launch("k_attn_flash_bwd_dq", (BH, -(-T // geo["rows"])), geo["dq_threads"],
                                                  args, shared_mem=geo["dq_smem"]),
        "k_attn_flash_bwd_dkv": lambda: mod.launch("k_attn_flash_bwd_dkv", (BH, -(-T // geo["keys"])),
                                                   geo["dkv_threads"], args, shared_mem=geo["dkv_smem"]),
    }


def launch_bwd(cache: dict, ct: str, dqkv, dout, qkv, out, lse, D, B: int, T: int, NH: int, hs: int, tune=None):
    """Version 7's backward: dqkv (B,T,3C) += [dQ | dK | dV]; the arrays as version 4's launcher
    gives them (16-bit, 16-byte aligned), D a float32 scratch of B*NH*T."""
    for launch in launch_bwd_parts(cache, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs, tune).values():
        launch()


def _applies(be, ct, hs, *arrays) -> bool:
    return is_hopper() and be._fused(ct, hs, *arrays)


def k_attn_fwd(be, out, lse, qkv, n_head):
    """The backend's k_attn_fwd with version 6's forward on compute capability 9.0."""
    check("k_attn_fwd", "qkv", qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    if C3 % 3 or C % n_head:
        raise ValueError(f"k_attn_fwd: qkv last axis {C3} must be 3*C with C divisible by n_head={n_head}")
    hs, ct = C // n_head, qkv.dtype
    if not _applies(be, ct, hs, qkv, out):
        return type(be).k_attn_fwd(be, out, lse, qkv, n_head)
    check("k_attn_fwd", "out", out, (B, T, C), ct)
    check("k_attn_fwd", "lse", lse, (B, n_head, T), np.float32)
    launch_fwd(be.__dict__.setdefault("_sm90a_modules", {}), ct_name(ct), out, lse, qkv, B, T, n_head, hs)


def k_attn_bwd(be, dqkv, dout, qkv, out, lse, n_head):
    """The backend's k_attn_bwd with version 7's backward on compute capability 9.0."""
    check("k_attn_bwd", "qkv", qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    if C3 % 3 or C % n_head:
        raise ValueError(f"k_attn_bwd: qkv last axis {C3} must be 3*C with C divisible by n_head={n_head}")
    hs, ct = C // n_head, qkv.dtype
    if not _applies(be, ct, hs, dqkv, qkv, dout, out):
        return type(be).k_attn_bwd(be, dqkv, dout, qkv, out, lse, n_head)
    check("k_attn_bwd", "dqkv", dqkv, qkv.shape, ct)
    check("k_attn_bwd", "dout", dout, (B, T, C), ct)
    check("k_attn_bwd", "out", out, (B, T, C), ct)
    check("k_attn_bwd", "lse", lse, (B, n_head, T), np.float32)
    D = be.workspace.get("attn_D", B * n_head * T, np.float32)
    launch_bwd(be.__dict__.setdefault("_sm90a_modules", {}), ct_name(ct), dqkv, dout, qkv, out, lse, D,
               B, T, n_head, hs)
