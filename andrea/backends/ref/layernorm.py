"""Layer norm (kernels/layernorm.cu): the layer norm, the residual add fused into it, and the
FP8 form that writes its output as an E4M3 operand."""
from __future__ import annotations

import numpy as np

from .common import _put
from .fp8 import k_fp8_amax, k_fp8_cast_transpose_amax
from .residual import k_residual_add

LN_EPS = 1e-5  # torch.nn.LayerNorm's default


def k_layernorm_fwd(out, mean, rstd, inp, weight, bias, amax=None):
    """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T). amax: None, or
    a float32 array whose [0] receives max |out| as k_fp8_amax computes it (train.precision=fp8:
    the amax of the FP8 cast of out, reduced by the kernel that writes out)."""
    mean[...] = inp.mean(axis=-1)
    xc = inp - mean[..., None]
    rstd[...] = 1.0 / np.sqrt((xc * xc).mean(axis=-1) + LN_EPS)
    np.multiply(xc * rstd[..., None], weight, out=out)
    out += bias
    if amax is not None:
        k_fp8_amax(amax, out)


def k_layernorm_bwd(dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True):
    """Adds the layer-norm gradients into dinp (B,T,C), dweight (C,), dbias (C,); accumulate=False
    writes dinp instead."""
    C = inp.shape[-1]
    xhat = (inp - mean[..., None]) * rstd[..., None]
    dbias += dout.reshape(-1, C).sum(axis=0)
    dweight += (dout * xhat).reshape(-1, C).sum(axis=0)
    dxhat = dout * weight
    _put(dinp, rstd[..., None] * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                                  - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)), accumulate)


def k_residual_layernorm_fwd(res, out, mean, rstd, a, b, weight, bias, amax=None):
    """The residual add fused into the layer norm that follows it: res = a + b (the residual
    stream, saved), then out = layer norm of res with its mean and rstd, as k_residual_add then
    k_layernorm_fwd. Its backward needs no kernel of its own: the gradient of res passes to a and
    b unchanged, so k_layernorm_bwd adds the layer norm's part in place into the residual
    gradient (model.backward). amax: as k_layernorm_fwd's (of out)."""
    k_residual_add(res, a, b)
    k_layernorm_fwd(out, mean, rstd, res, weight, bias, amax)


def k_layernorm_fwd_fp8(out, out_t, res, mean, rstd, a, b, weight, bias, meta, amax_out):
    """The layer-norm forward that writes its output as an FP8 E4M3 operand (delayed scaling):
    res, mean, rstd as k_residual_layernorm_fwd writes them (b None: k_layernorm_fwd of a, res
    not written), and the layer norm's output y (a's dtype, not kept) cast by
    k_fp8_cast_transpose_amax(out, out_t, meta, y, "e4m3", amax_out)."""
    y = np.empty_like(a)
    if b is None:
        k_layernorm_fwd(y, mean, rstd, a, weight, bias)
    else:
        k_residual_layernorm_fwd(res, y, mean, rstd, a, b, weight, bias)
    k_fp8_cast_transpose_amax(out, out_t, meta, y.reshape(-1, y.shape[-1]), "e4m3", amax_out)
