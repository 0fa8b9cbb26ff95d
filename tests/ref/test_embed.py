"""ref/embed.py: the embedding pair against finite differences (refkit's gradient checks)."""
import numpy as np

from andrea.backends import ref as K
from refkit import B, C, T, V, rnd, run_pair


def test_embed(rng=np.random.default_rng(1)):
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[0, :3] = 5  # repeated tokens must accumulate
    inp = {"tokens": tokens, "wte": rnd(rng, V, C), "wpe": rnd(rng, T + 3, C)}
    run_pair(rng, K.k_embed_fwd,
             lambda g, R: K.k_embed_bwd(g["wte"], g["wpe"], R, tokens),
             inp, (B, T, C), ["wte", "wpe"])
