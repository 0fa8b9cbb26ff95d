"""The launch geometry, written once: what the kernels of kernels/*.cu expect of their grids,
blocks and shared memory, and what the device offers. The launchers (ops/), the FP8 layer
(fp8/), the tuning defaults (tuning.py) and the dev/ tools read it from here; nothing here
launches.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .runtime import cp

COLSUM_CHUNKS = 64  # row chunks of the two-pass column sums (bias and layer-norm gradients)


def colsum_chunks(N: int) -> tuple:
    """(rows a chunk, chunks) of the two-pass column sums over N rows: COLSUM_CHUNKS chunks at
    most, each partial a row of the partials buffer."""
    rows = -(-N // COLSUM_CHUNKS)
    return rows, -(-N // rows)

LN_FUSED_MAXC = 1024  # widest row the one-pass layer-norm backward holds in registers
# blocks (and partial rows) of the one-pass layer-norm backward: 2 per SM of an H200 below
# LN_WIDE columns, 4 from there (measured in the step: 528 blocks 0.391 ms against 264's 0.453 at
# ANDREA-120M's 768 columns, slower at ANDREA-12M's 384: docs/BENCHMARKS.md)
LN_BLOCKS, LN_BLOCKS_WIDE, LN_WIDE = 264, 528, 768
STEP_CHECK_THREADS = 96  # SC_THREADS in optim.cu: the summing warp and the two that compute the powers
EMBED_RANK_MAX = 1 << 16  # Tuning.embed_rank_max's default
EMBED_RANK_KEYS = 32  # keys a block of k_embed_sort_rank ranks (ER_KEYS in embed.cu)
EMBED_WTE_WARPS = 8  # sorted slots (one warp each) a block of k_embed_bwd_wte takes (EW_WARPS in embed.cu)
# Attention version 4 (fused, kernels/attention.cu) runs for 16-bit compute dtypes, head
# sizes that are multiples of 16 up to 128, on GPUs of compute capability 8.0 or later (cp.async,
# ldmatrix, bf16 mma.sync) whose per-block shared-memory limit holds its tiles; float32, other
# head sizes and older GPUs take version 1 (scores materialised, cuBLAS). The backend's
# attention="materialised" forces version 1. (Versions 2 and 3 are in git history;
# dev/cuda/attention_bench.py times the versions against PyTorch SDPA.)
FLASH_HEAD_SIZES = (16, 32, 48, 64, 80, 96, 112, 128)
FLASH_MIN_CC = 80


def flash_geometry(hs: int) -> dict:
    """Version 4's launch geometry for head size hs, as kernels/attention.cu defines it
    (each kernel traps if given less dynamic shared memory than it needs): query rows per forward
    block ("fwd_rows") and bytes of dynamic shared memory per kernel."""
    lds, bn = hs + 8, 64
    fwd_rows = 128 if hs <= 64 else 64
    bq = 64 if hs <= 64 else 32
    return {"fwd_rows": fwd_rows,
            "k_attn_flash_fwd": (fwd_rows + 4 * bn) * lds * 2,
            "k_attn_flash_bwd_dq": (2 * 64 + 4 * bn) * lds * 2,
            "k_attn_flash_bwd_dkv": (2 * bn + 4 * bq) * lds * 2 + 4 * bq * 4}


# the -D settings of attention_hopper.cu that change its launch, by the names hopper_geometry's tune
# takes: warpgroups of 64 keys a dK/dV block, of 64 query rows a dQ block and a forward block, query
# rows a dK/dV tile, keys a dQ tile and a forward tile, forward key tiles staged at once
HOPPER_TUNABLE = {"kwg": "V7_KWG", "dqwg": "V7_WG", "bq": "V7_BQ", "dq_bn": "V7_BN", "fwd_wg": "V8_WG",
                  "fwd_bn": "V8_BN", "stages": "V8_STAGES"}


def hopper_geometry(hs: int, tune=None) -> dict:
    """The launch of attention_hopper.cu's wgmma kernels for head size hs, as its macros define them
    (each kernel traps on another block size or less shared memory); tune ({HOPPER_TUNABLE name:
    value}) for a build with other -D settings (dev/cuda's sidecars time them). By default: forward
    (version 8) two warpgroups of 64 query rows a block ("fwd_rows"), key tiles of 64 staged three
    deep; backward: dQ (version 10) two warpgroups of 64 query rows a block, key tiles of 64; dK/dV
    (version 7) one warpgroup of 64 keys a block at head size 64 (three blocks a multiprocessor),
    two elsewhere, query tiles of 64 (32 above head size 64) streamed by dK/dV. "threads" is the
    forward's and dQ's block (the same by default; "fwd_threads", "dq_threads" each apart)."""
    tune = dict(tune or {})
    unknown = set(tune) - set(HOPPER_TUNABLE)
    if unknown:
        raise ValueError(f"hopper_geometry: tune {sorted(unknown)}; expected names of {sorted(HOPPER_TUNABLE)}")
    kwg, dqwg = tune.get("kwg", 1 if hs == 64 else 2), tune.get("dqwg", 2)
    keys, rows, bq, bn = 64 * kwg, 64 * dqwg, tune.get("bq", 64 if hs <= 64 else 32), tune.get("dq_bn", 64)
    fwd_wg, fwd_bn, stages = tune.get("fwd_wg", 2), tune.get("fwd_bn", 64), tune.get("stages", 3)
    fwd_rows = 64 * fwd_wg
    return {"keys": keys, "rows": rows, "threads": 128 * dqwg, "dq_threads": 128 * dqwg,
            "fwd_threads": 128 * fwd_wg, "dkv_threads": 128 * kwg, "fwd_rows": fwd_rows, "fwd_keys": fwd_bn,
            "k_attn_flash_fwd": fwd_rows * hs * 2 + 2 * stages * fwd_bn * hs * 2,
            "k_attn_flash_bwd_dkv": 2 * keys * hs * 2 + 4 * bq * hs * 2 + 4 * bq * 4,
            "k_attn_flash_bwd_dq": 2 * rows * hs * 2 + 4 * bn * hs * 2}


@functools.lru_cache(maxsize=None)
def device_takes_hopper(device_id: int, hs: int) -> bool:
    """Compute capability 9.0 (wgmma.mma_async, through the sm_90a build) and room for the tiles of
    versions 8 and 7 at head size hs; asked once per device and head size, not at every launch."""
    dev = cp.cuda.Device(device_id)
    if int(dev.compute_capability) != 90:
        return False
    smem = int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
    return max(v for k, v in hopper_geometry(hs).items() if k.startswith("k_")) <= smem


def device_fits_flash(hs: int) -> bool:
    dev = cp.cuda.Device()
    cc, smem = int(dev.compute_capability), int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
    geo = flash_geometry(hs)
    return cc >= FLASH_MIN_CC and max(v for k, v in geo.items() if k.startswith("k_")) <= smem
ATTENTION_PATHS = ("fused", "materialised")


def attn_scale(hs: int):
    """The attention's softmax scale 1/sqrt(head size), as its kernels take it (float32)."""
    return np.float32(1.0 / math.sqrt(hs))


LOSS_THREADS_V1 = 512  # block of loss.cu's version 1 row pass (one row a block)
LOSS_ROW_REGS = 28  # registers of loss.cu's version 2 beyond its 4 a vector (ptxas: 60-64 at 8 vectors)


def loss_row_plan(V: int, itemsize: int, vectors: int = 8, prefetch: bool = True, smem_max: int = 232448):
    """The launch of loss.cu's version 2 row pass (the row held in registers) for rows of V
    elements of itemsize bytes: (vectors a thread, threads a block, bytes of dynamic shared
    memory), or None where version 1 runs instead: rows that are no whole 16-byte vectors, or
    too long for one block's registers (float32 at V = 50304). About `vectors` 16-byte vectors a
    thread, the block a multiple of 32 threads (at most 1024) that covers the row, then the
    fewest vectors a thread that still do; the next row staged in shared memory (two buffers)
    where prefetch is set and they fit in smem_max."""
    vec = 16 // itemsize
    if V % vec or V <= 0 or vectors <= 0:  # vectors 0: version 1 for every row (timing it)
        return None
    n = V // vec
    nv = max(1, min(vectors, -(-n // 32)))
    threads = 32 * -(-n // (32 * nv))
    if threads > 1024:
        threads = 1024
    nv = -(-n // threads)
    if 4 * nv + LOSS_ROW_REGS > (65536 // threads) // 8 * 8:
        return None
    smem = 2 * nv * threads * 16 if prefetch else 0
    return nv, threads, (smem if smem <= smem_max else 0)


@functools.lru_cache(maxsize=None)
def sm_limits(device_id: int) -> dict:
    a = cp.cuda.Device(device_id).attributes
    return {"sms": int(a["MultiProcessorCount"]), "smem_optin": int(a["MaxSharedMemoryPerBlockOptin"]),
            "regs": int(a.get("MaxRegistersPerMultiprocessor", 65536)),
            "smem": int(a.get("MaxSharedMemoryPerMultiprocessor", 233472)),
            "threads": int(a.get("MaxThreadsPerMultiProcessor", 2048)),
            "blocks": int(a.get("MaxBlocksPerMultiprocessor", 32))}


def resident_blocks(num_regs: int, threads: int, smem: int, lim: dict) -> int:
    """Blocks of a kernel that fit on one SM at once (registers allocated 256 a warp, 1 KB of
    shared memory reserved a block): the grid of a kernel whose blocks walk the rows."""
    warps = -(-threads // 32)
    by_regs = lim["regs"] // (warps * (-(-num_regs * 32 // 256) * 256))
    by_smem = lim["smem"] // (smem + 1024)
    return max(1, min(by_regs, by_smem, lim["threads"] // threads, lim["blocks"]))
