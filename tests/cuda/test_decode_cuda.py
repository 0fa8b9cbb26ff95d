"""KV-cache decoding on the GPU: k_attn_decode_fwd against the NumPy reference, and the CUDA
Decoder's logits against the full forward pass at every position; the batched decoder's kernels
and sampler against the reference, its graph against its eager step, its greedy tokens against
NumPy's (fp32) and the forward's argmax (fp16, within ties) (skipped without a GPU).

    python -m pytest -m gpu tests/cuda/test_decode_cuda.py -q

Same method as the kernel tests of tests/cuda/: odd sizes (head sizes 40 and 25, a 77-row cache),
inputs rounded to the compute dtype before the float64 reference sees them, outputs NaN-filled
before the launch. Tolerances: fp32 1e-5, fp16 1e-2 (relative to the largest reference value).
"""
import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


def err(got, want):
    got = np.asarray(got, dtype=np.float64)
    assert np.isfinite(got).all(), "NaN or Inf in the output"
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


# (3, 40), (5, 25): the head's row is no power-of-two count of 16-byte chunks (a warp a key);
# the others take the 16-byte path, 2 to 32 chunks a row
@pytest.mark.parametrize("NH,hs", [(3, 40), (5, 25), (2, 64), (3, 32), (1, 128), (4, 16)])
def test_k_attn_decode_fwd(be, prec, rng, NH, hs):
    import cupy as cp
    dt, tol = prec
    B, ctx, C = 2, 77, NH * hs
    for pos in (0, 1, 38, ctx - 1):
        kc = rng.standard_normal((B, ctx, C)).astype(dt).astype(np.float64)
        vc = rng.standard_normal((B, ctx, C)).astype(dt).astype(np.float64)
        kc[:, pos:], vc[:, pos:] = np.nan, np.nan  # rows the kernel must write (pos) or never read
        qkv = rng.standard_normal((B, 1, 3 * C)).astype(dt).astype(np.float64)
        want, kw, vw = np.zeros((B, 1, C)), kc.copy(), vc.copy()
        ref.k_attn_decode_fwd(want, kw, vw, qkv, pos, NH)
        out = cp.full((B, 1, C), np.nan, dtype=dt)
        dk, dv = cp.asarray(kc.astype(dt)), cp.asarray(vc.astype(dt))
        be.k_attn_decode_fwd(out, dk, dv, cp.asarray(qkv.astype(dt)), pos, NH)
        assert err(cp.asnumpy(out), want) < tol, f"pos {pos}"
        np.testing.assert_array_equal(cp.asnumpy(dk)[:, pos], qkv[:, 0, C:2 * C].astype(dt))
        np.testing.assert_array_equal(cp.asnumpy(dv)[:, pos], qkv[:, 0, 2 * C:].astype(dt))
        assert np.isnan(cp.asnumpy(dk)[:, pos + 1:]).all()  # nothing past pos is written


@pytest.mark.parametrize("NH,hs", [(3, 40), (5, 25), (2, 64), (1, 128), (4, 16)])
def test_k_attn_shared_fwd(be, prec, rng, NH, hs):
    """The shared-context attention against the NumPy reference: groups of 1 to 300 prefix rows
    (many keys a thread), options of 1 to 4 rows, both the 16-byte and the warp-a-key paths."""
    import cupy as cp
    from shared_attention_case import shared_case
    dt, tol = prec
    C = NH * hs
    _, saved, qkv, pre, plen, first, _ = shared_case(rng, NH, hs, ((300, (3, 1, 4)), (5, (2, 2)), (1, (1,))))
    saved, qkv = saved.astype(dt).astype(np.float64), qkv.astype(dt).astype(np.float64)
    want = np.zeros((qkv.shape[0], 1, C))
    ref.k_attn_shared_fwd(want, qkv, saved, pre, plen, first, NH, 305)
    out = cp.full(want.shape, np.nan, dtype=dt)
    be.k_attn_shared_fwd(out, cp.asarray(qkv.astype(dt)), cp.asarray(saved.astype(dt)), cp.asarray(pre),
                         cp.asarray(plen), cp.asarray(first), NH, 305)
    assert err(cp.asnumpy(out), want) < tol


