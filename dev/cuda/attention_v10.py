"""Version 10's backward: k_attn_flash_bwd_dq10 of dev/cuda/attention_v10.cu (version 7's dQ kernel that
computes D for its rows and writes it) followed by version 7's dK/dV kernel from the same module,
which reads that D: two launches where version 7 has three (no k_attn_flash_D). Built for sm_90a
with attention_v6.py's NVRTC pieces; tune: version 7's -D settings (attention_v7.TUNABLE), so a
dK/dV setting can be timed with the fused D too. Head size 64 only; other head sizes launch
version 7 (the same module holds it). dev/cuda/attention_bench.py checks and times it
(--variants v8,v10).
"""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np

from andrea.backends.cuda.runtime import i32

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "attention_v10.cu"


def _load(stem):
    name = f"dev_cuda_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{stem}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


v6 = _load("attention_v6")
v7 = _load("attention_v7")
is_hopper = v6.is_hopper
TUNABLE = v7.TUNABLE


def geometry(hs: int, tune=None) -> dict:
    """Version 7's backward geometry (the dQ kernel's is unchanged)."""
    return v7.geometry(hs, tune)


def build(ct: str, hs: int, tune=None):
    """(cache key, -D options) of SOURCE's sm_90a build (attention_v6.tuned_build)."""
    return v6.tuned_build(SOURCE, TUNABLE, ct, hs, tune)


def module(cache: dict, ct: str, hs: int, tune=None):
    """SOURCE built for sm_90a, once per cache and settings."""
    return v6.tuned_module(cache, SOURCE, TUNABLE, "dQ with D", ct, hs, tune)


def launch_bwd_parts(cache: dict, ct: str, dqkv, dout, qkv, out, lse, D, B: int, T: int, NH: int, hs: int,
                     tune=None, accumulate=True) -> dict:
    """{kernel: a function that launches it}, in order: k_attn_flash_bwd_dq10 (writes D) and version
    7's k_attn_flash_bwd_dkv (reads it); head size 64, else version 7's three kernels."""
    if hs != 64:
        return v7.launch_bwd_parts(cache, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs, None, accumulate)
    mod, geo, BH = module(cache, ct, hs, tune), geometry(hs, tune), B * NH
    scale, acc = np.float32(1.0 / math.sqrt(hs)), i32(int(accumulate))
    dims = (i32(B), i32(T), i32(NH), scale, acc)
    return {
        "k_attn_flash_bwd_dq10": lambda: mod.launch("k_attn_flash_bwd_dq10", (BH, -(-T // geo["rows"])),
                                                    geo["dq_threads"], (dqkv, qkv, dout, out, lse, D) + dims,
                                                    shared_mem=geo["dq_smem"]),
        "k_attn_flash_bwd_dkv": lambda: mod.launch("k_attn_flash_bwd_dkv", (BH, -(-T // geo["keys"])),
                                                   geo["dkv_threads"], (dqkv, qkv, dout, lse, D) + dims,
                                                   shared_mem=geo["dkv_smem"]),
    }


def launch_bwd(cache: dict, ct: str, dqkv, dout, qkv, out, lse, D, B: int, T: int, NH: int, hs: int, tune=None,
               accumulate=True):
    for launch in launch_bwd_parts(cache, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs, tune, accumulate).values():
        launch()
