"""GELU, tanh form as GPT-2 (kernels/gelu.cuh): the MLP's activation and its derivative, and
their forms rounded to a dtype that the FP8 passes over pre and dact take."""
from __future__ import annotations

import math

import numpy as np

GELU_K = math.sqrt(2.0 / math.pi)  # gelu_tanh constant, as in GPT-2


def _gelu(x, out):
    np.multiply(0.5 * x, 1.0 + np.tanh(GELU_K * (x + 0.044715 * x ** 3)), out=out)


def _gelu_grad(x):
    u = GELU_K * (x + 0.044715 * x ** 3)
    th = np.tanh(u)
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_K * (1.0 + 3 * 0.044715 * x * x)


def _act(pre):
    """act = gelu(pre) rounded to pre's dtype, as k_mlp_bwd_gelu writes it."""
    a = np.empty(np.shape(pre), np.float64)
    _gelu(np.asarray(pre, np.float64), a)
    return a.astype(np.asarray(pre).dtype)


def _dgelu(dact, pre):
    """dact * gelu'(pre), rounded to dact's dtype (k_fp8_dgelu_colsum_amax's new dact)."""
    d = np.asarray(dact, np.float64) * _gelu_grad(np.asarray(pre, np.float64))
    return d.astype(np.asarray(dact).dtype)
