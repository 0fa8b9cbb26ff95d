"""Decoding against a KV cache (kernels/decode.cu), inference only: k_attn_decode_fwd (one
position), and the batched decoder's kernels (k_decode_embed_fwd, k_attn_decode_batch_fwd,
k_decode_cache_fill, k_decode_logits_fwd, k_sample_fwd)."""
from __future__ import annotations

import numpy as np

from ..geometry import attn_scale
from ..runtime import THREADS, blocks, check, i32
from .attention import attn_shapes


class DecodeOps:
    """The decoding launchers of the CUDA backend."""

    def k_attn_decode_fwd(self, out, kcache, vcache, qkv, pos, n_head):
        """One new position against the KV cache (inference only): writes its k, v into row pos of
        kcache, vcache (B,ctx,C), then out (B,1,C) = its causal attention over rows 0..pos."""
        B, T, C, NH, hs = attn_shapes("k_attn_decode_fwd", qkv, n_head)
        ct = qkv.dtype
        if T != 1:
            raise ValueError(f"k_attn_decode_fwd: qkv has {T} positions, expected 1 (shape (B, 1, 3C))")
        ctx = kcache.shape[1] if kcache.ndim == 3 else 0
        check("k_attn_decode_fwd", "kcache", kcache, (B, ctx, C), ct)
        check("k_attn_decode_fwd", "vcache", vcache, (B, ctx, C), ct)
        check("k_attn_decode_fwd", "out", out, (B, 1, C), ct)
        if not 0 <= pos < ctx:
            raise ValueError(f"k_attn_decode_fwd: pos {pos} outside the cache's {ctx} rows")
        self.rt.launch("decode.cu", "k_attn_decode_fwd", ct, (NH, B), 128,
                       (out, kcache, vcache, qkv, i32(NH), i32(hs), i32(ctx), i32(pos),
                        attn_scale(hs)),
                       shared_mem=4 * (ctx + hs + 32))

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
        N, T, C, NH, hs = attn_shapes("k_attn_decode_batch_fwd", qkv, n_head)
        ct = qkv.dtype
        if T != 1:
            raise ValueError(f"k_attn_decode_batch_fwd: qkv has {T} positions, expected 1 (shape (N, 1, 3C))")
        ctx = kcache.shape[1] if kcache.ndim == 3 else 0
        check("k_attn_decode_batch_fwd", "kcache", kcache, (N, ctx, C), ct)
        check("k_attn_decode_batch_fwd", "vcache", vcache, (N, ctx, C), ct)
        check("k_attn_decode_batch_fwd", "out", out, (N, 1, C), ct)
        check("k_attn_decode_batch_fwd", "lengths", lengths, (N,), np.int32)
        self.rt.launch("decode.cu", "k_attn_decode_batch_fwd", ct, (NH, N), 128,
                       (out, kcache, vcache, qkv, lengths, i32(NH), i32(hs), i32(ctx), attn_scale(hs)),
                       shared_mem=4 * (ctx + hs + 32))

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

    def k_decode_logits_fwd(self, logits, inp, wte):
        """logits (N,V) float32 = inp (N,1,C) @ wte (V,C).T (cuBLAS, float32 output)."""
        V, C = wte.shape
        N = inp.shape[0]
        check("k_decode_logits_fwd", "inp", inp, (N, 1, C), wte.dtype)
        check("k_decode_logits_fwd", "logits", logits, (N, V), np.float32)
        self.blas.gemm(logits, inp, wte, False, True, N, V, C, C, C, V)

    def k_sample_fwd(self, tokens, lengths, logits, temperature, top_k, top_p, seeds, context):
        """Per slot the token at position lengths[n] + 1 drawn from logits[n] (ref.sample_row) into
        tokens[n]; lengths[n] = min(that position, context - 1)."""
        N, V = logits.shape
        check("k_sample_fwd", "logits", logits, (N, V), np.float32)
        for name, a, dt in (("tokens", tokens, np.int32), ("lengths", lengths, np.int32),
                            ("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                            ("top_p", top_p, np.float32), ("seeds", seeds, np.uint64)):
            check("k_sample_fwd", name, a, (N,), dt)
        self.rt.launch("decode.cu", "k_sample_fwd", np.float32, N, 1024,
                       (tokens, lengths, logits, temperature, top_k, top_p, seeds, i32(V), i32(context)))
