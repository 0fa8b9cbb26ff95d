"""ref/decode.py: the KV-cache attention of one position against the causal attention."""
import numpy as np

from andrea.backends import ref as K

from shared_attention_case import shared_case


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


def test_shared_context_attention_is_the_whole_sequences_rows():
    """k_attn_shared_fwd (each option's rows over its group's prefix where it lies, then its own
    rows) gives k_attn_fwd's rows of each whole sequence (prefix + option) at odd sizes; a row whose
    keys exceed max_keys or whose prefix runs out of saved is refused."""
    import pytest
    rng = np.random.default_rng(8)
    NH, hs = 3, 5
    C = NH * hs
    seqs, saved, qkv, pre, plen, first, where = shared_case(rng, NH, hs)
    out = np.full((qkv.shape[0], 1, C), np.nan)
    K.k_attn_shared_fwd(out, qkv, saved, pre, plen, first, NH, 13)
    for r, (b, t) in enumerate(where):
        seq = seqs[b][None]
        full, lse = np.zeros((1, seq.shape[1], C)), np.zeros((1, NH, seq.shape[1]))
        K.k_attn_fwd(full, lse, seq, NH)
        np.testing.assert_allclose(out[r, 0], full[0, t], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="max_keys 12"):
        K.k_attn_shared_fwd(out, qkv, saved, pre, plen, first, NH, 12)
    with pytest.raises(ValueError, match="outside saved"):
        K.k_attn_shared_fwd(out, qkv, saved[:int(pre[-1])], pre, plen, first, NH, 13)


# ---------------------------------------------------------------- the batched decoder's kernels
def test_batch_kernels_are_the_one_position_kernels_row_by_row():
    """k_decode_embed_fwd is k_embed_fwd's row at each slot's own position; k_attn_decode_batch_fwd
    is k_attn_decode_fwd of each slot at its length (and writes that row only); k_decode_logits_fwd
    is the tied product; k_decode_cache_fill copies the k and v thirds of every layer, n rows."""
    rng = np.random.default_rng(5)
    N, NH, hs, ctx, V, L = 3, 3, 5, 11, 13, 2
    C = NH * hs
    wte, wpe = rng.normal(size=(V, C)), rng.normal(size=(ctx, C))
    tokens, lengths = np.array([4, 0, 12], np.int32), np.array([0, 10, 6], np.int32)
    out = np.full((N, 1, C), np.nan)
    K.k_decode_embed_fwd(out, tokens, lengths, wte, wpe)
    for n in range(N):
        want = np.zeros((1, lengths[n] + 1, C))
        K.k_embed_fwd(want, np.full((1, lengths[n] + 1), tokens[n], np.int32), wte, wpe)
        np.testing.assert_array_equal(out[n, 0], want[0, -1])
    kc, vc = rng.normal(size=(N, ctx, C)), rng.normal(size=(N, ctx, C))
    qkv = rng.normal(size=(N, 1, 3 * C))
    k2, v2 = kc.copy(), vc.copy()
    att = np.full((N, 1, C), np.nan)
    K.k_attn_decode_batch_fwd(att, kc, vc, qkv, lengths, NH)
    for n in range(N):
        one = np.full((1, 1, C), np.nan)
        K.k_attn_decode_fwd(one, k2[n:n + 1], v2[n:n + 1], qkv[n:n + 1], int(lengths[n]), NH)
        np.testing.assert_array_equal(att[n], one[0])
    np.testing.assert_array_equal(kc, k2)
    np.testing.assert_array_equal(vc, v2)
    logits = np.full((N, V), np.nan)
    K.k_decode_logits_fwd(logits, att, wte)
    np.testing.assert_allclose(logits, att[:, 0] @ wte.T, rtol=1e-13)
    T, n, slot = 7, 5, 1
    kcache, vcache = np.full((L, N, ctx, C), np.nan), np.full((L, N, ctx, C), np.nan)
    pq = rng.normal(size=(L, 1, T, 3 * C))
    K.k_decode_cache_fill(kcache, vcache, pq, slot, n)
    np.testing.assert_array_equal(kcache[:, slot, :n], pq[:, 0, :n, C:2 * C])
    np.testing.assert_array_equal(vcache[:, slot, :n], pq[:, 0, :n, 2 * C:])
    assert np.isnan(np.delete(kcache, slot, axis=1)).all() and np.isnan(kcache[:, slot, n:]).all()


# ---------------------------------------------------------------- sampling
def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def test_sample_row_greedy_and_degenerate_filters_give_the_argmax():
    rng = np.random.default_rng(6)
    z = rng.normal(size=50).astype(np.float32)
    z[17] = z.max() + 0.5
    for pos in range(20):
        assert K.sample_row(z, 0.0, 0, 1.0, pos, pos) == 17
        assert K.sample_row(z, 3.0, 1, 1.0, pos, pos) == 17  # top_k 1
        assert K.sample_row(z, 3.0, 0, 1e-9, pos, pos) == 17  # a nucleus of one token
    ties = np.zeros(9, np.float32)
    assert K.sample_row(ties, 0.0, 0, 1.0, 0, 0) == 0  # greedy: the first of equal values


