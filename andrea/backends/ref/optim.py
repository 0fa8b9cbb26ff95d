"""Clipping and the optimizer (kernels/optim.cu): the gradient norm, the end-of-step bookkeeping
in float64 (loss scale, non-finite policy, the AdamW scalars) into the optimizer state, AdamW, the
cast to the compute copy, and the FP8 form of the step that takes the weights' amax.

Global-norm clipping comes in two forms that compute the same values: k_grad_norm_partial,
k_grad_norm_final, k_grad_scale (the norm of the gradients as they are, then the gradients
multiplied by the clip factor), and the engine's fused step, k_step_check (the norm of the
averaged, unscaled gradients and the clip factor into the state) then k_adamw_step (which
multiplies by it). The two share _partials_sum, _grad_norm and _clip_factor.
"""
from __future__ import annotations

import math

import numpy as np

from ..interface import (S_BAD, S_CLIP, S_DECAY, S_GOOD, S_LOSS, S_LOSS_SUM, S_LR, S_NORM, S_REC_SCALE,
                         S_SCALE, S_SKIP, S_SKIPPED, S_STEP, S_STEP_SIZE, S_VHAT)
from .fp8 import k_fp8_amax

GRAD_NORM_PARTIALS = 64  # length of the partials buffer k_grad_norm_partial fills (NumpyBackend)


