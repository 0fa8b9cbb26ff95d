"""attention_v4.cu's k_attn_flash_D took one warp per head row: its launch, with the backend's
k_attn_bwd otherwise unchanged."""
import math

import numpy as np

from andrea.backends.cuda.ops import THREADS, flash_geometry, i32


def k_attn_bwd(be, dqkv, dout, qkv, out, lse, n_head, accumulate=True):
    B, T, C3 = qkv.shape
    C, NH = C3 // 3, n_head
    hs, BH, ct = C // NH, B * NH, qkv.dtype
    if not be._fused(ct, hs, dqkv, qkv, dout, out):
        return type(be).k_attn_bwd(be, dqkv, dout, qkv, out, lse, n_head, accumulate)
    scale = np.float32(1.0 / math.sqrt(hs))
    D = be.workspace.get("attn_D", BH * T, np.float32)
    be.rt.launch("attention.cu", "k_attn_flash_D", ct, -(-(BH * T) // 8), THREADS,
                 (D, dout, out, i32(B), i32(T), i32(NH)), hs=hs)
    geo = flash_geometry(hs)
    for kernel in ("k_attn_flash_bwd_dq", "k_attn_flash_bwd_dkv"):
        be.rt.launch("attention.cu", kernel, ct, (BH, -(-T // 64)), 128,
                     (dqkv, qkv, dout, lse, D, i32(B), i32(T), i32(NH), scale, i32(int(accumulate))),
                     shared_mem=geo[kernel], hs=hs)
