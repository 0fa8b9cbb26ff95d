"""ref/decode.py: the KV-cache attention of one position against the causal attention."""
import numpy as np

from andrea.backends import ref as K


def test_decode_kernel_is_row_pos_of_causal_attention():
    """k_attn_decode_fwd at odd sizes equals k_attn_fwd's row for that position, and writes
    exactly one cache row per call."""
    rng = np.random.default_rng(4)
    B, T, NH, hs, ctx = 2, 9, 3, 5, 11
    C = NH * hs
    qkv = rng.normal(size=(B, T, 3 * C))
    out_full, lse = np.zeros((B, T, C)), np.zeros((B, NH, T))
    K.k_attn_fwd(out_full, lse, qkv, NH)
    kc, vc = np.full((B, ctx, C), np.nan), np.full((B, ctx, C), np.nan)
    for t in range(T):
        out = np.full((B, 1, C), np.nan)
        K.k_attn_decode_fwd(out, kc, vc, qkv[:, t:t + 1], t, NH)
        np.testing.assert_allclose(out[:, 0], out_full[:, t], rtol=1e-12, atol=1e-14)
        assert np.isnan(kc[:, t + 1:]).all() and np.isnan(vc[:, t + 1:]).all()
    np.testing.assert_array_equal(kc[:, :T], qkv[:, :, C:2 * C])
    np.testing.assert_array_equal(vc[:, :T], qkv[:, :, 2 * C:])
