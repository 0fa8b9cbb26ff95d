"""The MLP (kernels/mlp.cu, cuBLASLt): k_mlp_fwd, k_mlp_bwd, and their FP8 forms k_fp8_mlp_fwd /
k_fp8_mlp_bwd (train.precision=fp8).

16-bit: act = gelu(inp @ w1.T + b1) with pre saved by cuBLASLt's GELU epilogue (or a product and
k_mlp_fwd_bias_gelu), then out = act @ w2.T + b2. The backward's GELU pass makes act again for dw2
and dact *= gelu'(pre) in one pass over pre, with db1's column partials.

FP8: act is never stored in 16 bits: fp8(act) is made straight from pre (k_fp8_gelu_amax,
k_fp8_gelu_cast_transpose, or with act's delayed scale one cast that takes its amax as it goes),
and the backward's dact *= gelu'(pre) runs in one pass with dact's amax and the first bias's
column partials (k_fp8_dgelu_colsum_amax; with dact's delayed scale the same pass casts and
transposes d without a bf16 dact: k_fp8_dgelu_cast_transpose_colsum_amax).
"""
from __future__ import annotations

import numpy as np

from ...interface import FP8_FWD
from ..fp8.plan import META_STRIDE
from ..geometry import colsum_chunks
from ..runtime import MAX_BLOCKS, THREADS, blocks, check, cp, i32, i64


