"""Layer norm (kernels/layernorm.cu): k_layernorm_fwd, k_residual_layernorm_fwd (the residual add
fused in), k_layernorm_bwd, and the FP8 form k_layernorm_fwd_fp8 (train.precision=fp8 with
delayed scaling: the layer norms that make ln1 and ln2 write them as their products' FP8 operands
and X^T, no bf16 ln1 or ln2).
"""
from __future__ import annotations

import numpy as np

from ..geometry import LN_BLOCKS, LN_BLOCKS_WIDE, LN_FUSED_MAXC, LN_WIDE, colsum_chunks
from ..runtime import THREADS, check, cp, i32, i64


class LayerNormOps:
    """The layer-norm launchers of the CUDA backend, 16-bit and FP8 forms."""

    def k_layernorm_fwd(self, out, mean, rstd, inp, weight, bias, amax=None):
        """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T) float32.
        amax: None, or float32 whose [0] gets max |out| (as k_fp8_amax; train.precision=fp8)."""
        C = inp.shape[-1]
        ct = inp.dtype
        for n, a in (("out", out), ("inp", inp)):
            check("k_layernorm_fwd", n, a, inp.shape, ct)
        for n, a in (("weight", weight), ("bias", bias)):
            check("k_layernorm_fwd", n, a, (C,), ct)
        for n, a in (("mean", mean), ("rstd", rstd)):
            check("k_layernorm_fwd", n, a, inp.shape[:-1], np.float32)
        N = inp.size // C
        if amax is None and self._layernorm_fwd_fp8(None, out, mean, rstd, inp, None, weight, bias):
            return
        am = self._ln_amax("k_layernorm_fwd", out, amax)
        if not self._layernorm_fwd_vec(None, out, mean, rstd, inp, None, weight, bias, am):
            self.rt.launch("layernorm.cu", "k_layernorm_fwd", ct, -(-N // 8), THREADS,
                           (out, mean, rstd, inp, weight, bias, i64(N), i32(C), am))

    def k_residual_layernorm_fwd(self, res, out, mean, rstd, a, b, weight, bias, amax=None):
        """res = a + b (the residual stream), then out = layer norm of res, in one pass. amax: as
        k_layernorm_fwd's (of out)."""
        C = a.shape[-1]
        ct = a.dtype
        for n, x in (("res", res), ("out", out), ("a", a), ("b", b)):
            check("k_residual_layernorm_fwd", n, x, a.shape, ct)
        for n, x in (("weight", weight), ("bias", bias)):
            check("k_residual_layernorm_fwd", n, x, (C,), ct)
        for n, x in (("mean", mean), ("rstd", rstd)):
            check("k_residual_layernorm_fwd", n, x, a.shape[:-1], np.float32)
        N = a.size // C
        if amax is None and self._layernorm_fwd_fp8(res, out, mean, rstd, a, b, weight, bias):
            return
        am = self._ln_amax("k_residual_layernorm_fwd", out, amax)
        if not self._layernorm_fwd_vec(res, out, mean, rstd, a, b, weight, bias, am):
            self.rt.launch("layernorm.cu", "k_residual_layernorm_fwd", ct, -(-N // 8), THREADS,
                           (res, out, mean, rstd, a, b, weight, bias, i64(N), i32(C), am))

    def _ln_amax(self, kernel, out, amax):
        """The layer-norm forward kernels' amax pointer: amax where given (its [0] zeroed here
        first), else, with train.precision=fp8, the input slot of the FP8 product that reads out
        (Fp8.producer_amax: for ln1 and ln2 under current scaling), else null."""
        if amax is not None:
            check(kernel, "amax", amax, dtype=np.float32)
            cp.cuda.runtime.memsetAsync(amax.data.ptr, 0, 4, cp.cuda.get_current_stream().ptr)
            return amax
        meta = self.fp8.producer_amax(out) if self.fp8 is not None else None
        return np.uint64(0) if meta is None else meta

    def _layernorm_fwd_fp8(self, res, out, mean, rstd, a, b, weight, bias) -> bool:
        """train.precision=fp8: where out is an input whose FP8 operand the layer norm may write
        itself (Fp8.layernorm_operand: a delayed scale with a history, X^T kept), the layer norm
        writes that operand and X^T instead of out (k_layernorm_fwd_fp8; out is not written), for
        rows the vector kernel takes. False where it does not (the caller writes out)."""
        if self.fp8 is None or not self._ln_vec_rows(a, (res, out, a, b, weight, bias)):
            return False
        target = self.fp8.layernorm_operand(out)
        if target is None:
            return False
        q, q_t, row, rec = target
        self.k_layernorm_fwd_fp8(q, q_t, res, mean, rstd, a, b, weight, bias, row, rec)
        return True

    @staticmethod
    def _ln_vec_rows(a, bufs) -> bool:
        """Rows of a in whole 16-byte vectors, no wider than the vector kernels hold, every buffer
        16-byte aligned: what the layer norms' vector kernels take."""
        C = a.shape[-1]
        return C <= LN_FUSED_MAXC and C % (16 // a.dtype.itemsize) == 0 and all(
            x.data.ptr % 16 == 0 for x in bufs if x is not None)

    def _layernorm_fwd_vec(self, res, out, mean, rstd, a, b, weight, bias, amax) -> bool:
        """Version 2 of the layer-norm forward (16-byte loads, the row in registers, compiled for
        the row width) where the rows are whole aligned vectors; b None: no residual. False where
        it does not apply (the caller launches version 1)."""
        C = a.shape[-1]
        vec = 16 // a.dtype.itemsize
        if not self._ln_vec_rows(a, (res, out, a, b, weight, bias)):
            return False
        null = np.uint64(0)
        N = a.size // C
        self.rt.launch("layernorm.cu", "k_layernorm_fwd_vec", a.dtype, -(-N // 8), THREADS,
                       (null if res is None else res, out, mean, rstd, a, null if b is None else b, weight, bias,
                        i64(N), i32(C), amax), defs=(f"-DLN_MAXC={-(-C // (32 * vec)) * 32 * vec}",))
        return True

    def _ln_grid(self, C: int) -> int:
        """Blocks of the one-pass layer-norm backward over rows of C columns."""
        return self.tuning.ln_blocks or (LN_BLOCKS_WIDE if C >= LN_WIDE else LN_BLOCKS)

    def k_layernorm_bwd(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True):
        """Adds into dinp (B,T,C) (compute dtype; accumulate=False writes it), dweight, dbias (C,)
        float32."""
        C = inp.shape[-1]
        ct = inp.dtype
        for n, a in (("dinp", dinp), ("dout", dout), ("inp", inp)):
            check("k_layernorm_bwd", n, a, inp.shape, ct)
        check("k_layernorm_bwd", "weight", weight, (C,), ct)
        for n, a in (("dweight", dweight), ("dbias", dbias)):
            check("k_layernorm_bwd", n, a, (C,), np.float32)
        for n, a in (("mean", mean), ("rstd", rstd)):
            check("k_layernorm_bwd", n, a, inp.shape[:-1], np.float32)
        N = inp.size // C
        vec = 16 // inp.dtype.itemsize  # version 5 loads rows as whole 16-byte vectors
        if C <= LN_FUSED_MAXC and C % vec == 0 and all(a.data.ptr % 16 == 0 for a in (dinp, dout, inp, weight)):
            # version 5: rows, then columns, in each block; its partials of dweight/dbias added in block order
            rpb = -(-N // self._ln_grid(C))
            n_blocks = -(-N // rpb)
            pdw = self.grads.partials("colsum_a", n_blocks, C)
            pdb = self.grads.partials("colsum_b", n_blocks, C)
            self.rt.launch("layernorm.cu", "k_layernorm_bwd_fused", ct, n_blocks, THREADS,
                           (dinp, pdw, pdb, dout, inp, weight, mean, rstd, i64(N), i32(C), i32(rpb)),
                           defs=(f"-DLN_MAXC={-(-C // (32 * vec)) * 32 * vec}", f"-DLN_ACCUMULATE={int(bool(accumulate))}"))
            self.grads.final(dweight, pdw, n_blocks, C)
            self.grads.final(dbias, pdb, n_blocks, C)
            return
        # version 1: a row pass for dinp, then column partials added by k_colsum_final (version 2 of
        # the one-pass kernel is in git history; version 4, a grid sized to the SMs with its own
        # reduction tree, measured slower: docs/BENCHMARKS.md)
        self.rt.launch("layernorm.cu", "k_layernorm_bwd_dx", ct, -(-N // 8), THREADS,
                       (dinp, dout, inp, weight, mean, rstd, i64(N), i32(C), i32(int(accumulate))))
        rpb, n_blocks = colsum_chunks(N)
        pdw = self.grads.partials("colsum_a", n_blocks, C)
        pdb = self.grads.partials("colsum_b", n_blocks, C)
        self.rt.launch("layernorm.cu", "k_layernorm_bwd_partial", ct, (-(-C // 32), n_blocks), (32, 8),
                       (pdw, pdb, dout, inp, mean, rstd, i64(N), i32(C), i32(rpb)))
        self.grads.final(dweight, pdw, n_blocks, C)
        self.grads.final(dbias, pdb, n_blocks, C)

    # ------------------------------------------------------------ the FP8 form
    def k_layernorm_fwd_fp8(self, out, out_t, res, mean, rstd, a, b, weight, bias, meta, amax_out):
        """ref.k_layernorm_fwd_fp8 (layernorm.cu): the layer norm of a (N, C) (b None), or of
        res = a + b, written as E4M3 bytes out (N, C) and out_t (C, N) with the scale of meta[0];
        mean, rstd (N,) float32; meta[inv_at] = 1/scale; amax_out (1,) or None. C a multiple of
        16 / itemsize up to the one-pass layer norm's widest row, N a multiple of 8, arrays 16-byte
        aligned."""
        kernel = "k_layernorm_fwd_fp8"
        C = a.shape[-1]
        N, ct = a.size // C, a.dtype
        vec = 16 // ct.itemsize
        for n, x in (("a", a),) + (() if b is None else (("b", b), ("res", res))):
            check(kernel, n, x, a.shape, ct)
        for n, x in (("weight", weight), ("bias", bias)):
            check(kernel, n, x, (C,), ct)
        for n, x in (("mean", mean), ("rstd", rstd)):
            check(kernel, n, x, a.shape[:-1], np.float32)
        check(kernel, "out", out, (N, C), np.uint8)
        check(kernel, "out_t", out_t, (C, N), np.uint8)
        if N % 8 or not self._ln_vec_rows(a, (out, out_t, res, a, b, weight, bias)):
            raise ValueError(f"{kernel}: rows of {C} {ct} values, {N} rows; expected a multiple of {vec} values up "
                             f"to {LN_FUSED_MAXC}, a multiple of 8 rows and 16-byte aligned arrays")
        rows, warps = self.tuning.fp8_layernorm_rows, self.tuning.fp8_layernorm_warps  # Tuning checks both
        null = np.uint64(0)
        defs = (f"-DLN_MAXC={-(-C // (32 * vec)) * 32 * vec}", f"-DLN_FP8_ROWS={rows}")
        self.rt.launch("layernorm.cu", "k_layernorm_fwd_fp8", ct, -(-N // rows), 32 * warps,
                       (out, out_t, null if b is None else res, mean, rstd, a, null if b is None else b, weight,
                        bias, i64(N), i32(C), meta, self.fp8.inv_at(kernel, meta), self.fp8.amax_out(kernel, amax_out)),
                       defs=defs + ((f"-DLN_FP8_WARPS={warps}",) if warps != 8 else ()))
