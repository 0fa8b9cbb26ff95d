"""Engine: accumulation, overfitting, determinism, no allocation in the step loop, NaN policy."""
import tracemalloc

import numpy as np
import pytest

from andrea.config import load_run_config
from andrea.core.engine import Engine, lr_at

MODEL = {"n_layer": 2, "d_model": 32, "n_head": 4, "context": 32, "vocab_size": 61}


def make_cfg(**train):
    t = {"batch_size": 2, "seq_len": 16, "lr": 1e-2, "warmup_steps": 0, "steps": 100}
    t.update(train)
    return load_run_config({"model": MODEL, "train": t, "backend": {"name": "numpy"}})


def batch(rng, B, T=16):
    x = rng.integers(0, 61, (B, T + 1)).astype(np.int32)
    return x[:, :-1], x[:, 1:]


def test_accumulation_equals_big_batch():
    """4 microbatches of 2 give the update of 1 batch of 8 (float64: to rounding, 1e-12)."""
    x, y = batch(np.random.default_rng(0), 8)
    small = Engine(make_cfg(batch_size=2, grad_accum=4), dtype="float64")
    big = Engine(make_cfg(batch_size=8), dtype="float64")
    r1 = small.train_step(1, [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)])
    r2 = big.train_step(1, [(x, y)])
    assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-12)
    assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-12)
    np.testing.assert_allclose(small.params, big.params, rtol=1e-12, atol=1e-14)
    assert not np.array_equal(small.params, Engine(make_cfg(), dtype="float64").params)  # it moved


def test_grads_hold_the_sum_until_zeroed():
    rng = np.random.default_rng(1)
    a, b = batch(rng, 2), batch(rng, 2)
    eng = Engine(make_cfg(), dtype="float64")
    eng.forward_backward(*a)
    ga = eng.grads.copy()
    eng.zero_grads()
    eng.forward_backward(*b)
    gb = eng.grads.copy()
    eng.zero_grads()
    eng.forward_backward(*a)
    eng.forward_backward(*b)
    np.testing.assert_allclose(eng.grads, ga + gb, rtol=1e-12, atol=1e-15)
    eng.zero_grads()
    assert not eng.grads.any()


def test_overfits_a_fixed_batch():
    x, y = batch(np.random.default_rng(2), 4)
    eng = Engine(make_cfg(batch_size=4, lr=1e-2, warmup_steps=5, steps=150))
    first = eng.train_step(1, [(x, y)])["loss"]
    for s in range(2, 151):
        last = eng.train_step(s, [(x, y)])["loss"]
    assert first > 3.5  # ~ln(61) = 4.11 at init
    assert last < first / 10, (first, last)


def test_same_seed_same_bits():
    rng = np.random.default_rng(3)
    batches = [batch(rng, 2) for _ in range(5)]
    runs = []
    for _ in range(2):
        eng = Engine(make_cfg(seed=7))
        losses = [eng.train_step(i + 1, [b])["loss"] for i, b in enumerate(batches)]
        runs.append((losses, eng.params.tobytes(), eng.m.tobytes(), eng.v.tobytes()))
    assert runs[0] == runs[1]
    other = Engine(make_cfg(seed=8))
    assert other.params.tobytes() != Engine(make_cfg(seed=7)).params.tobytes()


def test_step_loop_allocates_no_buffers():
    """The arena is sealed after start-up, and steady-state steps leave no memory behind."""
    eng = Engine(make_cfg())
    assert eng.arena.sealed and eng.arena.offset <= eng.arena.buf.size == eng.plan.total()
    with pytest.raises(RuntimeError, match="after seal"):
        eng.arena.take((4,), "float32")
    views_before = eng.arena.n_views
    x, y = batch(np.random.default_rng(4), 2)
    for s in range(1, 4):
        eng.train_step(s, [(x, y)])
    tracemalloc.start()
    eng.train_step(4, [(x, y)])
    base, _ = tracemalloc.get_traced_memory()
    for s in range(5, 25):
        eng.train_step(s, [(x, y)])
    now, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert eng.arena.n_views == views_before
    # 20 steps would leave > 20 * the smallest buffer (a (B,T) float32 = 128 B) if any persisted
    assert now - base < 2048, f"memory grew by {now - base} bytes over 20 steps"