def test_k_attn_shared_fwd_more_rows_than_a_grid_column(be, rng):
    """66,000 one-row options after one 5-row context: more rows than a grid's 65,535 y-blocks; the
    last rows (the reference on them alone) as the first."""
    import cupy as cp
    NH, hs, R, p = 2, 16, 66000, 5
    C = NH * hs
    saved = rng.standard_normal((p, 3 * C)).astype(np.float32)
    qkv = rng.standard_normal((R, 1, 3 * C)).astype(np.float32)
    pre, plen, first = np.zeros(R, np.int32), np.full(R, p, np.int32), np.arange(R, dtype=np.int32)
    out = cp.full((R, 1, C), np.nan, dtype=np.float32)
    be.k_attn_shared_fwd(out, cp.asarray(qkv), cp.asarray(saved), cp.asarray(pre), cp.asarray(plen),
                         cp.asarray(first), NH, p + 1)
    got = cp.asnumpy(out)
    for rows in (slice(0, 40), slice(R - 40, R)):
        want = np.zeros((40, 1, C))
        ref.k_attn_shared_fwd(want, qkv[rows].astype(np.float64), saved.astype(np.float64), pre[rows], plen[rows],
                              first[rows] - first[rows][0], NH, p + 1)
        assert err(got[rows], want) < 1e-5


def test_cuda_decoder_matches_full_forward(be, prec, rng):
    from andrea.config import load_run_config
    from andrea.core.engine import Engine
    from andrea.use.inference import Decoder

    dt, tol = prec
    T, V = 29, 101
    cfg = load_run_config({"model": {"n_layer": 2, "d_model": 120, "n_head": 3, "context": T, "vocab_size": V},
                           "train": {"batch_size": 1, "seq_len": T, "init_std": 0.1}, "backend": {"name": "numpy"}})
    eng = Engine(cfg, dtype="float64")
    host = eng.be.to_numpy(eng.params).copy()
    host[eng.layout.n_decay:] += rng.normal(0, 0.3, host.size - eng.layout.n_decay)
    host = host.astype(dt).astype(np.float64)  # the GPU's weights, exactly
    eng.set_state(host)
    tokens = rng.integers(0, V, T + 6).astype(np.int32)
    dec = Decoder(cfg.model, be, dtype=np.dtype(dt).name)
    dec.load(host.astype(np.float32))
    for t, tok in enumerate(tokens):
        got = dec.step(tok)
        window = tokens[max(0, t + 1 - T):t + 1]  # past T the window slides; padding after it is causal-masked
        x = np.zeros((1, T), dtype=np.int32)
        x[0, :len(window)] = window
        eng.forward(x, x)
        z = eng.g["logits"]  # the classifier's workspace: all B*T rows when they fit one chunk
        assert z.shape == (T, V), "the logits workspace holds a chunk, not every position"
        want = z[len(window) - 1]
        assert err(got, want) < tol, f"position {t}"


