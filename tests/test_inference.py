"""KV-cache decoding (andrea/use/inference.py) against the full forward pass of the training engine.

float64: the cached logits equal the full forward's at every position to rounding (relative
1e-12). They are not bit-identical: a one-row product and a T-row product are summed in different
orders by BLAS, ~1e-15 apart. float32: 1e-5 (single-precision rounding through two layers).
"""
import numpy as np
import pytest

from andrea.backends.numpy_backend import NumpyBackend
from andrea.config import load_run_config
from andrea.core.engine import Engine
from andrea.use.inference import Decoder, decode_plan

V, CTX = 37, 13


def make(dtype, T=CTX, context=CTX, seed=0):
    cfg = load_run_config({"model": {"n_layer": 2, "d_model": 24, "n_head": 3, "context": context,
                                     "vocab_size": V},
                           "train": {"batch_size": 1, "seq_len": T, "init_std": 0.3},
                           "backend": {"name": "numpy"}})
    eng = Engine(cfg, dtype=dtype)
    rng = np.random.default_rng(seed)
    host = eng.be.to_numpy(eng.params).copy()
    host[eng.layout.n_decay:] += rng.normal(0, 0.3, host.size - eng.layout.n_decay)  # general LN gains
    eng.set_state(host)
    return cfg, eng, host, rng


def full_logits(eng, tokens):
    eng.forward(tokens[None], tokens[None])
    z = eng.g["logits"]  # the classifier's workspace: all B*T rows when they fit one chunk
    assert z.shape[0] == len(tokens), "the logits workspace holds a chunk, not every position"
    return z.astype(np.float64)


def rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 1e-5)])
def test_cached_logits_equal_full_forward_at_every_position(dtype, tol):
    cfg, eng, host, rng = make(dtype)
    tokens = rng.integers(0, V, CTX).astype(np.int32)
    full = full_logits(eng, tokens)
    dec = Decoder(cfg.model, NumpyBackend(), dtype=dtype)
    dec.load(host)
    stepped = np.stack([dec.step(t) for t in tokens])
    for t in range(CTX):
        assert rel(stepped[t], full[t]) < tol, f"position {t}: {rel(stepped[t], full[t]):.2e}"
    assert np.array_equal(stepped.argmax(-1), full.argmax(-1))
    # feeding a prompt at once ends in the same state: same last logits, same next step
    dec.reset()
    np.testing.assert_array_equal(dec.feed(tokens[:7]), stepped[6])
    np.testing.assert_array_equal(dec.step(tokens[7]), stepped[7])


def test_full_window_slides_like_a_forward_over_the_last_context_tokens():
    cfg, eng, host, rng = make("float64", T=CTX)
    tokens = rng.integers(0, V, 2 * CTX + 3).astype(np.int32)
    dec = Decoder(cfg.model, NumpyBackend(), dtype="float64")
    dec.load(host)
    for t, tok in enumerate(tokens):
        got = dec.step(tok)
        window = tokens[max(0, t + 1 - CTX):t + 1]
        if len(window) < CTX:
            continue
        assert rel(got, full_logits(eng, window)[-1]) < 1e-12, t
    assert dec.tokens == [int(i) for i in tokens[-CTX:]]


def test_cache_length_below_the_model_context():
    """A decoder for 9 positions of a 13-position model: the window is 9 (wpe rows 0..8 only)."""
    cfg, eng, host, rng = make("float64", T=9, context=CTX)
    dec = Decoder(cfg.model, NumpyBackend(), context=9, dtype="float64")
    dec.load(host)
    tokens = rng.integers(0, V, 12).astype(np.int32)
    got = [dec.step(t) for t in tokens][-1]
    assert rel(got, full_logits(eng, tokens[-9:])[-1]) < 1e-12
    with pytest.raises(ValueError, match="decoder context 14"):
        Decoder(cfg.model, NumpyBackend(), context=14)


def test_memory_plan_is_known_up_front():
    cfg, _, host, rng = make("float32")
    plan = decode_plan(cfg.model, CTX)
    kv = plan.by_group()["kv cache"]
    assert kv == 2 * cfg.model.n_layer * CTX * cfg.model.d_model * 4
    dec = Decoder(cfg.model, NumpyBackend())
    assert dec.arena.sealed and dec.arena.buf.size == plan.total()
    dec.load(host)
    start = dec.arena.offset
    for t in rng.integers(0, V, 3 * CTX):
        dec.step(t)
    assert dec.arena.offset == start  # nothing was taken from the arena while decoding
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.step(V)


def test_bad_weights_are_refused():
    cfg, _, host, _ = make("float32")
    dec = Decoder(cfg.model, NumpyBackend())
    with pytest.raises(ValueError, match="weights"):
        dec.load(host[:-1])