def k_grad_norm_partial(partials, grads):
    """partials[i] = sum of squares of the i-th of len(partials) equal chunks of grads (last short)."""
    n = grads.shape[0]
    P = partials.shape[0]
    chunk = -(-n // P)
    for i in range(P):
        g = grads[i * chunk:(i + 1) * chunk]
        partials[i] = np.dot(g, g) if g.size else 0.0


def _partials_sum(partials):
    """The sum of the norm partials in float64 (Python floats), in order, as the CUDA thread adds
    them (k_step_check)."""
    ss = 0.0
    for x in partials:  # in order, as the CUDA thread does
        ss += float(x)
    return ss


def _grad_norm(partials, pre_scale=1.0):
    """sqrt(_partials_sum(partials)) * pre_scale in float64, rounded to partials' dtype (a float)."""
    return float(partials.dtype.type(math.sqrt(_partials_sum(partials)) * pre_scale))


def _clip_factor(norm, max_norm, pre_scale=1.0):
    """pre_scale * min(1, max_norm / (norm + 1e-6)) in float64; max_norm <= 0: pre_scale (no clip)."""
    clip = 1.0
    if max_norm > 0:
        clip = min(1.0, max_norm / (norm + 1e-6))
    return pre_scale * clip


def k_grad_norm_final(state, partials):
    """Global-norm clipping: k_grad_norm_partial, k_grad_norm_final, k_grad_scale; the engine's
    fused step (k_step_check, k_adamw_step) computes the same values. state[S_NORM] = the global
    norm of the gradients k_grad_norm_partial reduced into partials: sqrt of the partials' sum,
    added in order in float64 (_partials_sum, as k_step_check adds them), rounded to partials'
    dtype. Nothing else in state is written. It is the norm k_step_check records, bit for bit,
    when n_micro * loss scale is 1 (k_step_check multiplies the square root by 1 / (n_micro *
    scale) before the rounding); a non-finite partial gives a non-finite norm."""
    state[S_NORM] = _grad_norm(partials)


def k_grad_scale(grads, state, max_norm):
    """Global-norm clipping: k_grad_norm_partial, k_grad_norm_final, k_grad_scale; the engine's
    fused step (k_step_check, k_adamw_step) computes the same values. grads *= f in place, with
    f = min(1, max_norm / (state[S_NORM] + 1e-6)) in float64 (1 where max_norm <= 0), rounded to
    grads' dtype: the clip factor k_step_check writes to state[S_CLIP] (_clip_factor, at a
    pre-scale of 1, rounded to partials' dtype) and k_adamw_step multiplies the gradients by (in
    params' dtype), so with one dtype throughout k_grad_scale then k_adamw_step with a clip
    factor of 1 gives the fused step's bits. A norm under max_norm - 1e-6 gives f = 1: grads
    keep their bits. A non-finite norm leaves grads as they are (k_step_check skips that step)."""
    norm = float(state[S_NORM])
    if not math.isfinite(norm):
        return
    grads *= grads.dtype.type(_clip_factor(norm, max_norm))


def k_loss_accum(state, losses):
    """state[S_LOSS_SUM] += sum of losses (one microbatch's positions), in float64."""
    state[S_LOSS_SUM] += float(losses.sum(dtype=np.float64))


def k_step_check(state, dloss, partials, n_micro, n_pos, beta1, beta2, weight_decay, max_norm,
                 fp16, growth_interval, max_scale):
    """The end of a step, on the device in the CUDA backend (one thread), in float64:
    norm = sqrt(sum of partials, in order) / (n_micro * loss scale), rounded to partials' dtype;
    loss = loss sum / n_pos / n_micro (the sum is then reset). Records both and the scale used.
    A non-finite loss or norm skips the update: skipped += 1, good streak 0, fp16 halves the scale
    (floor 1), and the bad streak grows unless it is an fp16 overflow (finite loss, scale > 1).
    Otherwise: the clip factor pre_scale * min(1, max_norm / (norm + 1e-6)) (max_norm <= 0: no
    clip), the AdamW scalars of update number t = step - skipped (decay 1 - lr*wd, step size
    lr / (1 - beta1^t), 1 / (1 - beta2^t)), all rounded to partials' dtype; bad streak 0, good
    streak + 1, and fp16 doubles the scale (at most max_scale) after growth_interval good steps.
    dloss[0] = the new scale / n_pos: the next backward pass's loss gradient."""
    rnd = partials.dtype.type
    scale = float(state[S_SCALE])
    pre_scale = 1.0 / (n_micro * scale)
    norm = _grad_norm(partials, pre_scale)
    loss = float(state[S_LOSS_SUM]) / n_pos / n_micro
    state[S_LOSS_SUM] = 0.0
    state[S_LOSS], state[S_NORM], state[S_REC_SCALE] = loss, norm, scale
    if not (math.isfinite(loss) and math.isfinite(norm)):
        state[S_SKIP] = 1.0
        state[S_SKIPPED] += 1.0
        state[S_GOOD] = 0.0
        overflow = bool(fp16) and math.isfinite(loss) and scale > 1.0
        if fp16:
            scale = max(1.0, scale * 0.5)
        state[S_BAD] = 0.0 if overflow else state[S_BAD] + 1.0
    else:
        state[S_SKIP] = 0.0
        lr = float(state[S_LR])
        t = float(state[S_STEP]) - float(state[S_SKIPPED])
        state[S_CLIP] = rnd(_clip_factor(norm, max_norm, pre_scale))
        state[S_DECAY] = rnd(1.0 - lr * weight_decay)
        state[S_STEP_SIZE] = rnd(lr * (1.0 / (1.0 - beta1 ** t)))
        state[S_VHAT] = rnd(1.0 / (1.0 - beta2 ** t))
        state[S_BAD] = 0.0
        state[S_GOOD] += 1.0
        if fp16 and state[S_GOOD] >= growth_interval:
            scale = min(max_scale, scale * 2.0)
            state[S_GOOD] = 0.0
    state[S_SCALE] = scale
    dloss[0] = scale / n_pos


def k_adamw_step(params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay, zero_grads=True):
    """One pass over the flat buffers after k_step_check: unless the step is skipped,
    g = grads * clip, then AdamW in place (m, v; decoupled decay on params[:n_decay], the matrices;
    bias-corrected step), then params_c = params in the compute dtype (params_c is params, or None,
    in float32 training). grads is zeroed either way, unless zero_grads is False (the engine's
    next backward pass starts the gradients itself: param_grad_pass(start=grads))."""
    if not state[S_SKIP]:
        dt = params.dtype.type
        g = grads * dt(state[S_CLIP])
        m *= beta1
        m += (1.0 - beta1) * g
        v *= beta2
        v += (1.0 - beta2) * g * g
        params[:n_decay] *= dt(state[S_DECAY])
        params -= dt(state[S_STEP_SIZE]) * m / (np.sqrt(v * dt(state[S_VHAT])) + eps)
        if params_c is not None and params_c is not params:
            params_c[...] = params
    if zero_grads:
        grads[...] = 0


def k_adamw_step_amax(params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay, segments, meta,
                      zero_grads=True):
    """k_adamw_step, then the FP8 weight cache's amax from the compute copy as the step leaves it
    (train.precision=fp8; optim.cu k_adamw_step_amax): for each segment t = (start, stop) of
    params_c (a weight's elements), meta[t, 0] = max(meta[t, 0], max |params_c[start:stop]|) as
    float32, NaN if any is NaN (k_fp8_amax_many zeroes meta first, then takes each k_fp8_amax).
    A skipped step changes no weight and still takes their amax."""
    k_adamw_step(params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay, zero_grads)
    pair = np.zeros(2, np.float32)
    for t, (start, stop) in enumerate(segments):
        k_fp8_amax(pair, params_c[start:stop])
        a, b = meta[t, 0], pair[0]
        meta[t, 0] = np.nan if np.isnan(a) or np.isnan(b) else max(a, b)


def k_cast_params(dst, src):
    """dst (compute dtype) = src (float32 master weights), rounded to nearest: a flat copy."""
    dst[...] = src