# ---------------------------------------------------------------- the batched decoder (andrea/use/batch.py)
def test_batch_kernels(be, prec, rng):
    """k_decode_embed_fwd, k_attn_decode_batch_fwd (each slot at its own length), k_decode_cache_fill
    and k_decode_logits_fwd against the reference; the cache rows written are exact copies."""
    import cupy as cp
    dt, tol = prec
    N, NH, hs, ctx, V, L = 3, 3, 40, 77, 1001, 2
    C = NH * hs
    wte, wpe = rnd64(rng, (V, C), dt), rnd64(rng, (ctx, C), dt)
    tokens, lengths = np.array([4, 0, 1000], np.int32), np.array([0, 76, 38], np.int32)
    want = np.zeros((N, 1, C))
    ref.k_decode_embed_fwd(want, tokens, lengths, wte, wpe)
    out = cp.full((N, 1, C), np.nan, dtype=dt)
    be.k_decode_embed_fwd(out, cp.asarray(tokens), cp.asarray(lengths), cp.asarray(wte.astype(dt)),
                          cp.asarray(wpe.astype(dt)))
    assert err(cp.asnumpy(out), want) < tol
    kc, vc, qkv = rnd64(rng, (N, ctx, C), dt), rnd64(rng, (N, ctx, C), dt), rnd64(rng, (N, 1, 3 * C), dt)
    kw, vw, att = kc.copy(), vc.copy(), np.zeros((N, 1, C))
    ref.k_attn_decode_batch_fwd(att, kw, vw, qkv, lengths, NH)
    dk, dv, out = cp.asarray(kc.astype(dt)), cp.asarray(vc.astype(dt)), cp.full((N, 1, C), np.nan, dtype=dt)
    be.k_attn_decode_batch_fwd(out, dk, dv, cp.asarray(qkv.astype(dt)), cp.asarray(lengths), NH)
    assert err(cp.asnumpy(out), att) < tol
    np.testing.assert_array_equal(cp.asnumpy(dk).astype(np.float64), kw)
    np.testing.assert_array_equal(cp.asnumpy(dv).astype(np.float64), vw)
    logits = cp.full((N, V), np.nan, dtype=np.float32)
    want = np.zeros((N, V))
    ref.k_decode_logits_fwd(want, att.astype(dt).astype(np.float64), wte)
    be.k_decode_logits_fwd(logits, cp.asarray(att.astype(dt)), cp.asarray(wte.astype(dt)))
    assert err(cp.asnumpy(logits), want) < 1e-5  # fp16 products accumulate and land in float32
    T, n, slot = 70, 33, 1
    pq = rnd64(rng, (L, 1, T, 3 * C), dt)
    kcache, vcache = np.full((L, N, ctx, C), np.nan), np.full((L, N, ctx, C), np.nan)
    ref.k_decode_cache_fill(kcache, vcache, pq, slot, n)
    dk, dv = cp.full((L, N, ctx, C), np.nan, dtype=dt), cp.full((L, N, ctx, C), np.nan, dtype=dt)
    be.k_decode_cache_fill(dk, dv, cp.asarray(pq.astype(dt)), slot, n)
    np.testing.assert_array_equal(cp.asnumpy(dk).astype(np.float64), kcache)
    np.testing.assert_array_equal(cp.asnumpy(dv).astype(np.float64), vcache)


@pytest.mark.parametrize("N,IC,OC", [(1, 768, 2304), (3, 3072, 768), (8, 200, 77), (5, 75, 31)])
def test_decode_linear_and_logits_gemv(be, prec, rng, N, IC, OC):
    """k_decode_linear_fwd (with and without GELU) and k_decode_logits_fwd's few-row kernel against
    the reference, 16-byte loads and (IC = 75) single elements; a row's result does not depend on
    the other rows (row 0 alone gives the same bits)."""
    import cupy as cp
    dt, tol = prec
    x, w, b = rnd64(rng, (N, 1, IC), dt), rnd64(rng, (OC, IC), dt, 1 / np.sqrt(IC)), rnd64(rng, (OC,), dt)
    dx, dw, db = (cp.asarray(a.astype(dt)) for a in (x, w, b))
    for gelu in (False, True):
        want = np.zeros((N, 1, OC))
        ref.k_decode_linear_fwd(want, x, w, b, gelu)
        out = cp.full((N, 1, OC), np.nan, dtype=dt)
        be.k_decode_linear_fwd(out, dx, dw, db, gelu)
        assert err(cp.asnumpy(out), want) < tol, gelu
        one = cp.full((1, 1, OC), np.nan, dtype=dt)
        be.k_decode_linear_fwd(one, dx[:1], dw, db, gelu)
        np.testing.assert_array_equal(cp.asnumpy(one)[0], cp.asnumpy(out)[0])
    want = np.zeros((N, OC))
    ref.k_decode_logits_fwd(want, x, w)
    logits = cp.full((N, OC), np.nan, dtype=np.float32)
    be.k_decode_logits_fwd(logits, dx, dw)
    assert err(cp.asnumpy(logits), want) < 1e-5  # products of dt values summed in float32


