"""The classifier: cross-entropy over the tied projection (kernels/loss.cu, cuBLAS): k_loss_fwd,
k_loss_bwd, and their FP8 forms k_fp8_loss_fwd / k_fp8_loss_bwd (train.precision=fp8).

Per chunk of R rows (the logits workspace, core.model.loss_chunk_rows): the logits product, then
one row pass writes the loss and lse (and, backward, dlogits in place), then dinp and dwte. The
row pass holds a row in registers (version 2, geometry.loss_row_plan) or walks it (version 1).
A target of -1 (the ignore index, andrea/data/chat.py IGNORE_INDEX) gives its row loss 0 and a
zero row of dlogits in every row pass (kernels/loss.cu).

FP8 (the run's fp8_classifier): the tied embedding in the weight cache, lnf's output quantised
once a call, dlogits written in FP8 by the row pass with the scale of its bound
|softmax - onehot| <= 1 (no amax pass), rounded stochastically (fp8_dlogits_rounding), and
transposed for dW by k_fp8_transpose into the logits workspace the chunk no longer needs.
"""
from __future__ import annotations

import numpy as np

from ...interface import FP8_FWD, fp8_rounding
from ..fp8.plan import FP8_MULTIPLE, META_STRIDE, classifier_in_fp8
from ..geometry import LOSS_THREADS_V1, loss_row_plan, resident_blocks, sm_limits
from ..runtime import check, cp, i32, i64


def loss_checks(kernel, losses, lse, logits, inp, wte, targets):
    """Checks, and flat row views: x (N, C), targets, losses, lse (N,), logits as (R, V)."""
    V, C = wte.shape
    B, T = targets.shape
    ct = wte.dtype
    check(kernel, "targets", targets, dtype=np.int32)
    check(kernel, "losses", losses, (B, T), np.float32)
    check(kernel, "lse", lse, (B, T), np.float32)
    check(kernel, "logits", logits, dtype=ct)
    if logits.size % V or logits.size == 0:
        raise ValueError(f"{kernel}: logits has shape {logits.shape}; expected (R, {V}) rows of the vocab")
    check(kernel, "inp", inp, (B, T, C), ct)
    check(kernel, "wte", wte, dtype=ct)
    N = B * T
    return (inp.reshape(N, C), targets.reshape(N), losses.reshape(N), lse.reshape(N),
            logits.reshape(-1, V), N, V, C, ct)


def dloss_args(kernel, dloss):
    """The row pass's (dloss_ptr, dloss) arguments: a (1,) float32 device array read when the
    kernel runs, or a float."""
    if isinstance(dloss, cp.ndarray):
        check(kernel, "dloss", dloss, (1,), np.float32)
        return dloss, np.float32(0)
    return np.uint64(0), np.float32(dloss)


