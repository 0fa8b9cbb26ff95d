"""Causal self-attention (kernels/attention.cu, attention_hopper.cu) and its FP8 forms, which
also write an output as an FP8 operand of the product next to it."""
from __future__ import annotations

import math

import numpy as np

from .common import _put
from .fp8 import k_fp8_cast_transpose_amax, k_fp8_cast_transpose_colsum_amax


def _heads(qkv, n_head):
    """(B,T,3C) -> q, k, v each (B,NH,T,hs), views."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    x = qkv.reshape(B, T, 3, n_head, C // n_head)
    return (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def _scores(q, k):
    """Causal scaled scores (B,NH,T,T), -inf above the diagonal."""
    T, hs = q.shape[-2], q.shape[-1]
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))
    s[..., np.triu(np.ones((T, T), dtype=bool), 1)] = -np.inf
    return s


def k_attn_fwd(out, lse, qkv, n_head):
    """Causal softmax(q k^T / sqrt(hs)) v. out (B,T,C); lse (B,NH,T) saves the log-sum-exp of
    each score row, so the backward pass recomputes the probabilities instead of storing T x T."""
    q, k, v = _heads(qkv, n_head)
    s = _scores(q, k)
    smax = s.max(axis=-1, keepdims=True)
    lse[...] = (smax + np.log(np.exp(s - smax).sum(axis=-1, keepdims=True)))[..., 0]
    p = np.exp(s - lse[..., None])
    y = p @ v  # (B,NH,T,hs)
    B, T, C = out.shape
    out[...] = y.transpose(0, 2, 1, 3).reshape(B, T, C)


def k_attn_bwd(dqkv, dout, qkv, out, lse, n_head, accumulate=True):
    """Adds into dqkv (B,T,3C) (accumulate=False: writes it). Uses D = rowsum(dout * out) =
    rowsum(p * dp), as flash attention."""
    q, k, v = _heads(qkv, n_head)
    B, T, C = out.shape
    hs = C // n_head
    p = np.exp(_scores(q, k) - lse[..., None])
    dy = dout.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
    y = out.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
    dv = p.transpose(0, 1, 3, 2) @ dy
    dp = dy @ v.transpose(0, 1, 3, 2)
    D = (dy * y).sum(axis=-1, keepdims=True)
    ds = p * (dp - D) * (1.0 / math.sqrt(hs))
    dq = ds @ k
    dk = ds.transpose(0, 1, 3, 2) @ q
    g = dqkv.reshape(B, T, 3, n_head, hs)
    for i, d in enumerate((dq, dk, dv)):
        _put(g[:, :, i], d.transpose(0, 2, 1, 3), accumulate)


def k_attn_fwd_fp8(out, lse, q, q_t, meta, amax_out, qkv, n_head):
    """The attention forward that also writes its output as an FP8 E4M3 operand (delayed scaling;
    the attention projection's input): out and lse as k_attn_fwd writes them, and out (B,T,C)
    cast by k_fp8_cast_transpose_amax(q, q_t, meta, out, "e4m3", amax_out)."""
    k_attn_fwd(out, lse, qkv, n_head)
    k_fp8_cast_transpose_amax(q, q_t, meta, out.reshape(-1, out.shape[-1]), "e4m3", amax_out)


def k_attn_bwd_fp8(q, q_t, partial, meta, amax_out, dout, qkv, out, lse, n_head, fmt):
    """The attention backward that writes dqkv only as the QKV product's FP8 output gradient:
    dqkv (qkv's shape and dtype, not kept) as k_attn_bwd writes it (accumulate=False), cast by
    k_fp8_cast_transpose_colsum_amax(q, q_t, meta, dqkv, fmt, partial, amax_out) with tiles of 64
    rows (partial None: no column sums)."""
    dqkv = np.empty_like(qkv)
    k_attn_bwd(dqkv, dout, qkv, out, lse, n_head, accumulate=False)
    d2 = dqkv.reshape(-1, dqkv.shape[-1])
    if partial is None:
        k_fp8_cast_transpose_amax(q, q_t, meta, d2, fmt, amax_out)
    else:
        k_fp8_cast_transpose_colsum_amax(q, q_t, meta, d2, fmt, partial, amax_out, tile_rows=64)
