"""ref/attention.py: the causal attention pair (finite differences, causality, accumulate=False)
and its FP8 forms k_attn_fwd_fp8 / k_attn_bwd_fp8 (odd sizes, rows past a whole tile)."""
import numpy as np
import pytest

from andrea.backends import ref as K
from refkit import FMTS, B, C, NH, T, check_written, rnd, run_pair


def test_attention(rng=np.random.default_rng(4)):
    inp = {"qkv": rnd(rng, B, T, 3 * C)}
    lse = np.zeros((B, NH, T))
    out_saved = np.zeros((B, T, C))

    def fwd(out, qkv):
        K.k_attn_fwd(out, lse, qkv, NH)
        out_saved[...] = out

    fwd.__name__ = "k_attn_fwd"
    run_pair(rng, fwd,
             lambda g, R: K.k_attn_bwd(g["qkv"], R, inp["qkv"], out_saved, lse, NH),
             inp, (B, T, C), ["qkv"])


def test_attention_is_causal(rng=np.random.default_rng(5)):
    """Changing a later token's q, k or v must not change any earlier output."""
    qkv = rnd(rng, B, T, 3 * C)
    out1, out2, lse = np.zeros((B, T, C)), np.zeros((B, T, C)), np.zeros((B, NH, T))
    K.k_attn_fwd(out1, lse, qkv, NH)
    qkv[:, 4:] += 1.0
    K.k_attn_fwd(out2, lse, qkv, NH)
    assert np.array_equal(out1[:, :4], out2[:, :4])
    assert not np.allclose(out1[:, 4:], out2[:, 4:])


def test_accumulate_false_writes_dqkv():
    """k_attn_bwd(accumulate=False) writes dqkv (refkit.check_written)."""
    rng = np.random.default_rng(14)
    out, lse = np.zeros((B, T, C)), np.zeros((B, NH, T))
    qkv = rnd(rng, B, T, 3 * C)
    K.k_attn_fwd(out, lse, qkv, NH)
    check_written(K.k_attn_bwd, [np.zeros((B, T, 3 * C)), rnd(rng, B, T, C), qkv, out, lse, NH], 0)


@pytest.mark.parametrize("fmt", FMTS)
def test_attention_fp8_references(fmt):
    """ref.k_attn_fwd_fp8 and k_attn_bwd_fp8 (odd sizes, rows past a whole tile): out and
    lse as k_attn_fwd writes them; the bytes the rounding of out (E4M3), or of dqkv as k_attn_bwd
    writes it (fmt), times the scale of meta[0], q_t their transpose, meta[1] the inverse scale,
    amax_out the largest |value|; the backward's partials the column sums of dqkv over each tile
    of 64 rows (float32 order: close to the float64 sums), none with partial None."""
    rng = np.random.default_rng(5)
    B, T, NH, hs = 2, 75, 3, 5
    C, N = NH * hs, B * T
    qkv = rng.normal(0, 1, (B, T, 3 * C)).astype(np.float32)
    out, lse = np.zeros((B, T, C), np.float32), np.zeros((B, NH, T), np.float32)
    K.k_attn_fwd(out, lse, qkv, NH)
    dout = rng.normal(0, 1, (B, T, C)).astype(np.float32)
    dqkv = np.zeros_like(qkv)
    K.k_attn_bwd(dqkv, dout, qkv, out, lse, NH, accumulate=False)
    for name, x, f in (("fwd", out.reshape(N, C), "e4m3"), ("bwd", dqkv.reshape(N, 3 * C), fmt)):
        top = np.float32(np.abs(x).max())
        R, W = x.shape
        q, q_t = np.zeros((R, W), np.uint8), np.zeros((W, R), np.uint8)
        meta, amax = np.array([top, 0], np.float32), np.zeros(1, np.float32)
        partial = np.full((-(-R // 64), W), np.nan, np.float32)
        if name == "fwd":
            o2, l2 = np.zeros_like(out), np.zeros_like(lse)
            K.k_attn_fwd_fp8(o2, l2, q, q_t, meta, amax, qkv, NH)
            np.testing.assert_array_equal(o2, out)
            np.testing.assert_array_equal(l2, lse)
        else:
            K.k_attn_bwd_fp8(q, q_t, partial, meta, amax, dout, qkv, out, lse, NH, f)
            sums = np.add.reduceat(x.astype(np.float64), np.arange(0, R, 64), axis=0)
            np.testing.assert_allclose(partial, sums, rtol=1e-5, atol=1e-5 * np.abs(x).max())
            q2, amax2 = np.zeros_like(q), np.zeros(1, np.float32)
            K.k_attn_bwd_fp8(q2, None, None, meta.copy(), amax2, dout, qkv, out, lse, NH, f)
            np.testing.assert_array_equal(q2, q)
        scale, inv = K.fp8_scale(top, f)
        assert meta[1] == inv and amax[0] == top, name
        np.testing.assert_array_equal(q_t, q.T)
        np.testing.assert_allclose(K.fp8_decode(q, f), K.fp8_round(x * scale, f), rtol=0, atol=1e-6)
