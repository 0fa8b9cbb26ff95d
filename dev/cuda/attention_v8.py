"""Version 8's forward (k_attn_flash_fwd on wgmma), now the package's kernels/attention_hopper.cu,
built for sm_90a with other -D settings than the package's defaults, so that
dev/cuda/attention_bench.py times the settings against each other (tune). The package launches the
default settings itself; the launch geometry of any settings is the package's (andrea/backends/cuda/
geometry.py, hopper_geometry with tune), written once (tests/test_hopper_compile.py checks it against
the macros). Compiling and loading are
attention_v6.py's (NVRTC, -arch=sm_90a, a cubin loaded with the driver); the module holds version
7's backward too.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from andrea.backends.cuda.geometry import hopper_geometry
from andrea.backends.cuda.runtime import i32

# dev/cuda on sys.path (the running script's folder, or put there by attention_bench.load_sidecar
# and the tests): the sidecars beside this file
import attention_v6 as v6

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent.parent / "kernels" / "attention_hopper.cu"


is_hopper = v6.is_hopper

# -D settings of attention_hopper.cu's forward a launch may change (tune={name: value}): warpgroups
# (64 query rows each) a block, keys a tile, overlap (0: S, softmax, P V of a tile one after the other),
# blocks a multiprocessor the registers are fitted to, K and V tiles staged at once, swizzle (0: core-matrix tiles at head size 64), loads (1: tile
# copies at offsets known when compiling)
TUNABLE = {"wg": "V8_WG", "bn": "V8_BN", "overlap": "V8_OVERLAP", "blocks": "V8_BLOCKS", "stages": "V8_STAGES",
           "swizzle": "V7_SWIZZLE", "loads": "V7_LOADS"}


def geometry(hs: int, tune=None) -> dict:
    """Version 8's forward launch for head size hs, as attention_hopper.cu's macros define it (V8_BM,
    V8_BN, V8_THREADS, V8_SMEM; the kernel traps on another block size or less shared memory): the
    package's geometry.hopper_geometry with tune's settings."""
    tune = tune or {}
    names = {"wg": "fwd_wg", "bn": "fwd_bn", "stages": "stages"}  # the rest do not change the launch
    geo = hopper_geometry(hs, {names[k]: v for k, v in tune.items() if k in names})
    return {"rows": geo["fwd_rows"], "keys": geo["fwd_keys"], "threads": geo["fwd_threads"],
            "smem": geo["k_attn_flash_fwd"]}


def build(ct: str, hs: int, tune=None):
    """(cache key, -D options) of SOURCE's sm_90a build (attention_v6.tuned_build)."""
    return v6.tuned_build(SOURCE, TUNABLE, ct, hs, tune)


def module(cache: dict, ct: str, hs: int, tune=None):
    """SOURCE built for sm_90a, once per cache and settings; tune ({TUNABLE key: int}) overrides
    the file's defaults."""
    return v6.tuned_module(cache, SOURCE, TUNABLE, "wgmma forward", ct, hs, tune)


def launch_fwd(cache: dict, ct: str, out, lse, qkv, B: int, T: int, NH: int, hs: int, tune=None):
    """Version 8's k_attn_flash_fwd: out (B,T,C), lse (B*NH, T) from qkv (B,T,3C); the arrays as
    version 4's launcher gives them (16-bit, 16-byte aligned)."""
    geo = geometry(hs, tune)
    module(cache, ct, hs, tune).launch("k_attn_flash_fwd", (B * NH, -(-T // geo["rows"])), geo["threads"],
                                       (out, lse, qkv, i32(B), i32(T), i32(NH), np.float32(1.0 / math.sqrt(hs))),
                                       shared_mem=geo["smem"])
