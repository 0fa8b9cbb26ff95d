"""Causal attention (kernels/attention.cu, attention_hopper.cu): k_attn_fwd, k_attn_bwd, and
their FP8 forms k_attn_fwd_fp8 / k_attn_bwd_fp8 (train.precision=fp8 with delayed scaling: the
wgmma kernels also write their outputs as the FP8 operands of the products that read them).

Paths: "fused" (version 4, mma.sync, for 16-bit dtypes and head sizes geometry.FLASH_HEAD_SIZES;
on compute capability 9.0 the wgmma kernels of attention_hopper.cu: forward version 8, backward
dQ version 10 and dK/dV version 7) or "materialised" (version 1: cuBLAS products, T x T scores,
float32 and everything else). The backend's attention= chooses; attention_variant says which runs.
"""
from __future__ import annotations

import math

import numpy as np

from ..fp8.plan import FP8_MULTIPLE
from ..geometry import (FLASH_HEAD_SIZES, attn_scale, device_fits_flash, device_takes_hopper, flash_geometry,
                        hopper_geometry)
from ..runtime import MAX_BLOCKS, THREADS, check, cp, i32, i64


def attn_shapes(kernel, qkv, n_head):
    """(B, T, C, n_head, head size) of qkv (B, T, 3C), checked."""
    check(kernel, "qkv", qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    if C3 % 3 or C % n_head:
        raise ValueError(f"{kernel}: qkv last axis {C3} must be 3*C with C divisible by n_head={n_head}")
    return B, T, C, n_head, C // n_head


class AttentionOps:
    """The attention launchers of the CUDA backend, 16-bit and FP8 forms."""

    def attention_variant(self, dtype, head_size: int) -> str:
        """The path k_attn_fwd/_bwd take for this compute dtype and head size (arrays 16-byte
        aligned, as the engine's are): "fused" (version 4) or "materialised" (version 1)."""
        fused = (self.attention == "fused" and np.dtype(dtype) != np.float32
                 and head_size in FLASH_HEAD_SIZES and device_fits_flash(head_size))
        return "fused" if fused else "materialised"

    def attention_kernels(self, dtype, head_size: int) -> str:
        """Which kernels k_attn_fwd/_bwd run for this dtype and head size, for the memory plan's line."""
        if self.attention_variant(dtype, head_size) != "fused":
            return "materialised (version 1: cuBLAS products, T x T scores)"
        if self._hopper(head_size):
            return "fused: wgmma, sm_90a (attention_hopper.cu: forward version 8, backward: dQ version 10, dK/dV version 7)"
        return "fused: mma.sync (version 4)"

    def _hopper(self, hs: int) -> bool:
        """The fused path's forward and the backward's dQ and dK/dV come from attention_hopper.cu
        (wgmma): compute capability 9.0, Tuning.hopper_attention set, and the tiles fit the device."""
        return (self.tuning.hopper_attention and hs in FLASH_HEAD_SIZES
                and device_takes_hopper(cp.cuda.Device().id, hs))

    def _fused(self, dtype, hs, *arrays) -> bool:
        """Version 4 applies: attention_variant says so, and every array is 16-byte aligned (its
        tiles are copied 16 bytes at a time)."""
        return (self.attention_variant(dtype, hs) == "fused"
                and all(a.data.ptr % 16 == 0 for a in arrays))

    def _attn_scores(self, qkv, B, T, C, NH, hs):
        """Split heads and compute S = Q K^T / sqrt(hs) (float32 workspace). Returns q, k, v, S."""
        ct = qkv.dtype
        N, BH = B * T, B * NH
        heads = self.workspace.get("attn_heads", 3 * N * C, ct)
        q, k, v = heads[:N * C], heads[N * C:2 * N * C], heads[2 * N * C:]
        self.rt.launch("attention.cu", "k_attn_split_heads", ct, min(B * T, MAX_BLOCKS), THREADS,
                       (q, k, v, qkv, i32(B), i32(T), i32(NH), i32(hs)))
        S = self.workspace.get("attn_scores", BH * T * T, np.float32)
        self.blas.gemm(S, q, k, False, True, T, T, hs, hs, hs, T, alpha=1.0 / math.sqrt(hs),
                       batch=BH, stride_a=T * hs, stride_b=T * hs, stride_c=T * T)
        return q, k, v, S

    def k_attn_fwd(self, out, lse, qkv, n_head):
        """Causal softmax(q k^T / sqrt(hs)) v into out (B,T,C); lse (B,NH,T) float32."""
        B, T, C, NH, hs = attn_shapes("k_attn_fwd", qkv, n_head)
        ct = qkv.dtype
        check("k_attn_fwd", "out", out, (B, T, C), ct)
        check("k_attn_fwd", "lse", lse, (B, NH, T), np.float32)
        scale = attn_scale(hs)
        if self._fused(ct, hs, qkv, out):
            args = (out, lse, qkv, i32(B), i32(T), i32(NH), scale)
            if self._attn_fwd_fp8(out, lse, qkv, n_head, T, C, hs):
                return
            if self._hopper(hs):  # version 8: wgmma, 256 threads, 128 query rows a block
                geo = hopper_geometry(hs)
                self.rt.launch("attention_hopper.cu", "k_attn_flash_fwd", ct, (B * NH, -(-T // geo["fwd_rows"])),
                               geo["threads"], args, shared_mem=geo["k_attn_flash_fwd"], hs=hs, arch="sm_90a")
                return
            geo = flash_geometry(hs)
            self.rt.launch("attention.cu", "k_attn_flash_fwd", ct, (B * NH, -(-T // geo["fwd_rows"])), 128,
                           args, shared_mem=geo["k_attn_flash_fwd"], hs=hs)
            return
        q, k, v, S = self._attn_scores(qkv, B, T, C, NH, hs)
        BH = B * NH
        P = self.workspace.get("attn_probs", BH * T * T, ct)
        self.rt.launch("attention.cu", "k_attn_softmax", ct, -(-(BH * T) // 8), THREADS,
                       (P, lse, S, i64(BH * T), i32(T), i32(1)))
        y = self.workspace.get("attn_y", B * T * C, ct)
        self.blas.gemm(y, P, v, False, False, T, hs, T, T, hs, hs,
                       batch=BH, stride_a=T * T, stride_b=T * hs, stride_c=T * hs)
        self.rt.launch("attention.cu", "k_attn_merge_heads", ct, min(B * T, MAX_BLOCKS), THREADS,
                       (out, y, i32(B), i32(T), i32(NH), i32(hs)))

    def _attn_fp8_applies(self, T, C, hs) -> bool:
        """The FP8 attention kernels can run: the FP8 path is on and their shapes fit
        (_attn_fp8_fits)."""
        return self.fp8 is not None and self._attn_fp8_fits(T, C, hs)

    def _attn_fwd_fp8(self, out, lse, qkv, n_head, T, C, hs) -> bool:
        """train.precision=fp8: where out is the input whose FP8 operand the attention may write
        itself (Fp8.attention_operand), k_attn_fwd_fp8 writes out and that operand with X^T.
        False where it does not (the caller launches the forward)."""
        if not self._attn_fp8_applies(T, C, hs):
            return False
        target = self.fp8.attention_operand(out)
        if target is None:
            return False
        q, q_t, row, rec = target
        self.k_attn_fwd_fp8(out, lse, q, q_t, row, rec, qkv, n_head)
        return True

    def _attn_bwd_fp8(self, dqkv, dout, qkv, out, lse, n_head, T, C, hs) -> bool:
        """train.precision=fp8: where dqkv is the output gradient the QKV product's backward will
        take in FP8 (Fp8.attention_grad_operand), k_attn_bwd_fp8 writes it so, with its column
        partials and amax, and not dqkv. False where it does not (the caller writes dqkv)."""
        if not self._attn_fp8_applies(T, C, hs):
            return False
        target = self.fp8.attention_grad_operand(dqkv, qkv)
        if target is None:
            return False
        q, q_t, row, rec, partial, fmt = target
        self.k_attn_bwd_fp8(q, q_t, partial, row, rec, dout, qkv, out, lse, n_head, fmt)
        return True

    def k_attn_bwd(self, dqkv, dout, qkv, out, lse, n_head, accumulate=True):
        """Adds into dqkv (B,T,3C) (accumulate=False: writes it); recomputes P from S and the
        saved lse."""
        B, T, C, NH, hs = attn_shapes("k_attn_bwd", qkv, n_head)
        ct = qkv.dtype
        check("k_attn_bwd", "dqkv", dqkv, qkv.shape, ct)
        check("k_attn_bwd", "dout", dout, (B, T, C), ct)
        check("k_attn_bwd", "out", out, (B, T, C), ct)
        check("k_attn_bwd", "lse", lse, (B, NH, T), np.float32)
        blas, N, BH = self.blas, B * T, B * NH
        if self.fp8 is not None:
            self.fp8.drop_pending_dy()  # an earlier backward's, never taken: not this dqkv's
        if self._fused(ct, hs, dqkv, qkv, dout, out):
            if not accumulate and self._attn_bwd_fp8(dqkv, dout, qkv, out, lse, n_head, T, C, hs):
                return
            scale = attn_scale(hs)
            D = self.workspace.get("attn_D", BH * T, np.float32)
            dims = (i32(B), i32(T), i32(NH), scale, i32(int(accumulate)))
            if self._hopper(hs):  # wgmma: the dQ kernel (version 10) writes D, which dK/dV (version 7) reads
                geo, hop = hopper_geometry(hs), dict(hs=hs, arch="sm_90a")
                self.rt.launch("attention_hopper.cu", "k_attn_flash_bwd_dq", ct, (BH, -(-T // geo["rows"])),
                               geo["threads"], (dqkv, qkv, dout, out, lse, D) + dims,
                               shared_mem=geo["k_attn_flash_bwd_dq"], **hop)
                self.rt.launch("attention_hopper.cu", "k_attn_flash_bwd_dkv", ct, (BH, -(-T // geo["keys"])),
                               geo["dkv_threads"], (dqkv, qkv, dout, lse, D) + dims,
                               shared_mem=geo["k_attn_flash_bwd_dkv"], **hop)
                return
            self.rt.launch("attention.cu", "k_attn_flash_D", ct, -(-(BH * T) // THREADS), THREADS,
                           (D, dout, out, i32(B), i32(T), i32(NH)), hs=hs)
            args = (dqkv, qkv, dout, lse, D) + dims
            geo = flash_geometry(hs)
            for kernel in ("k_attn_flash_bwd_dq", "k_attn_flash_bwd_dkv"):  # 64 query / key rows a block
                self.rt.launch("attention.cu", kernel, ct, (BH, -(-T // 64)), 128, args,
                               shared_mem=geo[kernel], hs=hs)
            return
        q, k, v, S = self._attn_scores(qkv, B, T, C, NH, hs)
        P = self.workspace.get("attn_probs", BH * T * T, ct)
        self.rt.launch("attention.cu", "k_attn_softmax", ct, -(-(BH * T) // 8), THREADS,
                       (P, lse, S, i64(BH * T), i32(T), i32(0)))
        dy = self.workspace.get("attn_y", N * C, ct)
        self.rt.launch("attention.cu", "k_attn_split_dout", ct, min(B * T, MAX_BLOCKS), THREADS,
                       (dy, dout, i32(B), i32(T), i32(NH), i32(hs)))
        dh = self.workspace.get("attn_dheads", 3 * N * C, np.float32)
        dq, dk, dv = dh[:N * C], dh[N * C:2 * N * C], dh[2 * N * C:]
        th, tt = T * hs, T * T
        blas.gemm(dv, P, dy, True, False, T, hs, T, T, hs, hs, batch=BH, stride_a=tt, stride_b=th, stride_c=th)
        blas.gemm(S, dy, v, False, True, T, T, hs, hs, hs, T, batch=BH, stride_a=th, stride_b=th, stride_c=tt)
        self.rt.launch("attention.cu", "k_attn_dscores", ct, -(-(BH * T) // 8), THREADS,
                       (P, S, dout, out, i64(BH * T), i32(T), i32(NH), i32(hs), attn_scale(hs)))
        blas.gemm(dq, P, k, False, False, T, hs, T, T, hs, hs, batch=BH, stride_a=tt, stride_b=th, stride_c=th)
        blas.gemm(dk, P, q, True, False, T, hs, T, T, hs, hs, batch=BH, stride_a=tt, stride_b=th, stride_c=th)
        self.rt.launch("attention.cu", "k_attn_merge_grads", ct, min(B * T, MAX_BLOCKS), THREADS,
                       (dqkv, dq, dk, dv, i32(B), i32(T), i32(NH), i32(hs), i32(int(accumulate))))

    # ------------------------------------------------------------ the FP8 forms
    def _attn_fp8_fits(self, T, C, hs) -> bool:
        """The FP8 attention kernels take these shapes: the wgmma kernels (_hopper) at this
        head size, T a multiple of 64 (a warpgroup's rows are a 64-row tile of the casts), C a
        multiple of 16."""
        return T % 64 == 0 and C % FP8_MULTIPLE == 0 and self._hopper(hs)

    def _attn_fp8_check(self, kernel, qkv, n_head, arrays):
        """The shapes (B, T, C, NH, hs) of an FP8 attention launch, after its conditions
        (attention_fits, arrays 16-byte aligned)."""
        B, T, C, NH, hs = attn_shapes(kernel, qkv, n_head)
        if not self._attn_fp8_fits(T, C, hs) or any(a.data.ptr % 16 for a in arrays):
            raise ValueError(f"{kernel}: B={B} T={T} C={C} head size {hs}; expected the wgmma attention "
                             f"(compute capability 9.0), T a multiple of 64, C of {FP8_MULTIPLE}, 16-byte "
                             "aligned arrays")
        return B, T, C, NH, hs

    def k_attn_fwd_fp8(self, out, lse, q, q_t, meta, amax_out, qkv, n_head):
        """ref.k_attn_fwd_fp8 (attention_hopper.cu k_attn_flash_fwd_fp8): out (B,T,C) and lse
        (B,NH,T) as k_attn_fwd writes them, and out as E4M3 bytes q (B*T, C) and q_t (C, B*T) with
        the scale of meta[0]; meta[inv_at] = 1/scale; amax_out (1,) or None."""
        kernel = "k_attn_fwd_fp8"
        B, T, C, NH, hs = self._attn_fp8_check(kernel, qkv, n_head, (qkv, out))
        ct = qkv.dtype
        check(kernel, "out", out, (B, T, C), ct)
        check(kernel, "lse", lse, (B, NH, T), np.float32)
        check(kernel, "q", q, (B * T, C), np.uint8)
        check(kernel, "q_t", q_t, (C, B * T), np.uint8)
        geo = hopper_geometry(hs)
        self.rt.launch("attention_hopper.cu", "k_attn_flash_fwd_fp8", ct, (B * NH, -(-T // geo["fwd_rows"])),
                       geo["threads"], (out, lse, q, q_t, meta, self.fp8.inv_at(kernel, meta),
                                        self.fp8.amax_out(kernel, amax_out), qkv, i32(B), i32(T), i32(NH),
                                        attn_scale(hs)),
                       shared_mem=geo["k_attn_flash_fwd"], hs=hs, arch="sm_90a")

    def k_attn_bwd_fp8(self, q, q_t, partial, meta, amax_out, dout, qkv, out, lse, n_head, fmt):
        """ref.k_attn_bwd_fp8 (attention_hopper.cu k_attn_flash_bwd_dq_fp8, then
        k_attn_flash_bwd_dkv_fp8): dqkv as k_attn_bwd writes it (accumulate=False), but only as
        bytes of format fmt q (B*T, 3C) and q_t (3C, B*T) with the scale of meta[0], its column
        sums over each 64-row tile into partial (B*T / 64, 3C) float32 or None, its amax into
        amax_out (1,) or None; meta[inv_at] = 1/scale. dqkv itself is not written."""
        kernel = "k_attn_bwd_fp8"
        B, T, C, NH, hs = self._attn_fp8_check(kernel, qkv, n_head, (qkv, dout, out))
        ct, N = qkv.dtype, B * T
        for name, x in (("dout", dout), ("out", out)):
            check(kernel, name, x, (B, T, C), ct)
        check(kernel, "lse", lse, (B, NH, T), np.float32)
        check(kernel, "q", q, (N, 3 * C), np.uint8)
        check(kernel, "q_t", q_t, (3 * C, N), np.uint8)
        if partial is not None:
            check(kernel, "partial", partial, (N // 64, 3 * C), np.float32)
        geo, hop = hopper_geometry(hs), dict(hs=hs, arch="sm_90a", defs=self.fp8.fmt_defs(fmt))
        D = self.workspace.get("attn_D", B * NH * T, np.float32)
        scale, dims = attn_scale(hs), (i32(B), i32(T), i32(NH))
        part, amax = (np.uint64(0) if partial is None else partial), self.fp8.amax_out(kernel, amax_out)
        self.rt.launch("attention_hopper.cu", "k_attn_flash_bwd_dq_fp8", ct, (B * NH, -(-T // geo["rows"])),
                       geo["threads"], (q, q_t, part, meta, self.fp8.inv_at(kernel, meta), amax, qkv, dout, out, lse,
                                        D) + dims + (scale,), shared_mem=geo["k_attn_flash_bwd_dq"], **hop)
        self.rt.launch("attention_hopper.cu", "k_attn_flash_bwd_dkv_fp8", ct, (B * NH, -(-T // geo["keys"])),
                       geo["dkv_threads"], (q, q_t, part, meta, amax, qkv, dout, lse, D) + dims + (scale,),
                       shared_mem=geo["k_attn_flash_bwd_dkv"], **hop)
