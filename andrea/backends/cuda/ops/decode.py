"""Decoding against a KV cache (kernels/decode.cu), inference only: k_attn_decode_fwd (one
position), and the batched decoder's kernels (k_decode_embed_fwd, k_attn_decode_batch_fwd,
k_decode_cache_fill, k_decode_linear_fwd, k_decode_ln_linear_fwd, k_decode_logits_fwd, k_sample_fwd)."""
from __future__ import annotations

import numpy as np

from ...interface import DECODE_GEMV_ROWS
from ..geometry import attn_scale
from ..runtime import THREADS, blocks, check, i32
from .attention import attn_shapes

DECODE_THREADS = 256  # decode.cu's DECODE_THREADS: 8 warps share a head's keys
DECODE_MAX_HS = 128  # decode.cu's DECODE_MAX_HS


def decode_smem(kernel: str, ctx: int, hs: int) -> int:
    """Shared memory bytes of the decode attention: scores (ctx), q (hs), 32 reduction slots and
    the warps' partial outputs (8 hs), floats; the head size checked against DECODE_MAX_HS."""
    if hs > DECODE_MAX_HS:
        raise ValueError(f"{kernel}: head size {hs}; the decode kernels take at most {DECODE_MAX_HS}")
    return 4 * (ctx + hs + 32 + DECODE_THREADS // 32 * hs)


def decode_attention_checks(kernel: str, out, kcache, vcache, qkv, n_head):
    """(B, ctx, NH, hs, dtype) of a decode attention's arguments, each checked: qkv (B,1,3C), the
    caches (B,ctx,C) and out (B,1,C) in qkv's dtype; a ValueError naming the argument otherwise."""
    B, T, C, NH, hs = attn_shapes(kernel, qkv, n_head)
    ct = qkv.dtype
    if T != 1:
        raise ValueError(f"{kernel}: qkv has {T} positions, expected 1 (shape (B, 1, 3C))")
    ctx = kcache.shape[1] if kcache.ndim == 3 else 0
    check(kernel, "kcache", kcache, (B, ctx, C), ct)
    check(kernel, "vcache", vcache, (B, ctx, C), ct)
    check(kernel, "out", out, (B, 1, C), ct)
    return B, ctx, NH, hs, ct


GEMV_COLUMNS = 8  # output columns a block of the few-row products (a warp each)


def gemv_vec(inp, w, K: int) -> bool:
    """Whether the few-row products can load 16 bytes at a time: K a multiple of the chunk, both
    operands 16-byte aligned (else they load one element at a time)."""
    per = 16 // w.dtype.itemsize
    return K % per == 0 and inp.data.ptr % 16 == 0 and w.data.ptr % 16 == 0


class DecodeOps:
    """The decoding launchers of the CUDA backend."""

    def k_attn_decode_fwd(self, out, kcache, vcache, qkv, pos, n_head):
        """One new position against the KV cache (inference only): writes its k, v into row pos of
        kcache, vcache (B,ctx,C), then out (B,1,C) = its causal attention over rows 0..pos."""
        B, ctx, NH, hs, ct = decode_attention_checks("k_attn_decode_fwd", out, kcache, vcache, qkv, n_head)
        if not 0 <= pos < ctx:
            raise ValueError(f"k_attn_decode_fwd: pos {pos} outside the cache's {ctx} rows")
        self.rt.launch("decode.cu", "k_attn_decode_fwd", ct, (NH, B), DECODE_THREADS,
                       (out, kcache, vcache, qkv, i32(NH), i32(hs), i32(ctx), i32(pos), attn_scale(hs)),
                       shared_mem=decode_smem("k_attn_decode_fwd", ctx, hs))

    # ------------------------------------------------------------ batched decoding (andrea/use/batch.py)
    def k_decode_embed_fwd(self, out, tokens, lengths, wte, wpe):
        """out (N,1,C) = wte[tokens[n]] + wpe[lengths[n]]; tokens, lengths (N,) int32."""
        V, C = wte.shape
        N, ct = tokens.shape[0], wte.dtype
        check("k_decode_embed_fwd", "tokens", tokens, (N,), np.int32)
        check("k_decode_embed_fwd", "lengths", lengths, (N,), np.int32)
        check("k_decode_embed_fwd", "wpe", wpe, (wpe.shape[0], C), ct)
        check("k_decode_embed_fwd", "out", out, (N, 1, C), ct)
        self.rt.launch("decode.cu", "k_decode_embed_fwd", ct, N, 128 if C <= 512 else 256,
                       (out, tokens, lengths, wte, wpe, i32(C)))

    def k_attn_decode_batch_fwd(self, out, kcache, vcache, qkv, lengths, n_head):
        """k_attn_decode_fwd of each slot n at its own position lengths[n] (N,) int32."""
        N, ctx, NH, hs, ct = decode_attention_checks("k_attn_decode_batch_fwd", out, kcache, vcache, qkv, n_head)
        check("k_attn_decode_batch_fwd", "lengths", lengths, (N,), np.int32)
        self.rt.launch("decode.cu", "k_attn_decode_batch_fwd", ct, (NH, N), DECODE_THREADS,
                       (out, kcache, vcache, qkv, lengths, i32(NH), i32(hs), i32(ctx), attn_scale(hs)),
                       shared_mem=decode_smem("k_attn_decode_batch_fwd", ctx, hs))

    def k_attn_shared_fwd(self, out, qkv, saved, pre, plen, first, n_head, max_keys):
        """Row r of qkv (R,1,3C) over the plen[r] rows of saved (M,3C) from pre[r] on, then its
        option's rows first[r]..r; out (R,1,C). max_keys: at least every row's plen[r] + r -
        first[r] + 1 (the shared memory of its scores); the indices live on the device and are not
        checked here (shared.py's option_indices makes them, the NumPy reference checks them)."""
        R, _, C, NH, hs = attn_shapes("k_attn_shared_fwd", qkv, n_head)
        ct = qkv.dtype
        M = saved.shape[0]
        check("k_attn_shared_fwd", "saved", saved, (M, 3 * C), ct)
        check("k_attn_shared_fwd", "out", out, (R, 1, C), ct)
        for name, a in (("pre", pre), ("plen", plen), ("first", first)):
            check("k_attn_shared_fwd", name, a, (R,), np.int32)
        self.rt.launch("decode.cu", "k_attn_shared_fwd", ct, (R, NH), DECODE_THREADS,
                       (out, qkv, saved, pre, plen, first, i32(NH), i32(hs), i32(max_keys), attn_scale(hs)),
                       shared_mem=decode_smem("k_attn_shared_fwd", max_keys, hs))

    def k_decode_cache_fill(self, kcache, vcache, qkv, slot, n):
        """kcache, vcache (L,N,ctx,C)[:, slot, :n] = the k, v thirds of qkv (L,1,T,3C)[:, 0, :n]."""
        L, N, ctx, C = kcache.shape
        ct = kcache.dtype
        T = qkv.shape[2] if qkv.ndim == 4 else 0
        check("k_decode_cache_fill", "vcache", vcache, kcache.shape, ct)
        check("k_decode_cache_fill", "qkv", qkv, (L, 1, T, 3 * C), ct)
        if not (0 <= slot < N and 0 < n <= min(T, ctx)):
            raise ValueError(f"k_decode_cache_fill: slot {slot} of {N}, n {n} of {min(T, ctx)} rows")
        self.rt.launch("decode.cu", "k_decode_cache_fill", ct, blocks(L * n * C), THREADS,
                       (kcache, vcache, qkv, i32(L), i32(N), i32(ctx), i32(T), i32(C), i32(slot), i32(n)))

    def k_decode_linear_fwd(self, out, inp, w, b, gelu):
        """out (N,1,OC) = inp (N,1,IC) @ w (OC,IC).T + b, GELU where gelu; N <= DECODE_GEMV_ROWS."""
        OC, IC = w.shape
        N, ct = inp.shape[0], w.dtype
        if N > DECODE_GEMV_ROWS:
            raise ValueError(f"k_decode_linear_fwd: {N} rows; it takes at most {DECODE_GEMV_ROWS}")
        check("k_decode_linear_fwd", "inp", inp, (N, 1, IC), ct)
        check("k_decode_linear_fwd", "w", w, (OC, IC), ct)
        check("k_decode_linear_fwd", "b", b, (OC,), ct)
        check("k_decode_linear_fwd", "out", out, (N, 1, OC), ct)
        self.rt.launch("decode.cu", "k_decode_linear_fwd", ct, -(-OC // GEMV_COLUMNS), GEMV_COLUMNS * 32,
                       (out, inp, w, b, i32(N), i32(IC), i32(OC), i32(bool(gelu)), i32(gemv_vec(inp, w, IC))))

    def k_decode_ln_linear_fwd(self, out, res, a, b, ln_w, ln_b, w, bias, gelu):
        """res = a + b (b None: a, res unused) and its layer norm, then out (N,1,OC) = that @ w.T +
        bias, GELU where gelu: one launch, N <= DECODE_GEMV_ROWS."""
        kernel = "k_decode_ln_linear_fwd"
        OC, C = w.shape
        N, ct = a.shape[0], w.dtype
        if N > DECODE_GEMV_ROWS:
            raise ValueError(f"{kernel}: {N} rows; it takes at most {DECODE_GEMV_ROWS}")
        check(kernel, "a", a, (N, 1, C), ct)
        if b is not None:
            check(kernel, "b", b, (N, 1, C), ct)
            check(kernel, "res", res, (N, 1, C), ct)
        for name, x, shape in (("ln_w", ln_w, (C,)), ("ln_b", ln_b, (C,)), ("bias", bias, (OC,)),
                               ("out", out, (N, 1, OC))):
            check(kernel, name, x, shape, ct)
        has_b = b is not None
        self.rt.launch("decode.cu", kernel, ct, -(-OC // GEMV_COLUMNS), GEMV_COLUMNS * 32,
                       (out, res if has_b else a, a, b if has_b else a, i32(has_b), ln_w, ln_b, w, bias, i32(N),
                        i32(C), i32(OC), i32(bool(gelu)), i32(gemv_vec(w, w, C))),
                       shared_mem=N * C * ct.itemsize)

    def k_decode_logits_fwd(self, logits, inp, wte):
        """logits (N,V) float32 = inp (N,1,C) @ wte (V,C).T: k_decode_logits_gemv for N <=
        DECODE_GEMV_ROWS, else cuBLAS with a float32 output."""
        V, C = wte.shape
        N = inp.shape[0]
        check("k_decode_logits_fwd", "inp", inp, (N, 1, C), wte.dtype)
        check("k_decode_logits_fwd", "logits", logits, (N, V), np.float32)
        if N <= DECODE_GEMV_ROWS:
            self.rt.launch("decode.cu", "k_decode_logits_gemv", wte.dtype, -(-V // GEMV_COLUMNS), GEMV_COLUMNS * 32,
                           (logits, inp, wte, i32(N), i32(C), i32(V), i32(gemv_vec(inp, wte, C))))
            return
        self.blas.gemm(logits, inp, wte, False, True, N, V, C, C, C, V)

    def k_sample_fwd(self, tokens, lengths, logits, temperature, top_k, top_p, seeds, live, context):
        """Per live slot the token at position lengths[n] + 1 drawn from logits[n] (ref.sample_row)
        into tokens[n]; lengths[n] = min(that position, context - 1); a free slot: token 0, row 0."""
        N, V = logits.shape
        check("k_sample_fwd", "logits", logits, (N, V), np.float32)
        for name, a, dt in (("tokens", tokens, np.int32), ("lengths", lengths, np.int32),
                            ("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                            ("top_p", top_p, np.float32), ("seeds", seeds, np.uint64), ("live", live, np.int32)):
            check("k_sample_fwd", name, a, (N,), dt)
        self.rt.launch("decode.cu", "k_sample_fwd", np.float32, N, 1024,
                       (tokens, lengths, logits, temperature, top_k, top_p, seeds, live, i32(V), i32(context)))
