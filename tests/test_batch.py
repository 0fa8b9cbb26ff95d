"""The batched decoder (andrea/use/batch.py) on the NumPy backend: its greedy tokens against the
one-position Decoder's and the full forward pass's argmax, slot independence, continuous batching,
the end of a request, and bad requests.

float64 logits of the prefill equal the one-position decoder's to rounding (relative 1e-12: a
T-row product and a one-row product sum in different orders); greedy tokens are compared exactly
(the random model's logits have no ties at this precision).
"""
import dataclasses

import numpy as np
import pytest

from andrea.backends.numpy_backend import NumpyBackend
from andrea.config import load_run_config
from andrea.core.engine import Engine
from andrea.use.batch import BatchDecoder, Request
from andrea.use.inference import Decoder

V, CTX = 37, 40


@pytest.fixture(scope="module")
def model():
    cfg = load_run_config({"model": {"n_layer": 2, "d_model": 24, "n_head": 3, "context": CTX, "vocab_size": V},
                           "train": {"batch_size": 1, "seq_len": CTX, "init_std": 0.3},
                           "backend": {"name": "numpy"}})
    eng = Engine(cfg, dtype="float64")
    rng = np.random.default_rng(0)
    host = eng.be.to_numpy(eng.params).copy()
    host[eng.layout.n_decay:] += rng.normal(0, 0.3, host.size - eng.layout.n_decay)  # general LN gains
    eng.set_state(host)
    return cfg, eng, host


def batch(model, slots=3, dtype="float64", gemv=None):
    cfg, _, host = model
    bd = BatchDecoder(cfg.model, NumpyBackend(), slots, dtype=dtype, gemv=gemv)
    bd.load(host)
    return bd


def run_all(bd, reqs, admit_at=None):
    """Tokens of each request, request i admitted at step admit_at[i] or at the first step after
    it with a free slot (default: all at step 0)."""
    admit_at = admit_at or [0] * len(reqs)
    waiting, owner, out, step = list(range(len(reqs))), {}, [[] for _ in reqs], 0
    while waiting or owner:
        for i in list(waiting):
            if admit_at[i] <= step and bd.free():
                owner[bd.admit(reqs[i])] = i
                waiting.remove(i)
        for s, t, done in bd.step():
            out[owner[s]].append(t)
            if done:
                del owner[s]
        step += 1
    return out


def test_wide_models_take_the_training_layers_at_any_slot_count(model):
    """The few-row kernels only where they were measured to win: up to DECODE_GEMV_MAX_C (ANDREA-120M's
    768 since decode.cu version 2)."""
    from andrea.backends.interface import DECODE_GEMV_MAX_C
    cfg, _, _ = model
    wide = dataclasses.replace(cfg.model, d_model=DECODE_GEMV_MAX_C + 24, n_head=3)
    assert not BatchDecoder(wide, NumpyBackend(), 1, CTX, "float32").gemv
    narrow = dataclasses.replace(cfg.model, d_model=DECODE_GEMV_MAX_C, n_head=4)
    assert BatchDecoder(narrow, NumpyBackend(), 1, CTX, "float32").gemv


def test_the_few_row_products_at_one_slot_unless_asked(model):
    """One slot takes the few-row kernels, two the training's layers (DECODE_GEMV_SLOTS: measured);
    gemv=True asks for them up to their DECODE_GEMV_ROWS rows and no further, gemv=False not at all."""
    from andrea.backends.interface import DECODE_GEMV_ROWS, DECODE_GEMV_SLOTS
    cfg, _, _ = model
    assert DECODE_GEMV_SLOTS == 1
    assert BatchDecoder(cfg.model, NumpyBackend(), 1, CTX).gemv
    assert not BatchDecoder(cfg.model, NumpyBackend(), 2, CTX).gemv
    assert not BatchDecoder(cfg.model, NumpyBackend(), 1, CTX, gemv=False).gemv
    assert BatchDecoder(cfg.model, NumpyBackend(), DECODE_GEMV_ROWS, CTX, gemv=True).gemv
    with pytest.raises(ValueError, match=f"at most {DECODE_GEMV_ROWS}"):
        BatchDecoder(cfg.model, NumpyBackend(), DECODE_GEMV_ROWS + 1, CTX, gemv=True)


def prompt(seed, n):
    return list(map(int, np.random.default_rng(seed).integers(0, V, n)))


@pytest.mark.parametrize("dtype,slots,gemv", [("float64", 3, True), ("float32", 3, True), ("float64", 3, None),
                                              ("float64", 9, None)])
