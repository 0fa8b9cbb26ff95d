"""Decoding one position against a KV cache (kernels/decode.cu): k_attn_decode_fwd (inference only)."""
from __future__ import annotations

from ..geometry import attn_scale
from ..runtime import check, i32
from .attention import attn_shapes


class DecodeOps:
    """k_attn_decode_fwd of the CUDA backend."""

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