class MlpOps:
    """The MLP launchers of the CUDA backend, 16-bit and FP8 forms."""

    def k_mlp_fwd(self, out, pre, act, inp, w1, b1, w2, b2):
        """out (B,T,C) = gelu_tanh(inp @ w1.T + b1) @ w2.T + b2; saves pre (B,T,4C); act workspace."""
        if self.fp8 is not None:
            return self.k_fp8_mlp_fwd(out, pre, act, inp, w1, b1, w2, b2)
        H, C = w1.shape
        ct = w1.dtype
        check("k_mlp_fwd", "pre", pre, inp.shape[:-1] + (H,), ct)
        check("k_mlp_fwd", "act", act, pre.shape, ct)
        check("k_mlp_fwd", "b1", b1, (H,), ct)
        check("k_mlp_fwd", "w2", w2, (C, H), ct)
        check("k_mlp_fwd", "inp", inp, dtype=ct)
        N = inp.size // C
        # cuBLASLt: act = gelu(inp @ w1.T + b1) with pre saved by the epilogue, in one product
        if not self._lt_matmul(act, inp, w1, False, True, N, H, C, C, C, H, "gelu_aux_bias", bias=b1,
                               aux=pre, aux_ld=H):
            self._linear_fwd("k_mlp_fwd", pre, inp, w1, None, bias=False)
            self.rt.launch("mlp.cu", "k_mlp_fwd_bias_gelu", ct, min(N, MAX_BLOCKS), THREADS, (pre, act, b1, i64(N), i32(H)))
        self._linear_fwd("k_mlp_fwd", out, act, w2, b2)

    def k_mlp_bwd(self, dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, accumulate=True):
        """Adds into dinp, dw1 (4C,C), db1, dw2 (C,4C), db2 (accumulate=False writes dinp). act,
        dact (B,T,4C) are workspace."""
        if self.fp8 is not None:
            return self.k_fp8_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact,
                                      accumulate=accumulate)
        H, C = w1.shape
        ct = w1.dtype
        for n, a in (("pre", pre), ("act", act), ("dact", dact)):
            check("k_mlp_bwd", n, a, inp.shape[:-1] + (H,), ct)
        check("k_mlp_bwd", "w2", w2, (C, H), ct)
        check("k_mlp_bwd", "dout", dout, inp.shape, ct)
        check("k_mlp_bwd", "dw2", dw2, (C, H), np.float32)
        check("k_mlp_bwd", "db2", db2, (C,), np.float32)
        N = inp.size // C
        blas, gelu_grid = self.blas, blocks(-(-N * H // 8))  # 16-byte vectors of 8 halves
        db1_done = None  # (partials, chunks) when the GELU pass wrote db1's column partials
        # dact = (dout @ w2) * gelu'(pre) (overwrites) and act = gelu(pre) for dw2: the product, then
        # one pass over pre for both
        blas.gemm(dact, dout, w2, False, False, N, H, C, C, H, H)
        vec = 16 // np.dtype(ct).itemsize
        if H % vec == 0 and all(a.data.ptr % 16 == 0 for a in (act, dact, pre)):
            # the pass also writes db1's column partials, so the sums do not read dact again
            rpc, chunks = colsum_chunks(N)
            part = self.grads.partials("colsum_b", chunks, H)  # colsum_a: db2's below
            self.rt.launch("mlp.cu", "k_mlp_bwd_gelu_colsum", ct, (-(-H // (32 * vec)), chunks), (32, 8),
                           (part, act, dact, pre, i64(N), i32(H), i32(rpc)))
            db1_done = (part, chunks)
        else:
            self.rt.launch("mlp.cu", "k_mlp_bwd_gelu", ct, gelu_grid, THREADS, (act, dact, pre, i64(N * H)))
        blas.gemm(dw2, dout, act, True, False, C, H, N, C, H, H, beta=0.0 if self.grads.first_write(dw2) else 1.0)
        self.grads.add(db2, dout, N, C)
        self._linear_bwd("k_mlp_bwd", dinp, dw1, db1, dact, inp, w1, accumulate, db_partials=db1_done)

    # ------------------------------------------------------------ the FP8 form
    def k_fp8_mlp_fwd(self, out, pre, act, inp, w1, b1, w2, b2):
        """ref.k_fp8_mlp_fwd: pre = fp8(inp) @ fp8(w1).T + b1 (saved), then out = fp8(act)
        @ fp8(w2).T + b2 with act = gelu(pre): fp8(act) made from pre (k_fp8_gelu_amax,
        k_fp8_gelu_cast_transpose; with w2's input slot X^T kept too). act (workspace) is not
        written: the FP8 path never stores act in 16 bits."""
        H, C = w1.shape
        pre2 = pre.reshape(-1, H)
        self._fp8_fwd_product(pre2, inp.reshape(-1, C), w1, b1, fallback=lambda: self._bias_add(pre, b1))
        aq, a_inv = self._fp8_fwd_operand(act.reshape(-1, H), w2, pre=pre2)
        self._fp8_fwd_matmul(out.reshape(-1, C), aq, a_inv, w2, b2, fallback=lambda: self._bias_add(out, b2))

    def k_fp8_mlp_bwd(self, dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, grad_fmt=None,
                      accumulate=True):
        """ref.k_fp8_mlp_bwd: adds into dinp (accumulate=False: writes it), dw1, db1, dw2,
        db2; dact workspace, act unused. fp8(act)^T for dw2 is the one the forward kept, or else
        made again from pre (k_fp8_gelu_amax, k_fp8_gelu_cast_transpose: the same bytes); dact =
        fp8(dout) @ fp8(w2), then dact *= gelu'(pre) with its amax and db1's column partials in one
        pass (k_fp8_dgelu_colsum_amax; with dact's delayed scale, _fp8_dact_delayed)."""
        with self.fp8.grad_format(grad_fmt):
            self._fp8_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, accumulate)

    def _fp8_mlp_bwd(self, dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, accumulate):
        H, C = w1.shape
        dy2, act2, dact2, pre2 = dout.reshape(-1, C), act.reshape(-1, H), dact.reshape(-1, H), pre.reshape(-1, H)
        N = dy2.shape[0]
        slot = self.fp8.slot(w2, act2)
        x_t = None
        if slot is None or not slot.ready:  # dw2 needs fp8(act)^T: made again from pre, as the forward made it
            row = self.fp8.delayed_row("act", w2)
            meta = self.fp8.meta_of("x") if row is None else row
            if row is None or not self.fp8.delayed_live:
                self.fp8.k_fp8_gelu_amax(meta, pre2)
            q_t = self.workspace.get("fp8_x", N * H, np.uint8).reshape(H, N)
            self.fp8.k_fp8_gelu_cast_transpose(None, q_t, meta, pre2, FP8_FWD)
            x_t = (q_t, meta[META_STRIDE // 2:META_STRIDE // 2 + 1])

        def dact_product(dq, g, d_inv, wq_t, w_inv):  # dact = fp8(dout) @ fp8(w2)
            self.fp8.product(dact2, dq, g, d_inv, wq_t, FP8_FWD, w_inv)

        self._fp8_dgrad_wgrad(None, dw2, dy2, act2, w2, dx_epilogue=dact_product, x_t=x_t, db=db2)
        row = self.fp8.delayed_row("dy", w1)
        if row is not None:
            self._fp8_dact_delayed(dinp, dw1, db1, dact2, pre2, inp, w1, row, accumulate)
            return
        # dact *= gelu'(pre), with its amax and db1's column partials, in one pass
        rpc, chunks = colsum_chunks(N)
        part = self.grads.partials("colsum_b", chunks, H)
        self.fp8.k_fp8_dgelu_colsum_amax(part, self.fp8.meta_of("dy"), dact2, pre2, rpc)
        self._fp8_linear_bwd(dinp, dw1, db1, dact, inp, w1, accumulate, (part, chunks))

    def _fp8_dact_delayed(self, dinp, dw1, db1, dact2, pre2, inp, w1, row, accumulate):
        """The rest of the MLP backward with dact's delayed scale: one pass over dact and pre
        (k_fp8_dgelu_cast_transpose_colsum_amax) makes fp8(d) and fp8(d)^T for the two products,
        db1's column partials and d's amax for the history, d = dact * gelu'(pre) never stored;
        the first step takes d's amax in a pass of its own first (the same kernel, writing nothing
        else)."""
        N, H = dact2.shape
        C = w1.shape[1]
        g = self.fp8.grad_fmt
        chunks = -(-N // self.tuning.fp8_tile_rows)
        part = self.grads.partials("colsum_b", chunks, H)
        dq = self.workspace.get("fp8_dy", N * H, np.uint8).reshape(N, H)
        dq_t = self.fp8.dy_t(H, N)
        if not self.fp8.delayed_live:
            cp.cuda.runtime.memsetAsync(row.data.ptr, 0, 4, cp.cuda.get_current_stream().ptr)
            self.fp8.k_fp8_dgelu_cast_transpose_colsum_amax(None, None, self.fp8.meta_of("dy"), dact2, pre2, g, part, row[0:1])
        self.fp8.k_fp8_dgelu_cast_transpose_colsum_amax(dq, dq_t, row, dact2, pre2, g, part, self.fp8.record_at(row))
        self._fp8_dgrad_wgrad(dinp.reshape(-1, C), dw1, dact2, inp.reshape(-1, C), w1, accumulate=accumulate,
                          dy_q=(dq, dq_t, row[META_STRIDE // 2:META_STRIDE // 2 + 1]))
        self.grads.final(db1, part, chunks, H)