def test_sample_row_draws_from_the_softmax_of_the_kept_tokens():
    """Over 4000 positions (a new draw each, one seed) the frequencies of each token are the
    softmax of logits / temperature restricted to the kept set, within 4.5 standard deviations
    of a binomial count; top_k keeps exactly the k largest, top_p exactly the nucleus."""
    z = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -3.0], np.float32)
    n = 4000
    cases = [(1.0, 0, 1.0, np.ones(7, bool)), (0.7, 0, 1.0, np.ones(7, bool)),
             (1.0, 3, 1.0, np.isin(np.arange(7), [0, 1, 5])),
             (1.0, 0, 0.6, np.isin(np.arange(7), [0, 5]))]  # p(0) ~ .40, p(5) ~ .24: .64 >= .6
    for temp, k, p, kept in cases:
        counts = np.bincount([K.sample_row(z, temp, k, p, 11, pos) for pos in range(n)], minlength=7)
        want = np.where(kept, softmax(np.where(kept, z / temp, -np.inf)), 0.0)
        sd = np.sqrt(n * want * (1 - want)) + 1e-9
        assert (counts[~kept] == 0).all(), (temp, k, p, counts)
        assert (np.abs(counts - n * want) <= 4.5 * sd + 1).all(), (temp, k, p, counts, n * want)


def test_sample_row_depends_on_seed_and_position_alone():
    rng = np.random.default_rng(7)
    z = rng.normal(size=300).astype(np.float32)
    a = [K.sample_row(z, 1.0, 0, 1.0, 5, pos) for pos in range(40)]
    assert a == [K.sample_row(z, 1.0, 0, 1.0, 5, pos) for pos in range(40)]
    assert a != [K.sample_row(z, 1.0, 0, 1.0, 6, pos) for pos in range(40)]
    assert len(set(a)) > 20  # positions draw anew
    u = K.sample_uniforms((1 << 64) - 1, 3, 1000)
    assert (u > 0).all() and (u < 1).all() and np.array_equal(u, u.astype(np.float32))


def test_k_sample_fwd_advances_each_slot_and_stops_at_the_last_row():
    """Live slots draw sample_row's token at lengths + 1 and advance (the last row is ctx - 1); a
    free slot goes to token 0 at row 0."""
    rng = np.random.default_rng(8)
    N, V, ctx = 4, 20, 9
    logits = rng.normal(size=(N, V)).astype(np.float32)
    tokens, lengths = np.full(N, 7, np.int32), np.array([0, 7, 8, 5], np.int32)
    temp, top_k, top_p = np.array([0, 1.3, 0.9, 1], np.float32), np.array([0, 4, 0, 0], np.int32), \
        np.array([1, 1, 0.8, 1], np.float32)
    seeds, live = np.array([1, 2, 3, 4], np.uint64), np.array([1, 1, 1, 0], np.int32)
    K.k_sample_fwd(tokens, lengths, logits, temp, top_k, top_p, seeds, live, ctx)
    want = [K.sample_row(logits[n], temp[n], top_k[n], top_p[n], int(seeds[n]), pos)
            for n, pos in enumerate((1, 8, 9))]
    assert tokens.tolist() == want + [0] and tokens[0] == logits[0].argmax()
    assert lengths.tolist() == [1, 8, 8, 0]  # the last row is ctx - 1; the free slot at row 0


def test_decode_linear_is_the_linear_layer_and_the_mlp_first_half():
    """k_decode_linear_fwd without GELU is the linear layers' product with its bias; with GELU it is
    k_mlp_fwd's act (checked through the whole MLP: the second product of that act)."""
    rng = np.random.default_rng(9)
    N, IC, OC = 3, 10, 7
    x, w, b = rng.normal(size=(N, 1, IC)), rng.normal(size=(OC, IC)), rng.normal(size=OC)
    out, want = np.full((N, 1, OC), np.nan), np.zeros((N, 1, OC))
    K.k_decode_linear_fwd(out, x, w, b, False)
    K.k_attn_qkv_fwd(want, x, w, b)
    np.testing.assert_array_equal(out, want)
    w2, b2 = rng.normal(size=(IC, OC)), rng.normal(size=IC)
    act, y = np.full((N, 1, OC), np.nan), np.full((N, 1, IC), np.nan)
    K.k_decode_linear_fwd(act, x, w, b, True)
    K.k_decode_linear_fwd(y, act, w2, b2, False)
    mlp, pre, act2 = np.zeros((N, 1, IC)), np.zeros((N, 1, OC)), np.zeros((N, 1, OC))
    K.k_mlp_fwd(mlp, pre, act2, x, w, b, w2, b2)
    np.testing.assert_allclose(y, mlp, rtol=1e-13, atol=1e-13)


def test_decode_ln_linear_is_the_residual_layernorm_then_the_product():
    rng = np.random.default_rng(10)
    N, C, OC = 3, 12, 5
    a, b = rng.normal(size=(N, 1, C)), rng.normal(size=(N, 1, C))
    lw, lb, w, bias = rng.normal(size=C), rng.normal(size=C), rng.normal(size=(OC, C)), rng.normal(size=OC)
    for gelu in (False, True):
        for with_b in (True, False):
            res, out = np.full((N, 1, C), np.nan), np.full((N, 1, OC), np.nan)
            K.k_decode_ln_linear_fwd(out, res if with_b else None, a, b if with_b else None, lw, lb, w, bias, gelu)
            r2, ln, want = np.zeros((N, 1, C)), np.zeros((N, 1, C)), np.zeros((N, 1, OC))
            if with_b:
                K.k_residual_layernorm_fwd(r2, ln, np.zeros((N, 1)), np.zeros((N, 1)), a, b, lw, lb)
                np.testing.assert_array_equal(res, r2)
            else:
                K.k_layernorm_fwd(ln, np.zeros((N, 1)), np.zeros((N, 1)), a, lw, lb)
            K.k_decode_linear_fwd(want, ln, w, bias, gelu)
            np.testing.assert_array_equal(out, want)