@pytest.mark.parametrize("N,C,OC", [(1, 768, 2304), (8, 384, 1536), (3, 200, 77), (2, 75, 31)])
def test_decode_ln_linear(be, prec, rng, N, C, OC):
    """k_decode_ln_linear_fwd against the reference, with and without the residual add and GELU;
    res written exactly (the rounded sum)."""
    import cupy as cp
    dt, tol = prec
    a, b = rnd64(rng, (N, 1, C), dt), rnd64(rng, (N, 1, C), dt)
    lw, lb = rnd64(rng, (C,), dt), rnd64(rng, (C,), dt)
    w, bias = rnd64(rng, (OC, C), dt, 1 / np.sqrt(C)), rnd64(rng, (OC,), dt)
    d = {k: cp.asarray(v.astype(dt)) for k, v in dict(a=a, b=b, lw=lw, lb=lb, w=w, bias=bias).items()}
    for gelu in (False, True):
        for with_b in (True, False):
            res_w, want = np.zeros((N, 1, C)), np.zeros((N, 1, OC))
            ref.k_decode_ln_linear_fwd(want, res_w if with_b else None, a, b if with_b else None, lw, lb, w, bias,
                                       gelu)
            res, out = cp.full((N, 1, C), np.nan, dtype=dt), cp.full((N, 1, OC), np.nan, dtype=dt)
            be.k_decode_ln_linear_fwd(out, res if with_b else None, d["a"], d["b"] if with_b else None, d["lw"],
                                      d["lb"], d["w"], d["bias"], gelu)
            assert err(cp.asnumpy(out), want) < tol, (gelu, with_b)
            if with_b:
                np.testing.assert_array_equal(cp.asnumpy(res), (a + b).astype(dt))


def rnd64(rng, shape, dt, scale=1.0):
    """float64 values already rounded to dt (after the scale), so the reference sees the GPU's inputs."""
    return (rng.standard_normal(shape) * scale).astype(dt).astype(np.float64)


