"""Attention of one new position against a KV cache (kernels/decode.cu): inference only."""
from __future__ import annotations

import math

import numpy as np


def k_attn_decode_fwd(out, kcache, vcache, qkv, pos, n_head):
    """Attention of one new position against a KV cache (inference only, no backward twin).
    qkv (B,1,3C) is the new position's projection; its k and v are written into row pos of
    kcache, vcache (B,context,C), then out (B,1,C) = softmax(q K[:pos+1]^T / sqrt(hs)) V[:pos+1],
    the row pos of k_attn_fwd on the whole sequence (same score scaling and log-sum-exp form)."""
    B, _, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    n = pos + 1
    kcache[:, pos] = qkv[:, 0, C:2 * C]
    vcache[:, pos] = qkv[:, 0, 2 * C:]
    q = qkv[:, 0, :C].reshape(B, n_head, 1, hs)
    k = kcache[:, :n].reshape(B, n, n_head, hs).transpose(0, 2, 1, 3)
    v = vcache[:, :n].reshape(B, n, n_head, hs).transpose(0, 2, 1, 3)
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))  # (B,NH,1,n)
    smax = s.max(axis=-1, keepdims=True)
    lse = smax + np.log(np.exp(s - smax).sum(axis=-1, keepdims=True))
    y = np.exp(s - lse) @ v  # (B,NH,1,hs)
    out[...] = y.transpose(0, 2, 1, 3).reshape(B, 1, C)
