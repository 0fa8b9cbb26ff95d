"""The embedding (kernels/embed.cu): token and position embeddings added."""
from __future__ import annotations

import numpy as np


def k_embed_fwd(out, tokens, wte, wpe):
    """out (B,T,C) = wte[tokens] + wpe[:T]; tokens (B,T) int32, wte (V,C), wpe (context,C)."""
    T = tokens.shape[1]
    np.add(wte[tokens], wpe[:T][None], out=out)


def k_embed_bwd(dwte, dwpe, dout, tokens):
    """dwte[tokens] += dout, dwpe[:T] += sum over batch of dout (np.add.at: fixed order)."""
    B, T = tokens.shape
    np.add.at(dwte, tokens.reshape(-1), dout.reshape(B * T, -1))
    dwpe[:T] += dout.sum(axis=0)