def test_k_sample_fwd(be, rng):
    """The device sampler draws the reference's tokens (ref.sample_row: the same keys and
    thresholds; the Gumbel noise in float against float64, so a near tie could differ: none may)
    for greedy, temperature, top_k, top_p and both, at 50304 classes, and advances the lengths."""
    import cupy as cp
    N, V, ctx = 12, 50304, 1024
    logits = (rng.standard_normal((N, V)) * 3).astype(np.float32)
    logits[3, 77] = logits[3].max()  # a tie for greedy: the first index wins
    logits[0, 101] = logits[0, 102] = logits[0].max() + 1  # a tie within one 16-byte load (100..103)
    temp = np.array([0, 0, 0.7, 0, 1.0, 1.0, 1.5, 0.3, 1.0, 2.0, 1.0, 0.9], np.float32)
    top_k = np.array([0, 5, 0, 0, 40, 0, 7, 0, 1, 200, 0, 50], np.int32)
    top_p = np.array([1, 1, 1, 1, 1, 0.9, 0.5, 0.95, 1, 0.3, 1e-6, 0.99], np.float32)
    seeds = np.arange(N, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    lengths = np.array([0, 5, 17, 1022, 1023, 100, 3, 9, 400, 2, 50, 77], np.int32)
    live = np.array([1] * 11 + [0], np.int32)  # the last slot is free
    want_t, want_l = np.zeros(N, np.int32), lengths.copy()
    ref.k_sample_fwd(want_t, want_l, logits, temp, top_k, top_p, seeds, live, ctx)
    t = cp.full(N, -1, dtype=np.int32)
    lens = cp.asarray(lengths)
    be.k_sample_fwd(t, lens, cp.asarray(logits), cp.asarray(temp), cp.asarray(top_k), cp.asarray(top_p),
                    cp.asarray(seeds), cp.asarray(live), ctx)
    got = cp.asnumpy(t)
    print("sampled", got.tolist(), "reference", want_t.tolist())
    np.testing.assert_array_equal(got, want_t)
    np.testing.assert_array_equal(cp.asnumpy(lens), want_l)


def tiny_batch_model(rng, d_model=128, n_head=2, ctx=200, V=1001):
    from andrea.config import load_run_config
    from andrea.core.engine import Engine

    cfg = load_run_config({"model": {"n_layer": 2, "d_model": d_model, "n_head": n_head, "context": ctx,
                                     "vocab_size": V},
                           "train": {"batch_size": 1, "seq_len": ctx, "init_std": 0.1},
                           "backend": {"name": "numpy"}})
    eng = Engine(cfg, dtype="float64")
    host = eng.be.to_numpy(eng.params).copy()
    host[eng.layout.n_decay:] += rng.normal(0, 0.3, host.size - eng.layout.n_decay)
    return cfg, eng, host


def batch_tokens(bd, reqs):
    out = {}
    slots = {bd.admit(r): i for i, r in enumerate(reqs)}
    while slots:
        for s, t, done in bd.step():
            out.setdefault(slots[s], []).append(t)
            if done:
                del slots[s]
    return [out[i] for i in range(len(reqs))]


@pytest.mark.parametrize("slots,gemv", [(4, True), (12, None)])
def test_graph_step_equals_eager_step(rng, slots, gemv):
    """The replayed graph and the same kernels run eagerly give the same tokens and logits, bit
    for bit (fp16, sampled and greedy requests with odd prompts; the few-row products asked for at 4
    slots, cuBLAS at 12)."""
    from andrea.backends import get_backend
    from andrea.backends.numpy_backend import EagerGraph
    from andrea.use.batch import BatchDecoder, Request

    cfg, _, host = tiny_batch_model(rng)
    reqs = [Request([int(i) for i in rng.integers(0, 1001, n)], 30, temperature=t, top_p=0.9, seed=n)
            for n, t in ((1, 0.0), (37, 0.8), (130, 1.2))]
    runs = []
    for eager in (False, True):
        bd = BatchDecoder(cfg.model, get_backend("cuda"), slots, dtype="float16", gemv=gemv)
        bd.load(host.astype(np.float32))
        if eager:
            bd.graph = EagerGraph(bd._step_kernels)
        runs.append((batch_tokens(bd, reqs), bd.be.to_numpy(bd.b["logits"])))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("gemv", [True, False])
def test_greedy_fp32_equals_numpy_and_fp16_the_forward_argmax_within_ties(rng, gemv):
    """fp32 on the GPU: the greedy tokens of the NumPy float64 BatchDecoder. fp16: each token is
    the float64 full forward's argmax at its position (teacher-forced on the fp16 tokens) or
    within 2e-2 of it (relative to the largest |logit|: fp16's rounding through two layers); the
    count of differing positions is printed."""
    from andrea.backends import get_backend
    from andrea.backends.numpy_backend import NumpyBackend
    from andrea.use.batch import BatchDecoder, Request

    cfg, eng, host = tiny_batch_model(rng)
    reqs = [Request([int(i) for i in rng.integers(0, 1001, n)], 60) for n in (1, 37, 130, 199)]
    want = batch_tokens(_loaded(BatchDecoder(cfg.model, NumpyBackend(), 4, dtype="float64", gemv=gemv), host), reqs)
    got = batch_tokens(_loaded(BatchDecoder(cfg.model, get_backend("cuda"), 4, dtype="float32", gemv=gemv), host), reqs)
    assert got == want
    h16 = host.astype(np.float16).astype(np.float64)
    eng.set_state(h16)
    f16 = batch_tokens(_loaded(BatchDecoder(cfg.model, get_backend("cuda"), 4, dtype="float16", gemv=gemv), h16), reqs)
    differ = total = 0
    for r, toks in zip(reqs, f16):
        seq = np.array(r.prompt_ids + toks[:-1], np.int32)
        x = np.zeros((1, 200), np.int32)
        x[0, :len(seq)] = seq
        eng.forward(x, x)
        z = eng.g["logits"][len(r.prompt_ids) - 1:len(seq)]
        for row, t in zip(z, toks):
            total += 1
            if t != int(row.argmax()):
                differ += 1
                assert row.max() - row[t] < 2e-2 * np.abs(row).max(), (row.max(), row[t])
    print(f"fp16 greedy: {differ} of {total} tokens differ from the float64 forward's argmax (all within ties)")
    assert differ <= total // 10


def _loaded(bd, host):
    bd.load(np.asarray(host, dtype=np.float32) if bd.dtype != "float64" else host)
    return bd


def test_prefill_graph_equals_eager_prefill(rng):
    """The prefill of a padded length runs eagerly the first time, is captured the second and
    replayed after: the three give the same first-token logits and cache rows, bit for bit."""
    from andrea.backends import get_backend
    from andrea.use.batch import BatchDecoder, Request

    cfg, _, host = tiny_batch_model(rng)
    bd = BatchDecoder(cfg.model, get_backend("cuda"), 2, dtype="float16")
    bd.load(host.astype(np.float32))
    ids = [int(i) for i in rng.integers(0, 1001, 45)]
    seen = []
    for _ in range(3):
        slot = bd.admit(Request(ids, 1, temperature=0.7, seed=3))
        seen.append((bd.be.to_numpy(bd.b["logits"][slot]), bd.be.to_numpy(bd.b["kcache"][:, slot, :45]),
                     bd.step()))
    for logits, cache, step in seen[1:]:
        np.testing.assert_array_equal(logits, seen[0][0])
        np.testing.assert_array_equal(cache, seen[0][1])
        assert step == seen[0][2]