def test_greedy_tokens_equal_the_decoder_and_the_full_forward_argmax(model, dtype, slots, gemv):
    """3 slots asked for the few-row kernels (k_decode_ln_linear_fwd, k_decode_linear_fwd); 3 and 9
    by default: the training's layers."""
    cfg, eng, host = model
    reqs = [Request(prompt(n, n), 50) for n in (1, 7, 13)]  # odd lengths, each to its window's end
    bd = batch(model, slots=slots, dtype=dtype, gemv=gemv)
    assert bd.gemv == bool(gemv)
    got = run_all(bd, reqs)
    dec = Decoder(cfg.model, NumpyBackend(), dtype=dtype)
    dec.load(host)
    for r, toks in zip(reqs, got):
        assert len(toks) == CTX - len(r.prompt_ids) + 1  # the window ends the request
        dec.reset()
        z, want = dec.feed(r.prompt_ids), []
        for _ in toks:
            want.append(int(np.argmax(z)))
            if dec.pos < CTX:
                z = dec.step(want[-1])
        assert toks == want
        seq = np.array(r.prompt_ids + toks[:-1], np.int32)[None]  # the whole window, one forward pass
        eng.forward(seq, seq)
        assert toks == eng.g["logits"][len(r.prompt_ids) - 1:].argmax(-1).tolist()


def test_prefill_logits_equal_the_decoders(model):
    """The first token's logits come from the one-pass prefill (64-row padded), the decoder's from
    feeding one position at a time: equal to rounding."""
    cfg, _, host = model
    bd = batch(model)
    dec = Decoder(cfg.model, NumpyBackend(), dtype="float64")
    dec.load(host)
    for n in (1, 9, CTX):
        ids = prompt(100 + n, n)
        slot = bd.admit(Request(ids, 1))
        want = dec.feed(ids)
        dec.reset()
        got = bd.b["logits"][slot]
        assert np.abs(got - want).max() < 1e-12 * np.abs(want).max()
        assert bd.step() == [(slot, int(np.argmax(want)), True)]


def test_a_request_gets_the_same_tokens_alone_and_among_others(model):
    """Sampled and greedy requests, in different slots, admitted at different steps (a finished
    slot refilled), give the tokens they give alone in a decoder of the same slot count."""
    reqs = [Request(prompt(1, 5), 12, temperature=0.9, top_k=10, seed=3),
            Request(prompt(2, 11), 6),
            Request(prompt(3, 3), 20, temperature=1.3, top_p=0.8, seed=4),
            Request(prompt(4, 9), 15, temperature=0.7, seed=5)]
    alone = [run_all(batch(model), [r])[0] for r in reqs]
    together = run_all(batch(model), reqs, admit_at=[0, 0, 2, 7])  # the 4th waits for a free slot
    assert together == alone
    # and on the CPU a decoder of one slot (andrea generate's) gives them too
    assert [run_all(batch(model, slots=1), [r])[0] for r in reqs] == alone
    assert len(set(map(tuple, alone))) == 4


def test_end_of_a_request_and_release(model):
    bd = batch(model, slots=2)
    stop = run_all(batch(model, slots=2), [Request(prompt(9, 4), 30)])[0][5]
    got = run_all(bd, [Request(prompt(9, 4), 30, stop_ids=frozenset({stop}))])[0]
    assert got[-1] == stop and stop not in got[:-1]  # the stop id is yielded, then the slot is free
    assert bd.free() == 2
    a = bd.admit(Request(prompt(1, 3), 5))
    b = bd.admit(Request(prompt(2, 3), 5))
    assert (a, b) == (0, 1) and bd.free() == 0
    with pytest.raises(RuntimeError, match="busy"):
        bd.admit(Request(prompt(3, 3), 5))
    bd.release(a)
    assert [s for s, _, _ in bd.step()] == [1] and bd.free() == 1
    assert bd.b["lengths"][a] == 0 and bd.b["lengths"][b] == 4  # a free slot's row stays at 0
    assert bd.admit(Request(prompt(3, 3), 1)) == 0
    assert [(s, done) for s, _, done in bd.step()] == [(0, True), (1, False)]


@pytest.mark.parametrize("field,req", [
    ("prompt_ids", Request([], 3)), ("prompt_ids", Request([0] * (CTX + 1), 3)),
    ("prompt_ids", Request([1, V], 3)), ("max_new", Request([1], 0)),
    ("temperature", Request([1], 3, temperature=-1)), ("top_k", Request([1], 3, top_k=-2)),
    ("top_p", Request([1], 3, top_p=0)), ("seed", Request([1], 3, seed=-1))])
def test_bad_requests_are_one_line_naming_the_field(model, field, req):
    bd = batch(model, slots=1)
    with pytest.raises(ValueError) as e:
        bd.admit(req)
    assert str(e.value).startswith(field + ":") and "\n" not in str(e.value)
    assert bd.free() == 1
