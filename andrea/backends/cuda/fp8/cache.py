"""The FP8 weight cache: FP8 copies of the linear weights, W and W^T, written once per optimizer step.

The weights change once per optimizer step, not once per product: the engine keeps an FP8 copy of
every linear weight W and of its transpose W^T with their (amax, 1/scale) in its arena
(plan.weight_cache_rows), hands them over with `use`, and `refresh` rewrites them after each update
(inside the optimizer's CUDA graph) and whenever the weights are loaded: one memset,
k_fp8_amax_many and k_fp8_cast_transpose_many for all of them (the classifier's embedding, far
larger, on its own). The products then read the copies instead of quantising W themselves; the
bytes and scales are those the per-product quantisation writes for the same weights. The
optimizer's update may take the cached weights' amax as it writes their compute copy
(ops/optim.py k_adamw_step_amax), and the next refresh then casts without its amax pass.
"""
from __future__ import annotations

from ...interface import FP8_FWD
from ..runtime import check
from .plan import ADAMW_AMAX_MAX, CACHE_ALIGN, META_STRIDE, _aligned, weight_cache_rows


class WeightCache:
    """The weight cache of one backend (empty until `use`): copies, (address, shape, dtype) of a
    weight -> (W fp8, W^T fp8, its meta row (META_STRIDE,)); args, (meta (n, META_STRIDE), table,
    dtype, shapes) of the refresh; weights, the cached weights in order; alone, (w, fp8 W, fp8 W^T,
    meta row) of those refreshed on their own; amax_taken: the update just queued took their amax."""

    def __init__(self, quant):
        self.quant = quant
        self.copies: dict = {}
        self.args = None
        self.weights, self.alone, self.amax_taken = [], [], False

    def use(self, weights, data, meta, table, alone=0):
        """Keep FP8 copies of weights (a list of (R, K) compute-dtype arrays that the products will
        be given, the same views) in data (uint8), their (amax, 1/scale) in meta (float32, META_STRIDE
        a weight) and the kernels' table in table: the rows weight_cache_rows planned. Fills them
        now (refresh_weight_cache); from then on the products read the copies of these weights.
        alone: the first `alone` weights are refreshed by the single-tensor kernels (k_fp8_amax,
        k_fp8_cast_transpose: the same bytes) rather than in the *_many launches, whose grid gives
        every tensor the blocks of the largest: the classifier's embedding (V, C) is 16 times the
        largest linear weight at ANDREA-120M, and its blocks alone would be the launch's tail."""
        shapes = [tuple(w.shape) for w in weights]
        need = {name: (shape, dtype) for name, shape, dtype in weight_cache_rows(shapes)}
        for name, a in (("fp8_wcache", data), ("fp8_wmeta", meta), ("fp8_wtable", table)):
            check("use_weight_cache", name, a, need[name][0], need[name][1])
        if data.data.ptr % CACHE_ALIGN or meta.data.ptr % 128:
            raise ValueError(f"use_weight_cache: fp8_wcache at {data.data.ptr:#x} and fp8_wmeta at "
                             f"{meta.data.ptr:#x}: expected {CACHE_ALIGN}- and 128-byte alignment")
        meta2 = meta.reshape(len(weights), META_STRIDE)
        outs, outs_t, off = [], [], 0
        for R, K in shapes:
            n = R * K
            outs.append(data[off:off + n].reshape(R, K))
            outs_t.append(data[off + _aligned(n):off + _aligned(n) + n].reshape(K, R))
            off += 2 * _aligned(n)
        self.quant.make_table(weights, outs, outs_t, table)
        self.args = (meta2, table, weights[0].dtype, shapes)
        self.weights = list(weights)
        self.amax_taken = False  # k_adamw_step_amax took the amax the next refresh needs
        self.alone = [(w, outs[i], outs_t[i], meta2[i]) for i, w in enumerate(weights[:alone])]
        self.copies = {(w.data.ptr, tuple(w.shape), w.dtype.name): (q, qt, meta2[i])
                      for i, (w, q, qt) in enumerate(zip(weights, outs, outs_t))}
        self.refresh()

    def refresh(self):
        """Rewrite every cached copy and its scale from the weights as they are now: after each
        optimizer update and after the weights are loaded (Engine). Three launches (a memset,
        k_fp8_amax_many, k_fp8_cast_transpose_many); nothing where no cache is in use."""
        if self.args is None:
            return
        meta, table, dtype, shapes = self.args
        taken, self.amax_taken = self.amax_taken, False  # by the update just queued: no amax pass
        k = len(self.alone)  # the first k weights, on their own
        for w, q, q_t, row in self.alone:
            if not taken:
                self.quant.k_fp8_amax(row, w)
            self.quant.k_fp8_cast_transpose(q, q_t, row, w, FP8_FWD)
        if k < len(shapes):
            if not taken:
                self.quant.k_fp8_amax_many(meta[k:], table[k:], dtype, shapes[k:])
            self.quant.k_fp8_cast_transpose_many(meta[k:], table[k:], FP8_FWD, dtype, shapes[k:])

    def adamw_amax_fits(self, params_c, floats) -> bool:
        """The update into params_c can take the weight cache's amax (k_adamw_step_amax): a cache
        is in use, the cached weights lie in params_c in increasing address order without overlap,
        each at a multiple of 4 elements, and the kernel's vectors fit (the float32 buffers floats,
        params grads m v, 16-byte aligned; params_c 4 elements aligned, a multiple of 4 long)."""
        if self.args is None or len(self.weights) > ADAMW_AMAX_MAX:
            return False
        base, size, item = params_c.data.ptr, params_c.size, params_c.itemsize
        if params_c.dtype != self.args[2] or size % 4 or base % (4 * item) or \
                any(x.data.ptr % 16 for x in floats):
            return False
        end = 0  # the weights in increasing address order, apart (the kernel's binary search)
        for w in self.weights:
            off = w.data.ptr - base
            if off < end or off % (4 * item) or off // item + w.size > size:
                return False
            end = off + w.nbytes
        return True

    def get(self, w):
        """(fp8(w) (R, K), fp8(w)^T (K, R), meta row: amax at 0, 1/scale at META_STRIDE // 2) of a
        weight the cache keeps, or None."""
        return self.copies.get((w.data.ptr, tuple(w.shape), w.dtype.name)) if self.copies else None
