"""KV-cache decoding on the GPU: k_attn_decode_fwd against the NumPy reference, and the CUDA
Decoder's logits against the full forward pass at every position (skipped without a GPU).

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


@pytest.mark.parametrize("NH,hs", [(3, 40), (5, 25)])
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
