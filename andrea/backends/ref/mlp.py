"""The MLP (kernels/mlp.cu for the GELU passes, the products as the linear layers'): gelu_tanh
between two linear layers, and its FP8 form."""
from __future__ import annotations

import numpy as np

from .gelu import _gelu, _gelu_grad
from .linear import _linear_bwd, _linear_fwd, k_fp8_linear_bwd, k_fp8_linear_fwd


def k_mlp_fwd(out, pre, act, inp, w1, b1, w2, b2):
    """out (B,T,C) = gelu_tanh(inp @ w1.T + b1) @ w2.T + b2. Saves pre (B,T,4C); act (B,T,4C) is
    workspace (the backward pass recomputes it from pre)."""
    _linear_fwd(pre, inp, w1, b1)
    _gelu(pre, act)
    _linear_fwd(out, act, w2, b2)


def k_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, accumulate=True):
    """Adds into dinp, dw1 (4C,C), db1, dw2 (C,4C), db2 (accumulate=False: writes dinp). act,
    dact (B,T,4C) are workspace."""
    _gelu(pre, act)
    _linear_bwd(dact, dw2, db2, dout, act, w2, accumulate=False)
    dact *= _gelu_grad(pre)
    _linear_bwd(dinp, dw1, db1, dact, inp, w1, accumulate)


def k_fp8_mlp_fwd(out, pre, act, inp, w1, b1, w2, b2):
    """k_mlp_fwd with both products in FP8: pre = fp8(inp) @ fp8(w1).T + b1, act = gelu(pre),
    out = fp8(act) @ fp8(w2).T + b2."""
    k_fp8_linear_fwd(pre, inp, w1, b1)
    _gelu(np.asarray(pre, np.float64), act)
    k_fp8_linear_fwd(out, act, w2, b2)


def k_fp8_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, grad_fmt, accumulate=True):
    """k_mlp_bwd with the four products in FP8 (k_fp8_linear_bwd's rules)."""
    _gelu(np.asarray(pre, np.float64), act)
    k_fp8_linear_bwd(dact, dw2, db2, dout, act, w2, grad_fmt, accumulate=False)
    dact *= _gelu_grad(np.asarray(pre, np.float64))
    k_fp8_linear_bwd(dinp, dw1, db1, dact, inp, w1, grad_fmt, accumulate)