class LossOps:
    """The classifier launchers of the CUDA backend, 16-bit and FP8 forms."""

    def _loss_rows(self, bwd: bool, n: int, z, ct, args, fp8_defs=None):
        """The row pass over the n rows of chunk z (n, V): version 2 where loss_row_plan has one,
        else version 1 (the same lse bits in k_loss_fwd and k_loss_bwd either way: both take the
        same path for the same V, dtype and alignment). fp8_defs: the FP8 classifier's row pass
        (loss_bwd_fp8 / loss_bwd_fp8_regs, args ending in q8 and its 1/scale: k_fp8_loss_bwd),
        compiled with these defines (the format)."""
        lim = sm_limits(z.device.id)
        plan = None if z.data.ptr % 16 else loss_row_plan(z.shape[1], np.dtype(ct).itemsize, self.tuning.loss_vectors,
                                                          bool(self.tuning.loss_prefetch), lim["smem_optin"])
        kernel = "loss_bwd_fp8" if fp8_defs is not None else "loss_bwd" if bwd else "loss_fwd"
        extra = tuple(fp8_defs or ())
        if plan is None:
            self.rt.launch("loss.cu", kernel, ct, n, LOSS_THREADS_V1, args, defs=extra)
            return
        nv, threads, smem = plan
        defs = (f"-DLOSS_NV={nv}", f"-DLOSS_THREADS={threads}", f"-DLOSS_PREFETCH={int(smem > 0)}") + extra
        f = self.rt.function("loss.cu", kernel + "_regs", ct, defs)
        grid = min(n, self.tuning.loss_blocks or lim["sms"] * resident_blocks(f.num_regs, threads, smem, lim))
        self.rt.launch("loss.cu", kernel + "_regs", ct, grid, threads, args, shared_mem=smem, defs=defs)

    def _fp8_classifier(self, inp, wte, logits) -> int:
        """How many of the classifier's products run in FP8 (the run's train.fp8_classifier, the
        backend's fp8_classifier: 0, 1 the backward's, 2 all): train.precision=fp8 (the FP8 state
        exists) and sizes its FP8 products take (fp8.plan.classifier_in_fp8), else 0."""
        if self.fp8 is None or not self.fp8_classifier:
            return 0
        V = wte.shape[0]
        return int(self.fp8_classifier) if classifier_in_fp8(inp.size // inp.shape[-1], V, logits.size // V) else 0

    def k_loss_fwd(self, losses, lse, logits, inp, wte, targets):
        """Writes losses, lse (B,T); logits (R, V) is workspace: chunks of R rows of inp @ wte.T
        (with the FP8 classifier's logits, fp8_classifier 2: k_fp8_loss_fwd)."""
        if self._fp8_classifier(inp, wte, logits) == 2:
            return self.k_fp8_loss_fwd(losses, lse, logits, inp, wte, targets)
        x, tg, lf, lsef, z_all, N, V, C, ct = loss_checks("k_loss_fwd", losses, lse, logits, inp, wte, targets)
        R = z_all.shape[0]
        for r0 in range(0, N, R):
            n = min(R, N - r0)
            z = z_all[:n]
            self.blas.gemm(z, x[r0:r0 + n], wte, False, True, n, V, C, C, C, V)
            self._loss_rows(False, n, z, ct, (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V)))

    def k_loss_bwd(self, losses, lse, dinp, dwte, logits, inp, wte, targets, dloss, accumulate=True):
        """The fused classifier (ref.k_loss_bwd): per chunk of R rows the logits product, loss,
        lse and dlogits in place, then dinp (B,T,C) += dlogits @ wte (accumulate=False: =, beta 0;
        each chunk writes its own rows) and dwte (V,C) += dlogits.T @ inp. dloss: a float, or a (1,)
        float32 device array read when the kernel runs. With the FP8 classifier, k_fp8_loss_bwd."""
        level = self._fp8_classifier(inp, wte, logits)
        if level:
            return self.k_fp8_loss_bwd(losses, lse, dinp, dwte, logits, inp, wte, targets, dloss,
                                       accumulate=accumulate, fp8_logits=level == 2)
        x, tg, lf, lsef, z_all, N, V, C, ct = loss_checks("k_loss_bwd", losses, lse, logits, inp, wte, targets)
        check("k_loss_bwd", "dinp", dinp, inp.shape, ct)
        check("k_loss_bwd", "dwte", dwte, (V, C), np.float32)
        dl = dloss_args("k_loss_bwd", dloss)
        blas, dx, R = self.blas, dinp.reshape(N, C), z_all.shape[0]
        beta = 1.0 if accumulate else 0.0
        beta_w = 0.0 if self.grads.first_write(dwte) else 1.0  # the first chunk starts dwte in a starting pass
        for r0 in range(0, N, R):
            n = min(R, N - r0)
            z = z_all[:n]
            blas.gemm(z, x[r0:r0 + n], wte, False, True, n, V, C, C, C, V)
            self._loss_rows(True, n, z, ct, (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V)) + dl)
            blas.gemm(dx[r0:r0 + n], z, wte, False, False, n, C, V, V, C, C, beta=beta)
            blas.gemm(dwte, z, x[r0:r0 + n], True, False, V, C, n, V, C, C, beta=beta_w if r0 == 0 else 1.0)

    # ------------------------------------------------------------ the FP8 forms
    def _fp8_classifier_input(self, kernel, x, V, R):
        """x (N, C), lnf's output, gets one amax for all its rows (meta "cx"); each chunk is then
        cast with it (_classifier_logits)."""
        N, C = x.shape
        if not classifier_in_fp8(N, V, R):
            raise ValueError(f"{kernel}: N = {N} rows and V = {V} classes; the FP8 classifier wants both, and "
                             f"every chunk's rows, multiples of {FP8_MULTIPLE} (classifier_in_fp8)")
        meta = self.fp8.meta_of("cx")
        self.fp8.k_fp8_amax(meta, x)
        return meta

    def _fp8_classifier_logits(self, z, meta, x, wte, fp8_logits=True, transpose=False):
        """z (n, V) = the logits of a chunk's rows x (n, C): fp8(x) @ fp8(wte).T (the forward's fast
        accumulation; x with the scale of meta, the whole input's amax), or with fp8_logits False
        x @ wte.T in bf16 (cuBLAS, as the 16-bit path). transpose: fp8(x)^T (C, n) too, for dW, cast
        in the same pass. Returns (fp8(x)^T or None, x's 1/scale)."""
        n, C = x.shape
        ws = self.workspace
        xq = ws.get("fp8_cx", n * C, np.uint8).reshape(n, C) if fp8_logits else None
        xq_t = ws.get("fp8_cxt", n * C, np.uint8).reshape(C, n) if transpose else None
        if xq is not None or xq_t is not None:
            self.fp8.k_fp8_cast_transpose(xq, xq_t, meta, x, FP8_FWD)
        x_inv = meta[META_STRIDE // 2:META_STRIDE // 2 + 1]
        if fp8_logits:
            wq, w_inv = self.fp8.weight(wte)
            self.fp8.product(z, xq, FP8_FWD, x_inv, wq, FP8_FWD, w_inv, fast_accum=True)
        else:
            V = wte.shape[0]
            self.blas.gemm(z, x, wte, False, True, n, V, C, C, C, V)
        return xq_t, x_inv

    def k_fp8_loss_fwd(self, losses, lse, logits, inp, wte, targets):
        """ref.k_fp8_loss_fwd: per chunk logits = fp8(inp) @ fp8(wte).T (E4M3, the forward's
        fast accumulation), then the 16-bit path's row pass."""
        x, tg, lf, lsef, z_all, N, V, C, ct = loss_checks("k_fp8_loss_fwd", losses, lse, logits, inp, wte, targets)
        meta = self._fp8_classifier_input("k_fp8_loss_fwd", x, V, z_all.shape[0])
        R = z_all.shape[0]
        for r0 in range(0, N, R):
            n = min(R, N - r0)
            z = z_all[:n]
            self._fp8_classifier_logits(z, meta, x[r0:r0 + n], wte)
            self._loss_rows(False, n, z, ct, (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V)))

    def k_fp8_loss_bwd(self, losses, lse, dinp, dwte, logits, inp, wte, targets, dloss, dlogits_fmt=None,
                       accumulate=True, fp8_logits=True, rounding=None):
        """ref.k_fp8_loss_bwd: per chunk of R rows the logits product in FP8, the row pass
        writing loss, lse and FP8 dlogits (loss.cu loss_bwd_fp8*, the bound's scale: no amax pass),
        dinp = dlogits @ fp8(wte) (accumulate=False: written, each chunk its own rows), dlogits
        transposed (k_fp8_transpose, into the logits workspace, which the chunk no longer needs) and
        dwte += dlogits.T @ fp8(inp). dlogits_fmt: "e4m3" or "e5m2" (None: the run's fp8_dlogits).
        fp8_logits False: the logits product in bf16 (cuBLAS, as the 16-bit path), the two
        backward products in FP8. rounding: dlogits' rounding, "nearest" or "stochastic" (None:
        the run's fp8_dlogits_rounding; loss.cu -DFP8_SR)."""
        x, tg, lf, lsef, z_all, N, V, C, ct = loss_checks("k_fp8_loss_bwd", losses, lse, logits, inp, wte, targets)
        check("k_fp8_loss_bwd", "dinp", dinp, inp.shape, ct)
        check("k_fp8_loss_bwd", "dwte", dwte, (V, C), np.float32)
        fmt = dlogits_fmt or self.fp8_dlogits
        stochastic = fp8_rounding(rounding or self.fp8_dlogits_rounding) == "stochastic"
        defs = self.fp8.fmt_defs(fmt) + (f"-DFP8_SR={int(stochastic)}",)
        dl = dloss_args("k_fp8_loss_bwd", dloss)
        meta = self._fp8_classifier_input("k_fp8_loss_bwd", x, V, z_all.shape[0])
        dz_meta = self.fp8.meta_of("dz")
        dz_inv = dz_meta[META_STRIDE // 2:META_STRIDE // 2 + 1]
        dx, R = dinp.reshape(N, C), z_all.shape[0]
        beta = 1.0 if accumulate else 0.0
        beta_w = 0.0 if self.grads.first_write(dwte) else 1.0  # the first chunk starts dwte in a starting pass
        for r0 in range(0, N, R):
            n = min(R, N - r0)
            z = z_all[:n]
            xq_t, x_inv = self._fp8_classifier_logits(z, meta, x[r0:r0 + n], wte, fp8_logits, transpose=True)
            dz = self.workspace.get("fp8_dz", n * V, np.uint8).reshape(n, V)
            self._loss_rows(True, n, z, ct, (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V))
                           + dl + (dz, dz_inv, i64(r0)), fp8_defs=defs)
            wq_t, w_inv = self.fp8.weight(wte, transpose=True)
            self.fp8.product(dx[r0:r0 + n], dz, fmt, dz_inv, wq_t, FP8_FWD, w_inv, beta=beta)
            dz_t = cp.ndarray((V, n), dtype=np.uint8, memptr=z.data)  # the logits are spent
            self.fp8.k_fp8_transpose(dz_t, dz)
            self.fp8.product(dwte, dz_t, fmt, dz_inv, xq_t, FP8_FWD, x_inv, beta=beta_w if r0 == 0 else 1.0)
