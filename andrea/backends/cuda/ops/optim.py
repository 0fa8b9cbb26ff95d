"""Clipping and the optimizer (kernels/optim.cu): k_grad_norm_partial, k_loss_accum, k_step_check,
k_adamw_step, k_cast_params, and the FP8 form k_adamw_step_amax (the update also takes the FP8
weight cache's amax as it writes the weights' compute copy).

The step's end runs in three launches: the norm's partial sums (k_grad_norm_partial), one thread's
bookkeeping (k_step_check: the global norm from the partials, the non-finite policy, the loss
scale, the clip factor and the bias corrections into the state vector), and the fused clip +
AdamW + cast (k_adamw_step). Global-norm clipping under the seed's names, k_grad_norm_partial,
k_grad_norm_final and k_grad_scale, computes the same norm and clip factor as separate kernels.
"""
from __future__ import annotations

import numpy as np

from ...interface import STATE_LEN
from ..fp8.plan import META_STRIDE
from ..geometry import STEP_CHECK_THREADS
from ..runtime import THREADS, blocks, check, cp, i32, i64


def adamw_args(params, pc, grads, m, v, state, beta1, beta2, eps, n_decay):
    """The arguments optim.cu's k_adamw_step and k_adamw_step_amax begin with."""
    f32 = np.float32
    return (params, pc, grads, m, v, state, i64(params.size), i64(n_decay), f32(beta1), f32(1.0 - beta1),
            f32(beta2), f32(1.0 - beta2), f32(eps))


class OptimOps:
    """The optimizer launchers of the CUDA backend."""

    def k_grad_norm_partial(self, partials, grads):
        """partials[i] = sum of squares of the i-th of len(partials) equal chunks of grads."""
        check("k_grad_norm_partial", "partials", partials, dtype=np.float32)
        check("k_grad_norm_partial", "grads", grads, dtype=np.float32)
        self.rt.launch("optim.cu", "k_grad_norm_partial", np.float32, partials.shape[0], THREADS,
                       (partials, grads, i64(grads.size)))

    def k_grad_norm_final(self, state, partials):
        """state[S_NORM] = sqrt of the sum of partials (in order, float64), rounded to float32: the
        global norm k_step_check records when n_micro * loss scale is 1 (ref.k_grad_norm_final).
        With k_grad_norm_partial and k_grad_scale: global-norm clipping as separate kernels; the
        engine's step runs the fused form (k_step_check, k_adamw_step)."""
        check("k_grad_norm_final", "state", state, (STATE_LEN,), np.float64)
        check("k_grad_norm_final", "partials", partials, dtype=np.float32)
        self.rt.launch("optim.cu", "k_grad_norm_final", np.float32, 1, 32, (state, partials, i32(partials.size)))

    def k_grad_scale(self, grads, state, max_norm):
        """grads *= min(1, max_norm / (state[S_NORM] + 1e-6)) rounded to float32 (1 where max_norm
        <= 0; a non-finite norm: unchanged): the clip factor of the fused step (ref.k_grad_scale)."""
        check("k_grad_scale", "grads", grads, dtype=np.float32)
        check("k_grad_scale", "state", state, (STATE_LEN,), np.float64)
        self.rt.launch("optim.cu", "k_grad_scale", np.float32, blocks(grads.size), THREADS,
                       (grads, state, i64(grads.size), np.float64(max_norm)))

    def k_loss_accum(self, state, losses):
        """state[S_LOSS_SUM] += sum of losses in float64 (one block)."""
        check("k_loss_accum", "state", state, (STATE_LEN,), np.float64)
        check("k_loss_accum", "losses", losses, dtype=np.float32)
        self.rt.launch("optim.cu", "k_loss_accum", np.float32, 1, 1024, (state, losses, i64(losses.size)))

    def k_step_check(self, state, dloss, partials, n_micro, n_pos, beta1, beta2, weight_decay, max_norm,
                     fp16, growth_interval, max_scale):
        """The end-of-step bookkeeping of ref.k_step_check, by one device thread (its block
        loads the partials and computes the bias corrections' powers alongside)."""
        check("k_step_check", "state", state, (STATE_LEN,), np.float64)
        check("k_step_check", "dloss", dloss, (1,), np.float32)
        check("k_step_check", "partials", partials, dtype=np.float32)
        f64 = np.float64
        self.rt.launch("optim.cu", "k_step_check", np.float32, 1, STEP_CHECK_THREADS,
                       (state, dloss, partials, i32(partials.size), i32(n_micro), f64(n_pos), f64(beta1),
                        f64(beta2), f64(weight_decay), f64(max_norm), i32(int(bool(fp16))),
                        f64(growth_interval), f64(max_scale)))

    def k_adamw_step(self, params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay, zero_grads=True):
        """Clip + AdamW + cast (+ zeroing of grads) in one pass, as ref.k_adamw_step."""
        for n, a in (("params", params), ("grads", grads), ("m", m), ("v", v)):
            check("k_adamw_step", n, a, params.shape, np.float32)
        check("k_adamw_step", "state", state, (STATE_LEN,), np.float64)
        cast = params_c is not None and params_c is not params
        if cast:
            check("k_adamw_step", "params_c", params_c, params.shape)
        pc = params_c if cast else params
        args = adamw_args(params, pc, grads, m, v, state, beta1, beta2, eps, n_decay)
        if cast and self.fp8 is not None and self.fp8.cache.adamw_amax_fits(pc, (params, grads, m, v)):
            self.k_adamw_step_amax(args, zero_grads)  # and the FP8 weight cache's amax
            return
        self.rt.launch("optim.cu", "k_adamw_step", pc.dtype, blocks(params.size), THREADS,
                       args + (i32(int(cast)), i32(int(bool(zero_grads)))))

    def k_cast_params(self, dst, src):
        """dst (compute dtype) = src (float32 master weights), a flat copy."""
        check("k_cast_params", "src", src, dtype=np.float32)
        check("k_cast_params", "dst", dst, src.shape)
        self.rt.launch("optim.cu", "k_cast_params", dst.dtype, blocks(src.size), THREADS, (dst, src, i64(src.size)))

    # ------------------------------------------------------------ the FP8 form
    def k_adamw_step_amax(self, args, zero_grads=True):
        """ref.k_adamw_step_amax with the cached weights as the segments: the cache's meta
        zeroed, then optim.cu's update, which also takes their amax into it; the next
        refresh_weight_cache casts without its amax pass. args: adamw_args (the caller checked
        the buffers and WeightCache.adamw_amax_fits)."""
        cache = self.fp8.cache
        meta, table, _, shapes = cache.args
        params, pc = args[0], args[1]
        cp.cuda.runtime.memsetAsync(meta.data.ptr, 0, meta.nbytes, cp.cuda.get_current_stream().ptr)
        self.rt.launch("optim.cu", "k_adamw_step_amax", pc.dtype, blocks(params.size), THREADS,
                       args + (i32(int(bool(zero_grads))), table, i32(len(shapes)), meta, i32(META_STRIDE)))
        cache.amax_taken = True
