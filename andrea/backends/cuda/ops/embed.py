"""The token and position embedding (kernels/embed.cu): k_embed_fwd, k_embed_bwd.

The backward adds each row of dout into its token's row of dwte without atomics: the positions'
keys (token << shift | position) are sorted (by rank where B*T is small, else by one block's
bitonic sort), then one warp a run of equal tokens sums in position order.
"""
from __future__ import annotations

import numpy as np

from ..geometry import EMBED_RANK_KEYS, EMBED_WTE_WARPS
from ..runtime import MAX_BLOCKS, THREADS, check, cp, i32


class EmbedOps:
    """k_embed_fwd and k_embed_bwd of the CUDA backend (its rt, workspace, grads, tuning)."""

    def k_embed_fwd(self, out, tokens, wte, wpe):
        """out (B,T,C) = wte[tokens] + wpe[:T]; tokens (B,T) int32."""
        B, T = tokens.shape
        V, C = wte.shape
        ct = wte.dtype
        check("k_embed_fwd", "tokens", tokens, dtype=np.int32)
        check("k_embed_fwd", "wte", wte, dtype=ct)
        check("k_embed_fwd", "wpe", wpe, dtype=ct)
        check("k_embed_fwd", "out", out, (B, T, C), ct)
        if wpe.shape[0] < T or wpe.shape[1] != C:
            raise ValueError(f"k_embed_fwd: wpe has shape {wpe.shape}, needs at least ({T}, {C})")
        N = B * T
        self.rt.launch("embed.cu", "k_embed_fwd", ct, min(N, MAX_BLOCKS), THREADS,
                       (out, tokens, wte, wpe, i32(N), i32(T), i32(C), i32(V)))

    def k_embed_bwd(self, dwte, dwpe, dout, tokens):
        """dwte[tokens] += dout, dwpe[:T] += sum over batch of dout; no atomics (sorted tokens)."""
        B, T = tokens.shape
        V, C = dwte.shape
        ct = dout.dtype
        check("k_embed_bwd", "tokens", tokens, dtype=np.int32)
        check("k_embed_bwd", "dwte", dwte, dtype=np.float32)
        check("k_embed_bwd", "dwpe", dwpe, dtype=np.float32)
        check("k_embed_bwd", "dout", dout, (B, T, C))
        N = B * T
        shift = max(1, (N - 1).bit_length())
        if V << shift >= 1 << 32:
            raise ValueError(f"k_embed_bwd: vocab {V} with B*T={N} overflows the 32-bit sort key")
        P = 1 << shift
        keys = self.workspace.get("embed_keys", P, np.uint32)
        if N <= self.tuning.embed_rank_max:
            self.rt.launch("embed.cu", "k_embed_sort_rank", ct, -(-N // EMBED_RANK_KEYS), THREADS,
                           (keys, tokens, i32(N), i32(P), i32(shift)))
        else:
            use_shared = P * 4 <= 48 * 1024
            self.rt.launch("embed.cu", "k_embed_sort", ct, 1, 1024,
                           (keys, tokens, i32(N), i32(P), i32(shift), i32(int(use_shared))),
                           shared_mem=P * 4 if use_shared else 0)
        stream = cp.cuda.get_current_stream().ptr
        for grad in (dwte, dwpe):  # a starting pass: the kernels below add, so zero first (the
            if self.grads.first_write(grad):  # model's classifier has written the tied dwte before)
                cp.cuda.runtime.memsetAsync(grad.data.ptr, 0, grad.nbytes, stream)
        self.rt.launch("embed.cu", "k_embed_bwd_wte", ct, -(-N // EMBED_WTE_WARPS), 32 * EMBED_WTE_WARPS,
                       (dwte, keys, dout, i32(N), i32(C), i32(shift)))
        self.rt.launch("embed.cu", "k_embed_bwd_wpe", ct, -(-(T * C) // THREADS), THREADS,
                       (dwpe, dout, i32(B), i32(T), i32(C)))
