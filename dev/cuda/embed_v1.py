"""The launcher of embed_v1.cu's backward: the one-block bitonic sort at every B*T."""
import numpy as np

from andrea.backends.cuda.ops import THREADS, i32


def k_embed_bwd(be, dwte, dwpe, dout, tokens):
    B, T = tokens.shape
    V, C = dwte.shape
    ct = dout.dtype
    N = B * T
    shift = max(1, (N - 1).bit_length())
    P = 1 << shift
    keys = be.workspace.get("embed_keys", P, np.uint32)
    use_shared = P * 4 <= 48 * 1024
    be.rt.launch("embed.cu", "k_embed_sort", ct, 1, 1024, (keys, tokens, i32(N), i32(P), i32(shift), i32(int(use_shared))),
                 shared_mem=P * 4 if use_shared else 0)
    be.rt.launch("embed.cu", "k_embed_bwd_wte", ct, (N, -(-C // 128)), 128, (dwte, keys, dout, i32(N), i32(C), i32(shift)))
    be.rt.launch("embed.cu", "k_embed_bwd_wpe", ct, -(-(T * C) // THREADS), THREADS, (dwpe, dout, i32(B), i32(T), i32(C)))