def test_non_finite_step_is_skipped(monkeypatch):
    eng = Engine(make_cfg())
    x, y = batch(np.random.default_rng(5), 2)
    eng.train_step(1, [(x, y)])
    before = (eng.params.copy(), eng.m.copy(), eng.v.copy())
    real = eng._passes

    def poisoned(*args, **kw):
        real(*args, **kw)
        eng.grads[17] = np.nan

    monkeypatch.setattr(eng, "_passes", poisoned)
    rec = eng.train_step(2, [(x, y)])
    assert rec["skipped"] and not np.isfinite(rec["grad_norm"])
    for a, b in zip(before, (eng.params, eng.m, eng.v)):
        assert np.array_equal(a, b)
    assert eng.skipped == 1 and eng.bad_streak == 1
    # the NaN stays in grads (nothing zeroes them between steps); the next step's first pass writes
    # every gradient, so it does not reach step 3
    assert np.isnan(eng.grads[17])
    monkeypatch.setattr(eng, "_passes", real)
    rec3 = eng.train_step(3, [(x, y)])
    assert not rec3["skipped"] and np.isfinite(rec3["grad_norm"]) and np.isfinite(eng.grads).all()
    monkeypatch.setattr(eng, "_passes", real)
    assert not eng.train_step(3, [(x, y)])["skipped"]
    assert eng.bad_streak == 0


def test_lr_schedule_warmup_and_cosine():
    cfg = make_cfg(lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=110)
    assert lr_at(cfg, 5) == pytest.approx(5e-4)
    assert lr_at(cfg, 10) == pytest.approx(1e-3)
    assert lr_at(cfg, 60) == pytest.approx(5.5e-4)
    assert lr_at(cfg, 110) == pytest.approx(1e-4)


def test_fp16_on_numpy_is_refused():
    with pytest.raises(ValueError, match="precision=fp16 needs backend=cuda"):
        Engine(make_cfg(precision="fp16"))


def test_plan_counts_every_buffer():
    eng = Engine(make_cfg(batch_size=3, seq_len=10))
    groups = eng.plan.by_group()
    n = eng.layout.n_params
    assert groups["weights"] == groups["grads"] == groups["adam_m"] == groups["adam_v"] == 4 * n
    # per layer: 12 (B,T,C)-sized activations (ln1, qkv x3, atty, xmid, ln2, pre x4, res_out)
    # plus mean/rstd x2 and the attention lse (NH rows)
    B, T, C, NH = 3, 10, 32, 4
    per_layer = 4 * (B * T * C * 12 + B * T * 4 + B * NH * T)
    assert groups["activations (layers)"] == 2 * per_layer


def test_classifier_in_chunks_matches_one_chunk(monkeypatch):
    """The engine's logits workspace holds loss_chunk_rows rows, not B*T: with a budget of 5
    rows (chunks 5, 5, ..., 2 of the 32 positions) three steps give the losses, norms and weights
    of the one-chunk run (float64: to rounding, 1e-12), and the plan holds no (B,T,V) buffer."""
    from andrea.core import model
    x, y = batch(np.random.default_rng(3), 2)
    one = Engine(make_cfg(), dtype="float64")
    monkeypatch.setattr(model, "LOSS_CHUNK_ELEMENTS", 5 * MODEL["vocab_size"] + 7)
    chunked = Engine(make_cfg(), dtype="float64")
    assert one.g["logits"].shape == (32, 61)
    assert chunked.g["logits"].shape == (4, 61)  # the power of two below 5
    for s in range(1, 4):
        a, b = one.train_step(s, [(x, y)]), chunked.train_step(s, [(x, y)])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-12)
    # atol: parameters whose true gradient is zero get rounding noise g ~ 1e-16, which AdamW turns
    # into steps of lr * g / eps ~ 1e-10 (the summation order of the chunks differs)
    np.testing.assert_allclose(chunked.params, one.params, rtol=1e-12, atol=1e-10)


def test_plan_names_the_attention_path():
    import io
    eng = Engine(make_cfg())
    out = io.StringIO()
    eng.print_plan(file=out)
    head = out.getvalue().splitlines()[0]
    assert head.startswith("memory plan:") and head.endswith("attention=materialised")
    assert "total (aligned)" in out.getvalue()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_backward_needs_no_zeroed_workspace(dtype):
    """model.backward zeroes nothing: the first kernel to write each activation gradient (dres,
    dln, datty, dqkv) overwrites it, so a workspace full of NaN gives the same gradient bits as
    one full of zeros."""
    from andrea.core import model
    x, y = batch(np.random.default_rng(16), 2)
    eng = Engine(make_cfg(), dtype=dtype)
    grads = []
    for fill in (0.0, np.nan):
        for k in model.WORKSPACE:
            eng.g[k][...] = fill
        eng.zero_grads()
        eng.forward_backward(x, y)
        grads.append(eng.grads.copy())
    assert np.isfinite(grads[1]).all() and grads[1].any()
    np.testing.assert_array_equal(grads[1], grads[0])
