"""Version 7's backward (k_attn_flash_bwd_dq, k_attn_flash_bwd_dkv on wgmma), now the package's
kernels/attention_hopper.cu, built for sm_90a with other -D settings than the package's
defaults, so that dev/cuda/attention_bench.py times the settings against each other (tune). The
package launches the default settings itself; the launch geometry of any settings is the package's
(andrea/backends/cuda/geometry.py, hopper_geometry with tune), written once (tests/test_hopper_compile.py
checks it against the macros).
Compiling and loading are attention_v6.py's (NVRTC, -arch=sm_90a, a cubin loaded with the driver).
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
V7_WG = 2  # warpgroups per dQ block (V7_WG in attention_hopper.cu); dK/dV: tune "kwg", default 2


is_hopper = v6.is_hopper


# -D settings of attention_hopper.cu a launch may change (tune={name: value}): warpgroups (64 keys each)
# per dK/dV block, queries per dK/dV tile,
# keys per dQ tile, blocks per multiprocessor each kernel is compiled to fit, overlap (0: every
# product group waited for at once), swizzle (0: version 6's core-matrix tiles instead of 128-byte
# swizzled ones at head size 64), loads (1: tile copies at offsets known when compiling), warpgroups
# (64 query rows each) per dQ block
TUNABLE = {"kwg": "V7_KWG", "bq": "V7_BQ", "bn": "V7_BN", "dkv_blocks": "V7_DKV_BLOCKS",
           "dq_blocks": "V7_DQ_BLOCKS", "overlap": "V7_OVERLAP", "swizzle": "V7_SWIZZLE", "loads": "V7_LOADS",
           "dqwg": "V7_WG"}


def geometry(hs: int, tune=None) -> dict:
    """Version 7's backward launch for head size hs, as attention_hopper.cu defines it (V7_DKV_THREADS,
    V7_DQ_THREADS, V7_BK, V7_QM, V7_DKV_SMEM, V7_DQ_SMEM; the kernels trap on another block size or
    less shared memory): the package's geometry.hopper_geometry with tune's settings (as module's)."""
    tune = tune or {}
    names = {"kwg": "kwg", "dqwg": "dqwg", "bq": "bq", "bn": "dq_bn"}  # the rest do not change the launch
    geo = hopper_geometry(hs, {names[k]: v for k, v in tune.items() if k in names})
    return {"dkv_threads": geo["dkv_threads"], "dq_threads": geo["dq_threads"], "keys": geo["keys"],
            "rows": geo["rows"], "dkv_smem": geo["k_attn_flash_bwd_dkv"], "dq_smem": geo["k_attn_flash_bwd_dq"]}


def build(ct: str, hs: int, tune=None):
    """(cache key, -D options) of SOURCE's sm_90a build (attention_v6.tuned_build)."""
    return v6.tuned_build(SOURCE, TUNABLE, ct, hs, tune)


def module(cache: dict, ct: str, hs: int, tune=None):
    """SOURCE built for sm_90a, once per cache and settings; tune ({TUNABLE key: int}) overrides
    the file's defaults."""
    return v6.tuned_module(cache, SOURCE, TUNABLE, "wgmma backward", ct, hs, tune)


def launch_bwd_parts(cache: dict, ct: str, dqkv, dout, qkv, out, lse, D, B: int, T: int, NH: int, hs: int,
                     tune=None, accumulate=True) -> dict:
    """{kernel: a function that launches it} for the two kernels of the backward, in order: the dQ
    kernel (version 10: it computes D (B*NH*T,) float32 and writes it), then version 7's dK/dV,
    which reads D; both add into dqkv (accumulate=False: write it)."""
    mod, geo, BH = module(cache, ct, hs, tune), geometry(hs, tune), B * NH
    dims = (i32(B), i32(T), i32(NH), np.float32(1.0 / math.sqrt(hs)), i32(int(accumulate)))
    return {
        "k_attn_flash_bwd_dq": lambda: mod.launch("k_attn_flash_bwd_dq", (BH, -(-T // geo["rows"])), geo["dq_threads"],
                                                  (dqkv, qkv, dout, out, lse, D) + dims, shared_mem=geo["dq_smem"]),
        "k_attn_flash_bwd_dkv": lambda: mod.launch("k_attn_flash_bwd_dkv", (BH, -(-T // geo["keys"])),
                                                   geo["dkv_threads"], (dqkv, qkv, dout, lse, D) + dims,
                                                   shared_mem=geo["dkv_smem"]),
    }


def launch_bwd(cache: dict, ct: str, dqkv, dout, qkv, out, lse, D, B: int, T: int, NH: int, hs: int, tune=None,
               accumulate=True):
    """Version 7's backward: dqkv (B,T,3C) += [dQ | dK | dV] (accumulate=False: =); the arrays as
    version 4's launcher gives them (16-bit, 16-byte aligned), D a float32 scratch of B*NH*T."""
    for launch in launch_bwd_parts(cache, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs, tune, accumulate).values():
        launch()
