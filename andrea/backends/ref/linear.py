"""The linear layers (kernels/linear.cu for the bias and column sums, the products on cuBLAS): the
shared math, the attention's input (QKV) and output projections, and their FP8 forms
(cuda/fp8/): E4M3 operands, each with its own scale, output gradients in a grad format."""
from __future__ import annotations

import numpy as np

from ..interface import FP8_FWD
from .common import _put
from .fp8 import fp8_fake


# ---------------------------------------------------------------- the shared math


def _linear_fwd(out, inp, w, b):
    np.matmul(inp, w.T, out=out)
    out += b


def _linear_bwd(dinp, dw, db, dout, inp, w, accumulate=True):
    OC, IC = w.shape
    d2 = dout.reshape(-1, OC)
    _put(dinp, dout @ w, accumulate)
    dw += d2.T @ inp.reshape(-1, IC)
    db += d2.sum(axis=0)


# ---------------------------------------------------------------- the attention's projections


def k_attn_qkv_fwd(qkv, inp, w, b):
    """qkv (B,T,3C) = inp (B,T,C) @ w (3C,C).T + b (3C,); q, k, v are the three C-wide slices."""
    _linear_fwd(qkv, inp, w, b)


def k_attn_qkv_bwd(dinp, dw, db, dqkv, inp, w, accumulate=True):
    """Adds into dinp (B,T,C), dw (3C,C), db (3C,); accumulate=False writes dinp instead."""
    _linear_bwd(dinp, dw, db, dqkv, inp, w, accumulate)


def k_attn_out_fwd(out, inp, w, b):
    """out (B,T,C) = inp (B,T,C) @ w (C,C).T + b: the output projection W_O."""
    _linear_fwd(out, inp, w, b)


def k_attn_out_bwd(dinp, dw, db, dout, inp, w, accumulate=True):
    """Adds into dinp (B,T,C), dw (C,C), db (C,); accumulate=False writes dinp instead."""
    _linear_bwd(dinp, dw, db, dout, inp, w, accumulate)


# ---------------------------------------------------------------- FP8 (train.precision=fp8)


def k_fp8_linear_fwd(out, inp, w, b):
    """out (N.., OC) = fp8(inp) @ fp8(w).T + b: E4M3 operands, each with its own scale, the
    product in float64 here (float32 on tensor cores), then out's dtype."""
    OC, IC = w.shape
    y = fp8_fake(inp, FP8_FWD).reshape(-1, IC) @ fp8_fake(w, FP8_FWD).T + np.asarray(b, np.float64)
    out[...] = y.reshape(out.shape)


def k_fp8_linear_bwd(dinp, dw, db, dout, inp, w, grad_fmt, accumulate=True):
    """Adds into dinp += fp8g(dout) @ fp8(w), dw += fp8g(dout).T @ fp8(inp) and db += column sums
    of dout (not quantised); fp8g is the gradient format grad_fmt ("e4m3" or "e5m2"); accumulate=
    False writes dinp instead. The quantisation's own derivative is taken as 1 (straight-through),
    as every FP8 recipe does."""
    OC, IC = w.shape
    g = fp8_fake(dout, grad_fmt).reshape(-1, OC)
    _put(dinp, (g @ fp8_fake(w, FP8_FWD)).reshape(dinp.shape), accumulate)
    dw += g.T @ fp8_fake(inp, FP8_FWD).reshape(-1, IC)
    db += np.asarray(dout, np.float64).reshape(-1, OC).sum(axis=0)
