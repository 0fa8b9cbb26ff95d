"""The linear layers (kernels/linear.cu, cuBLAS and cuBLASLt): k_attn_qkv_fwd/_bwd (Q, K, V
projection) and k_attn_out_fwd/_bwd (the output projection W_O), the shared product of every
layer with a bias, and its FP8 form k_fp8_linear_fwd/_bwd (train.precision=fp8), which the MLP's
and the classifier's FP8 forms build on.

16-bit: out = inp @ w.T + b on cuBLASLt's bias epilogue (or cuBLAS and k_bias_add); the backward's
two products on cuBLAS, the bias gradient the two-pass column sums of dout (gradpass.py).

FP8: each operand quantised with its own scale (fp8/state.py), E4M3 forward, the gradient format
for dY; the bias on cuBLASLt's epilogue where it has an FP8 algorithm for it, else k_bias_add
after. An input with an input slot is quantised once into X and X^T, the backward's weight
gradient reads that X^T; dY's cast also writes the bias gradient's column partials.
"""
from __future__ import annotations

import numpy as np

from ...interface import FP8_FWD
from ..cublas import cuda_type
from ..fp8.plan import META_STRIDE
from ..runtime import MAX_BLOCKS, THREADS, check, i32, i64


class LinearOps:
    """The linear-layer launchers of the CUDA backend, 16-bit and FP8 forms."""

    def _lt_matmul(self, D, A, B, ta, tb, M, N, K, lda, ldb, ldd, epilogue, bias=None, aux=None, aux_ld=0):
        """One cuBLASLt product with its epilogue; False when it does not apply (the caller falls
        back): cuBLASLt off or not loadable, or no algorithm for the problem."""
        lt = self.lt
        # cuBLASLt's heuristic assumes 256-byte aligned matrices (the arena's views and CuPy's pool are)
        if lt is None or any(x.data.ptr % 256 for x in (D, A, B)):
            return False
        from ..cublaslt import NoAlgorithm
        ab, d = cuda_type(A.dtype), cuda_type(D.dtype)
        try:
            lt.matmul(D, A, B, ta, tb, M, N, K, lda, ldb, ldd, ab, d, epilogue, bias=bias,
                      bias_type=cuda_type(bias.dtype) if bias is not None else None, aux=aux, aux_ld=aux_ld)
        except NoAlgorithm:
            return False
        return True

    def _linear_fwd(self, kernel, out, inp, w, b, bias=True):
        """out (N, OC) = inp (N, IC) @ w (OC, IC).T (+ b). With the FP8 path on, the layers'
        products (those with a bias) run in FP8 (k_fp8_linear_fwd)."""
        if bias and self.fp8 is not None:
            return self.k_fp8_linear_fwd(out, inp, w, b)
        OC, IC = w.shape
        ct = w.dtype
        check(kernel, "inp", inp, dtype=ct)
        check(kernel, "w", w, dtype=ct)
        if inp.shape[-1] != IC:
            raise ValueError(f"{kernel}: inp has shape {inp.shape}, its last axis must be {IC}")
        N = inp.size // IC
        check(kernel, "out", out, inp.shape[:-1] + (OC,), ct)
        if bias:
            check(kernel, "b", b, (OC,), ct)
            if self._lt_matmul(out, inp, w, False, True, N, OC, IC, IC, IC, OC, "bias", bias=b):
                return
        self.blas.gemm(out, inp, w, False, True, N, OC, IC, IC, IC, OC)
        if bias:
            self.rt.launch("linear.cu", "k_bias_add", ct, min(N, MAX_BLOCKS), THREADS, (out, b, i64(N), i32(OC)))

    def _linear_bwd(self, kernel, dinp, dw, db, dout, inp, w, accumulate=True, db_partials=None):
        """dinp (N, IC) += dout @ w (accumulate=False: =, beta 0); dw (OC, IC) += dout.T @ inp;
        db (OC,) += column sums of dout, or, with db_partials = (partials, chunks), of those column
        partials (k_colsum_partial's form) that the kernel which wrote dout also wrote."""
        if self.fp8 is not None:
            return self.k_fp8_linear_bwd(dinp, dw, db, dout, inp, w, accumulate=accumulate)
        OC, IC = w.shape
        ct = w.dtype
        N = inp.size // IC
        check(kernel, "inp", inp, dtype=ct)
        check(kernel, "dinp", dinp, inp.shape, ct)
        check(kernel, "dout", dout, inp.shape[:-1] + (OC,), ct)
        check(kernel, "dw", dw, (OC, IC), np.float32)
        check(kernel, "db", db, (OC,), np.float32)
        blas = self.blas
        blas.gemm(dinp, dout, w, False, False, N, IC, OC, OC, IC, IC, beta=1.0 if accumulate else 0.0)
        beta_w = 0.0 if self.grads.first_write(dw) else 1.0  # written by the first kernel of a starting pass
        blas.gemm(dw, dout, inp, True, False, OC, IC, N, OC, IC, IC, beta=beta_w)
        if db_partials is None:
            self.grads.add(db, dout, N, OC)
        else:
            part, chunks = db_partials
            self.grads.final(db, part, chunks, OC)

    def k_attn_qkv_fwd(self, qkv, inp, w, b):
        """qkv (B,T,3C) = inp (B,T,C) @ w (3C,C).T + b (3C,)."""
        self._linear_fwd("k_attn_qkv_fwd", qkv, inp, w, b)

    def k_attn_qkv_bwd(self, dinp, dw, db, dqkv, inp, w, accumulate=True):
        """Adds into dinp (B,T,C), dw (3C,C), db (3C,); accumulate=False writes dinp."""
        self._linear_bwd("k_attn_qkv_bwd", dinp, dw, db, dqkv, inp, w, accumulate)

    def k_attn_out_fwd(self, out, inp, w, b):
        """out (B,T,C) = inp (B,T,C) @ w (C,C).T + b: the output projection W_O."""
        self._linear_fwd("k_attn_out_fwd", out, inp, w, b)

    def k_attn_out_bwd(self, dinp, dw, db, dout, inp, w, accumulate=True):
        """Adds into dinp (B,T,C), dw (C,C), db (C,); accumulate=False writes dinp."""
        self._linear_bwd("k_attn_out_bwd", dinp, dw, db, dout, inp, w, accumulate)

    # ------------------------------------------------------------ the FP8 form
    def k_fp8_linear_fwd(self, out, inp, w, b):
        """out (B,T,OC) = fp8(inp) @ fp8(w).T + b; E4M3 operands, float32 accumulation."""
        OC, IC = w.shape
        self.fp8.made_by[out.data.ptr] = w.data.ptr
        self._fp8_fwd_product(out.reshape(-1, OC), inp.reshape(-1, IC), w, b, fallback=lambda: self._bias_add(out, b))

    def _bias_add(self, out, b):
        OC = b.size
        N = out.size // OC
        self.rt.launch("linear.cu", "k_bias_add", out.dtype, min(N, MAX_BLOCKS), THREADS, (out, b, i64(N), i32(OC)))

    def k_fp8_linear_bwd(self, dinp, dw, db, dout, inp, w, grad_fmt=None, accumulate=True):
        """Adds into dinp (B,T,IC), dw (OC,IC) float32, db (OC,) float32 (ref.k_fp8_linear_bwd;
        accumulate=False writes dinp); grad_fmt: this call's gradient format (default the backend's)."""
        with self.fp8.grad_format(grad_fmt):
            self._fp8_linear_bwd(dinp, dw, db, dout, inp, w, accumulate)

    def _fp8_linear_bwd(self, dinp, dw, db, dout, inp, w, accumulate, db_partials=None):
        """k_fp8_linear_bwd; db_partials = (partials, chunks): the kernel that wrote dout also wrote
        its column partials and put its amax in the dy meta (k_fp8_dgelu_colsum_amax)."""
        OC, IC = w.shape
        dy2 = dout.reshape(-1, OC)
        self._fp8_dgrad_wgrad(dinp.reshape(-1, IC), dw, dy2, inp.reshape(-1, IC), w, accumulate=accumulate,
                          dy_amax=db_partials is not None, db=db if db_partials is None else None)
        if db_partials is not None:
            self.grads.final(db, db_partials[0], db_partials[1], OC)

    def _fp8_fwd_product(self, out2, x2, w, b, fallback):
        """out2 (N, OC) = fp8(x2) @ fp8(w).T + b: the bias on cuBLASLt's epilogue where it has
        one, else a plain product and fallback() (the 16-bit path's bias kernel)."""
        xq, x_inv = self._fp8_fwd_operand(x2, w)
        self._fp8_fwd_matmul(out2, xq, x_inv, w, b, fallback)

    def _fp8_fwd_operand(self, x2, w, pre=None):
        """fp8(x2) (N, IC) in the workspace for the forward product of w, and its 1/scale: with
        x2's input slot, its amax from the producer (or taken here) and X^T kept in one pass.
        pre: x2 is act = gelu(pre), made from pre by the GELU kernels (x2 itself is not read)."""
        row = self.fp8.delayed_row("act" if pre is not None else "x", w)
        if row is not None:
            slot = self.fp8.slot(w, x2, forward=True)
            if pre is not None or slot is not None:  # an input's delayed scale: its slot's input only
                return self._fp8_fwd_delayed(x2, pre, row, slot)
        src, amax, cast_t = ((x2, self.fp8.k_fp8_amax, self.fp8.k_fp8_cast_transpose) if pre is None else
                             (pre, self.fp8.k_fp8_gelu_amax, self.fp8.k_fp8_gelu_cast_transpose))
        slot = self.fp8.slot(w, x2, forward=True)
        if slot is None:
            meta, xt = self.fp8.meta_of("x"), None
            amax(meta, src)
        else:  # x2's amax from its producer, or taken here; with a kept X^T both forms in one pass
            if slot.state != "amax":
                self.fp8.arm(slot)
                amax(slot.meta, src, zeroed=True)
            slot.state, meta, xt = "used", slot.meta, slot.xt
            slot.ready = xt is not None
        N, IC = x2.shape
        xq = self.workspace.get("fp8_x", N * IC, np.uint8).reshape(N, IC)
        if xt is None and pre is None:
            self.fp8.k_fp8_cast(xq, meta, src, FP8_FWD)
        else:
            cast_t(xq, xt, meta, src, FP8_FWD)
        return xq, meta[META_STRIDE // 2:META_STRIDE // 2 + 1]

    def _fp8_fwd_delayed(self, x2, pre, row, slot):
        """_fwd_operand with a delayed scale (x2 = act = gelu(pre) made from pre, or with pre None
        x2 itself): one pass casts it with the scale of row's history and reduces its amax into
        the row (the first step: its amax taken first); X^T kept in the slot (where there is
        one), whose 1/scale is the row's."""
        N, IC = x2.shape
        if slot is not None and slot.state == "cast":  # its layer norm wrote the operand (layernorm_operand)
            slot.state = "used"
            q = self.workspace.get("fp8_x", N * IC, np.uint8).reshape(N, IC)
            return q, row[META_STRIDE // 2:META_STRIDE // 2 + 1]
        xt = None
        if slot is not None:
            slot.state, xt = "used", slot.xt
            slot.ready = xt is not None
        if not self.fp8.delayed_live:
            (self.fp8.k_fp8_amax if pre is None else self.fp8.k_fp8_gelu_amax)(row, x2 if pre is None else pre)
        xq = self.workspace.get("fp8_x", N * IC, np.uint8).reshape(N, IC)
        if pre is None:
            self.fp8.k_fp8_cast_transpose_amax(xq, xt, row, x2, FP8_FWD, self.fp8.record_at(row))
        else:
            self.fp8.k_fp8_gelu_cast_transpose_amax(xq, xt, row, pre, FP8_FWD, self.fp8.record_at(row))
        return xq, row[META_STRIDE // 2:META_STRIDE // 2 + 1]

    def _fp8_fwd_matmul(self, out2, xq, x_inv, w, b, fallback):
        """out2 = xq @ fp8(w).T * both inverse scales + b (cuBLASLt's bias epilogue, else fallback())."""
        from ..cublaslt import NoAlgorithm
        wq, w_inv = self.fp8.weight(w)
        try:
            self.fp8.product(out2, xq, FP8_FWD, x_inv, wq, FP8_FWD, w_inv, "bias", bias=b, fast_accum=True)
        except NoAlgorithm:
            self.fp8.product(out2, xq, FP8_FWD, x_inv, wq, FP8_FWD, w_inv, fast_accum=True)
            fallback()

    def _fp8_dgrad_wgrad(self, dinp2, dw, dy2, x2, w, dx_epilogue=None, accumulate=True, dy_amax=False, x_t=None,
                         db=None, dy_q=None):
        """The two backward products of one linear layer with output gradient dy2: dinp2 +=
        fp8(dY) @ fp8(w) (accumulate=False: =; or, with dx_epilogue, written through it) and dw +=
        fp8(dY).T @ fp8(x2) (written where the pass starts dw). dy_amax: dy2's amax is in the dy
        meta already. x_t: (fp8(X)^T, its 1/scale) made by the caller (x2 is then not read). db:
        the bias gradient, += the column sums of dy2, whose partials dY's cast writes. dy_q:
        (fp8(dY), fp8(dY)^T, 1/scale) made by the caller (dy2 is then not read)."""
        g = self.fp8.grad_fmt
        partial = None
        pend = self.fp8.take_pending_dy(dy2, w)
        if pend is not None:  # the attention backward wrote fp8(dY), fp8(dY)^T and the column partials
            dy_q, (partial, chunks) = pend[:3], pend[3:]
            if db is None:
                raise RuntimeError("the attention backward wrote the QKV bias's column partials; "
                                   "its gradient is missing")
        elif db is not None:  # dY's cast writes the bias gradient's column partials (a row a tile)
            chunks = -(-dy2.shape[0] // self.tuning.fp8_tile_rows)
            partial = self.grads.partials("colsum_a", chunks, dy2.shape[1])
        if dy_q is not None:  # the attention's or the dGELU pass's, with dY's delayed scale
            dq, dq_t, d_inv = dy_q
        else:
            row = None if dy_amax else self.fp8.delayed_row("dy", w)
            dq, dq_t, d_inv = self.fp8.quantise("dy", dy2, g, transpose=True, both=True, amax_done=dy_amax,
                                                partial=partial, row=row)
        wq_t, w_inv = self.fp8.weight(w, transpose=True)
        slot = self.fp8.slot(w, x2)
        if dx_epilogue is None:
            self.fp8.product(dinp2, dq, g, d_inv, wq_t, FP8_FWD, w_inv, beta=1.0 if accumulate else 0.0)
        else:
            dx_epilogue(dq, g, d_inv, wq_t, w_inv)
        # X^T as the forward product quantised it, kept in the slot with its 1/scale until the next
        # forward pass; else X again (with a delayed scale: the forward's, nothing recorded)
        if x_t is None and slot is not None and slot.ready:
            x_t = slot.xt, slot.meta[META_STRIDE // 2:META_STRIDE // 2 + 1]
        if x_t is None:
            row = self.fp8.delayed_row("x", w) if slot is not None else None
            x_t = self.fp8.quantise("x", x2, FP8_FWD, transpose=True, row=row, record=False)[1:]
        beta = 0.0 if self.grads.first_write(dw) else 1.0
        self.fp8.product(dw, dq_t, g, d_inv, x_t[0], FP8_FWD, x_t[1], beta=beta)
        if partial is not None:
            self.grads.final(db, partial, chunks, dy2.shape[1])
