"""CUDA: the embedding pair against the NumPy reference, on the GPU (skipped without one); moved from tests/test_cuda_kernels.py.

    python -m pytest -m gpu tests/cuda/test_embed_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref
from cudakit import B, C, Grad, T, V, assert_close, dev, host, nan_buf, rnd, use_tuning, zeros_like64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


# ---------------------------------------------------------------- embedding
def test_embed(be, prec, rng):
    dt, tol = prec
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[0, :20] = 7  # a long run of one token, and one shared across the batch
    tokens[1, 5] = 7
    wte, wpe = rnd(rng, (V, C), dt), rnd(rng, (T + 5, C), dt)
    out = np.zeros((B, T, C))
    ref.k_embed_fwd(out, tokens, wte, wpe)
    got = nan_buf((B, T, C), dt)
    be.k_embed_fwd(got, dev(tokens, np.int32), dev(wte, dt), dev(wpe, dt))
    assert_close("k_embed_fwd out", host(got), out, tol)

    dout = rnd(rng, (B, T, C), dt)
    dwte, dwpe = zeros_like64(wte, wpe)
    ref.k_embed_bwd(dwte, dwpe, dout, tokens)
    gwte, gwpe = Grad(rng, dwte, np.float32), Grad(rng, dwpe, np.float32)
    be.k_embed_bwd(gwte.d, gwpe.d, dev(dout, dt), dev(tokens, np.int32))
    gwte.check("k_embed_bwd dwte", tol)
    gwpe.check("k_embed_bwd dwpe", tol)


def test_embed_bwd_deterministic_large(be):
    """B*T = 8192 (the shared-memory sort's largest) and 12288 (the global-memory sort), with
    heavy repeats: two launches give the same bits, and the sum matches the reference."""
    import cupy as cp
    rng = np.random.default_rng(5)
    for Bq, Tq in ((8, 1024), (12, 1024)):
        tokens = rng.integers(0, 50, (Bq, Tq)).astype(np.int32)
        dout = rng.standard_normal((Bq, Tq, 64)).astype(np.float32)
        outs = []
        for _ in range(2):
            dwte, dwpe = cp.zeros((50, 64), cp.float32), cp.zeros((Tq, 64), cp.float32)
            be.k_embed_bwd(dwte, dwpe, cp.asarray(dout), cp.asarray(tokens))
            outs.append(cp.asnumpy(dwte))
        assert np.array_equal(outs[0], outs[1]), "k_embed_bwd is not bit-reproducible"
        want = np.zeros((50, 64))
        np.add.at(want, tokens.reshape(-1), dout.reshape(-1, 64).astype(np.float64))
        assert_close(f"k_embed_bwd dwte B*T={Bq * Tq}", outs[0].astype(np.float64), want, 1e-5)


# B*T: a single key, sizes that are no power of two or end mid-block/mid-tile (77, 2049, 8191,
# 12289), the ANDREA-12M step (8192), and two beyond the one-block sort's shared memory (20000,
# 70001, with several 2048-key tiles); each size through both paths (embed_rank_max forced)
@pytest.mark.parametrize("N,V", [(1, 7), (77, 5), (2049, 50304), (8191, 3), (8192, 8192), (12289, 50), (20000, 1000),
                                 (70001, 30)])
def test_embed_sort_rank(be, rng, N, V, monkeypatch):
    """k_embed_bwd's keys sorted by rank (k_embed_sort_rank) and by the bitonic sort (k_embed_sort):
    both equal NumPy's sort of the packed keys (padding 0xffffffff), tokens heavily repeated, and
    dwte is the same bits either way."""
    import cupy as cp
    tokens = rng.integers(0, V, (1, N)).astype(np.int32)
    C2 = 16
    dout = rnd(rng, (1, N, C2), np.float32)
    shift = max(1, (N - 1).bit_length())
    want = np.full(1 << shift, 0xffffffff, np.uint32)
    want[:N] = np.sort((tokens.reshape(-1).astype(np.uint64) << shift | np.arange(N, dtype=np.uint64)).astype(np.uint32))
    got = {}
    for name, rank_max in (("rank", 1 << 30), ("bitonic", 0)):
        use_tuning(monkeypatch, be, embed_rank_max=rank_max)
        launched = []
        launch = be.rt.launch
        monkeypatch.setattr(be.rt, "launch", lambda f, k, *a, **kw: (launched.append(k), launch(f, k, *a, **kw))[1])
        dwte, dwpe = cp.zeros((V, C2), cp.float32), cp.zeros((N, C2), cp.float32)
        be.k_embed_bwd(dwte, dwpe, dev(dout, np.float32), dev(tokens, np.int32))
        monkeypatch.setattr(be.rt, "launch", launch)
        assert launched[0] == {"rank": "k_embed_sort_rank", "bitonic": "k_embed_sort"}[name]
        keys = cp.asnumpy(be.workspace.get("embed_keys", 1 << shift, np.uint32))
        assert np.array_equal(keys, want), f"{name}: keys not sorted as NumPy sorts them"
        got[name] = cp.asnumpy(dwte)
    assert np.array_equal(got["rank"].view(np.uint32), got["bitonic"].view(np.uint32))
    # the bits: each token's rows added in float32 from zero in position order (a sequential cumsum)
    flat, rows32 = tokens.reshape(-1), dout.reshape(N, C2).astype(np.float32)
    order = np.argsort(flat, kind="stable")
    starts = np.flatnonzero(np.r_[True, flat[order][1:] != flat[order][:-1]])
    want32 = np.zeros((V, C2), np.float32)
    for a, b in zip(starts, np.r_[starts[1:], N]):
        want32[flat[order[a]]] = np.cumsum(rows32[order[a:b]], axis=0, dtype=np.float32)[-1]
    assert np.array_equal(got["rank"].view(np.uint32), want32.view(np.uint32)), "dwte: not the position-order sums"
    want_dwte = np.zeros((V, C2))
    np.add.at(want_dwte, tokens.reshape(-1), dout.reshape(N, C2))
    assert_close(f"k_embed_bwd dwte N={N}", got["rank"].astype(np.float64), want_dwte, 1e-5)

