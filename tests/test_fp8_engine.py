"""train.precision=fp8 in the engine, on the CPU: the NumPy backend's refusal, the memory plan's
FP8 rows (weight cache, input slots, classifier, delayed scales), the run settings, and the delayed
scales' amax history in the engine state and checkpoints. The FP8 reference itself is tested in
tests/ref/ (test_fp8.py and each op's file).

    python -m pytest tests/test_fp8_engine.py -q
"""
import numpy as np
import pytest


def test_numpy_backend_refuses_fp8_clearly(tmp_path):
    from andrea.config import load_run_config
    from andrea.core.engine import Engine
    from conftest import small_config
    with pytest.raises(ValueError, match="precision=fp8 needs backend=cuda"):
        Engine(load_run_config(small_config(tmp_path, precision="fp8")))


def test_memory_plan_lists_the_fp8_weight_cache():
    """fp8 plans an FP8 copy of every linear weight and of its transpose (one byte an element each,
    each copy 256-byte aligned), a 64-float (amax, 1/scale) row and a table row per weight; bf16
    plans none; at ANDREA-120M with B=8 the cache adds less than 10% to the plan."""
    from andrea.core import model
    from andrea.pipeline.compose import compose_config
    from andrea.core.plan import fp8_cached_weights, make_plan
    for exp, B in (("ANDREA-tiny", 4), ("ANDREA-120M", 8)):
        cfgs = {p: compose_config(exp, [f"train.precision={p}", f"train.batch_size={B}"]) for p in ("bf16", "fp8")}
        m = cfgs["fp8"].model
        shapes = dict(model.param_shapes(m)[0])
        names = fp8_cached_weights(m)
        assert len(names) == 4 * m.n_layer and all(shapes[n] for n in names)
        assert {shapes[n] for n in names[:4]} == {(3 * m.d_model, m.d_model), (m.d_model, m.d_model),
                                                  (4 * m.d_model, m.d_model), (m.d_model, 4 * m.d_model)}
        on = make_plan(cfgs["fp8"])
        rows = {r.name: r for r in on.rows if r.group == "fp8 weight cache"}
        assert set(rows) == {"fp8_wcache", "fp8_wmeta", "fp8_wtable"}
        copies = sum(2 * -(-int(np.prod(shapes[n])) // 256) * 256 for n in names)
        assert copies >= 2 * sum(int(np.prod(shapes[n])) for n in names)
        assert rows["fp8_wcache"].nbytes == copies
        assert rows["fp8_wmeta"].nbytes == len(names) * 64 * 4
        assert rows["fp8_wtable"].shape == (len(names), 5) and rows["fp8_wtable"].dtype == "int64"
        assert on.by_group()["fp8 weight cache"] == copies + len(names) * (256 + 40)
        assert "fp8 weight cache" not in make_plan(cfgs["bf16"]).by_group()
        if exp == "ANDREA-120M":
            cache = sum(-(-r.nbytes // 256) * 256 for r in rows.values())  # as MemoryPlan.total aligns rows
            rest = on.total() - cache  # the plan without the cache
            assert cache < 0.10 * rest, (on.total(), rest)


def test_memory_plan_lists_the_fp8_input_slots():
    """The input slots: a 64-float (amax, 1/scale) row for the input of every QKV, attention-output
    and MLP product (four a layer, the last one's input act) and FP8 X^T of each (IC x B*T bytes,
    256-byte aligned: C for the first three, 4C for act); none in 16 bits. At ANDREA-120M with
    B=8 the kept X^T are (3 + 4) x 12 x 768 x 8192 bytes (528.5 MB)."""
    from andrea.pipeline.compose import compose_config
    from andrea.core.plan import fp8_input_slots, make_plan
    for exp, B in (("ANDREA-tiny", 4), ("ANDREA-120M", 8)):
        cfg = compose_config(exp, ["train.precision=fp8", f"train.batch_size={B}"])
        m, N = cfg.model, B * cfg.train.seq_len
        slots = fp8_input_slots(m)
        assert [(w, x) for w, l, x in slots[:4]] == [("h0.qkv_w", "ln1"), ("h0.attn_out_w", "atty"),
                                                     ("h0.mlp_w1", "ln2"), ("h0.mlp_w2", "act")]
        assert len(slots) == 4 * m.n_layer and [l for _, l, _ in slots[-4:]] == [m.n_layer - 1] * 4
        plan = make_plan(cfg)
        group = "fp8 input slots"
        assert group not in make_plan(compose_config(exp, ["train.precision=bf16"])).by_group()
        meta = len(slots) * 64 * 4
        C = m.d_model
        xt = m.n_layer * (3 * (-(-C * N // 256) * 256) + (-(-4 * C * N // 256) * 256))
        assert plan.by_group()[group] == meta + xt
        assert {r.name for r in plan.rows if r.group == group} == {"fp8_xmeta", "fp8_xt"}
        if exp == "ANDREA-120M":
            assert xt == 7 * 12 * 768 * 8192 == 528_482_304


def test_memory_plan_of_bf16_and_fp8_needs_no_ml_dtypes():
    """The workflow sizes a run's memory (make_plan) in a process where nothing imported ml_dtypes,
    the package that teaches numpy the name "bfloat16": the plan of a bf16 or fp8 run must not
    depend on it (it once failed there with "data type 'bfloat16' not understood"). Run in a fresh
    interpreter with ml_dtypes made unimportable."""
    import subprocess
    import sys
    code = (
        "import sys; sys.modules['ml_dtypes'] = None\n"
        "from andrea.pipeline.compose import compose_config\n"
        "from andrea.core.plan import make_plan\n"
        "for p in ('bf16', 'fp8'):\n"
        "    plan = make_plan(compose_config('ANDREA-tiny', [f'train.precision={p}']))\n"
        "    rows = {r.name: r for r in plan.rows}\n"
        "    c = rows['params_c']\n"
        "    assert c.dtype == 'bfloat16' and c.nbytes == 2 * c.shape[0], (p, c)\n"
        "    assert plan.total() > 0\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_memory_plan_and_workspace_of_the_fp8_classifier():
    """With the classifier in FP8 the weight cache holds wte (V, C) first and its copies grow by
    2 x V x C bytes (aligned); the workspace rows add one chunk's FP8 dlogits (R x V), the chunk's
    input in both forms (R x C each) and room for wte in fp8_w, R the logits workspace's rows
    (loss_chunk_rows). Where V, B*T or R is no multiple of 16 the classifier stays in bf16
    (fp8_classifier_runs False) and nothing is added."""
    from andrea.backends.cuda.fp8 import classifier_in_fp8, fp8_rows
    from andrea.pipeline.compose import compose_config
    from andrea.core.engine import fp8_classifier_runs
    from andrea.core.plan import fp8_cached_weights, make_plan
    from andrea.core.model import loss_chunk_rows
    cfg = compose_config("ANDREA-120M", ["train.precision=fp8", "train.batch_size=8"])
    m, N = cfg.model, 8 * cfg.train.seq_len
    assert fp8_classifier_runs(cfg, True) and not fp8_classifier_runs(cfg, False)
    assert fp8_cached_weights(m, True) == ["wte"] + fp8_cached_weights(m)
    on, off = make_plan(cfg, fp8_classifier=True), make_plan(cfg)
    wte = m.vocab_size * m.d_model
    grow = {r.name: r.nbytes for r in on.rows}["fp8_wcache"] - {r.name: r.nbytes for r in off.rows}["fp8_wcache"]
    assert grow == 2 * -(-wte // 256) * 256
    R = loss_chunk_rows(N, m.vocab_size)
    rows = {name: int(np.prod(shape))
            for name, shape, _ in fp8_rows(8, cfg.train.seq_len, m.d_model, m.vocab_size, R)}
    plain = {name: int(np.prod(shape)) for name, shape, _ in fp8_rows(8, cfg.train.seq_len, m.d_model)}
    assert rows["fp8_dz"] == R * m.vocab_size and rows["fp8_cx"] == rows["fp8_cxt"] == R * m.d_model
    assert rows["fp8_w"] == wte > plain["fp8_w"] and not {"fp8_dz", "fp8_cx", "fp8_cxt"} & set(plain)
    assert not classifier_in_fp8(N, 50257, R) and classifier_in_fp8(N, 50304, R)
    assert not classifier_in_fp8(8200, 50304, loss_chunk_rows(8200, 50304))
    # chunks of rows no multiple of 16, or no chunk rows given: bf16, and no classifier rows
    assert not classifier_in_fp8(N, 50304, 40) and not classifier_in_fp8(N, 50304, 0)
    no_chunks = {name for name, _, _ in fp8_rows(8, cfg.train.seq_len, m.d_model, m.vocab_size)}
    assert not {"fp8_dz", "fp8_cx", "fp8_cxt"} & no_chunks
    odd = compose_config("ANDREA-tiny", ["train.precision=fp8", "model.vocab_size=97"])
    assert not fp8_classifier_runs(odd, True)


def test_fp8_classifier_settings_in_the_run_config():
    """train.fp8_classifier / fp8_dlogits / fp8_dlogits_rounding: checked (clear errors naming the field), handed to
    the backend by the engine where set (CudaBackend.set_fp8_run, as Engine calls it: a setting
    None leaves the backend's), and part of the config hash only where set, so every run made
    before they existed hashes (and resumes) as before."""
    import hashlib
    import json

    from andrea.backends.cuda import CudaBackend
    from andrea.pipeline.compose import compose_config
    from andrea.config import FP8_RUN_SETTINGS, config_hash, to_dict

    def apply_fp8_settings(be, t):  # what Engine hands the backend of a train.precision=fp8 run
        be.set_fp8_run(**{key: getattr(t, key) for key in FP8_RUN_SETTINGS})
    base = compose_config("ANDREA-tiny", ["train.precision=fp8"])
    d = to_dict(base)
    old = {k: v for k, v in d["train"].items() if k not in ("ckpt_every", "keep_last", "log_every", "sample_every",
                                                             "eval_every", "eval_batches", "fp8_classifier",
                                                             "fp8_dlogits", "fp8_dlogits_rounding",
                                                             "fp8_scaling")}
    assert config_hash(base) == hashlib.sha256(json.dumps({"model": d["model"], "train": old},
                                                          sort_keys=True).encode()).hexdigest()
    one = compose_config("ANDREA-tiny", ["train.precision=fp8", "train.fp8_classifier=1", "train.fp8_dlogits=e5m2"])
    assert config_hash(one) != config_hash(base)
    be = CudaBackend.__new__(CudaBackend)  # its run settings only: no device
    be.fp8_classifier, be.fp8_dlogits, be.fp8_dlogits_rounding = 0, "e4m3", "stochastic"
    apply_fp8_settings(be, base.train)
    assert (be.fp8_classifier, be.fp8_dlogits, be.fp8_dlogits_rounding) == (0, "e4m3", "stochastic")
    apply_fp8_settings(be, one.train)
    assert (be.fp8_classifier, be.fp8_dlogits, be.fp8_dlogits_rounding) == (1, "e5m2", "stochastic")
    near = compose_config("ANDREA-tiny", ["train.precision=fp8", "train.fp8_dlogits_rounding=nearest"])
    assert config_hash(near) not in (config_hash(base), config_hash(one))
    apply_fp8_settings(be, near.train)
    assert be.fp8_dlogits_rounding == "nearest"
    cur = compose_config("ANDREA-tiny", ["train.precision=fp8", "train.fp8_scaling=current"])
    assert config_hash(cur) not in (config_hash(base), config_hash(one), config_hash(near))
    be.fp8_scaling = "delayed"
    apply_fp8_settings(be, cur.train)
    assert be.fp8_scaling == "current"
    for bad, match in ((["train.precision=fp8", "train.fp8_classifier=3"], "train.fp8_classifier=3"),
                       (["train.precision=fp8", "train.fp8_dlogits=e3m4"], "train.fp8_dlogits='e3m4'"),
                       (["train.precision=fp8", "train.fp8_dlogits_rounding=up"], "train.fp8_dlogits_rounding='up'"),
                       (["train.precision=bf16", "train.fp8_dlogits_rounding=nearest"], "applies to train.precision=fp8"),
                       (["train.precision=bf16", "train.fp8_classifier=1"], "applies to train.precision=fp8"),
                       (["train.precision=fp8", "train.fp8_scaling=late"], "train.fp8_scaling='late'"),
                       (["train.precision=bf16", "train.fp8_scaling=delayed"], "applies to train.precision=fp8")):
        with pytest.raises(ValueError, match=match):
            compose_config("ANDREA-tiny", bad)


def test_memory_plan_and_state_of_the_delayed_scales():
    """fp8_delayed plans a 64-float row for each of eight tensors a layer (group "fp8 delayed
    scales"), nothing else changed; EngineState keeps the amax history in the sidecar's fields only
    where there is one, and from_checkpoint takes it from the sidecar (not from the engine's
    defaults: a checkpoint without one starts over)."""
    from types import SimpleNamespace

    from andrea.pipeline.compose import compose_config
    from andrea.core.plan import make_plan
    from andrea.core.state import EngineState
    cfg = compose_config("ANDREA-120M", ["train.precision=fp8", "train.batch_size=8"])
    on, off = make_plan(cfg, fp8_delayed=True), make_plan(cfg)
    assert on.by_group()["fp8 delayed scales"] == 8 * 12 * 64 * 4
    assert [r for r in on.rows if r.group != "fp8 delayed scales"] == off.rows
    assert "fp8 delayed scales" not in make_plan(compose_config("ANDREA-120M", ["train.precision=bf16"]),
                                                 fp8_delayed=True).by_group()
    z = np.zeros(3, np.float32)
    st = EngineState(z, z, z, 1.0, 0, 0, 0)
    assert "fp8_amax_history" not in st.counters()
    hist = [[0.5] * 16, [2.0 ** -20] * 16]
    st.fp8_amax_history = hist
    assert st.counters()["fp8_amax_history"] == hist
    defaults = {**EngineState(z, z, z, 1.0, 0, 0, 0).counters(), "fp8_amax_history": [[9.0] * 16]}
    c = SimpleNamespace(params=z, m=z, v=z, sidecar={**st.counters()})
    assert EngineState.from_checkpoint(c, defaults).fp8_amax_history == hist
    c.sidecar.pop("fp8_amax_history")
    assert EngineState.from_checkpoint(c, defaults).fp8_amax_history is None


def test_a_sidecars_amax_history_is_checked():
    """The checkpoint sidecar's fp8_amax_history becomes the delayed scales' rows only as (n, 16)
    finite, non-negative float32 values; otherwise a ValueError naming the field and what was
    expected (Engine.load_checkpoint makes it a CheckpointError naming the sidecar)."""
    from andrea.backends.cuda.fp8 import delayed_history_array
    good = [[float(2.0 ** -i) for i in range(16)] for _ in range(3)]
    h = delayed_history_array(good, 3)
    assert h.dtype == np.float32 and h.shape == (3, 16) and h[0, 3] == 0.125
    for bad, match in ((good[:2], r"shape \(2, 16\); expected \(3, 16\)"),
                       ([row[:15] for row in good], r"shape \(3, 15\)"),
                       ([[float("nan")] * 16] * 3, "not finite or is negative"),
                       ([[-1.0] * 16] * 3, "not finite or is negative"),
                       ([["x"] * 16] * 3, "not an array of numbers"),
                       ([[1.0] * 16, [1.0] * 3, [1.0] * 16], "fp8_amax_history")):
        with pytest.raises(ValueError, match=match):
            delayed_history_array(bad, 3)


def test_a_history_of_another_set_of_scales_is_told_apart():
    """delayed_history_array without a row count takes a well-formed history of any number of rows
    (Engine.load_checkpoint then starts one of another count than the engine's over: a checkpoint
    of a version with another set of delayed scales) and still refuses a malformed one."""
    from andrea.backends.cuda.fp8 import delayed_history_array
    good = [[0.5] * 16 for _ in range(6)]
    assert delayed_history_array(good).shape == (6, 16)
    with pytest.raises(ValueError, match=r"shape \(6, 16\); expected \(8, 16\)"):
        delayed_history_array(good, 8)
    for bad in ([row[:15] for row in good], [[float("nan")] * 16] * 6, [["x"] * 16] * 6, 3.0, None, [0.5] * 16):
        with pytest.raises(ValueError, match="fp8_amax_history"):
            delayed_history_array(bad)


def test_load_checkpoint_starts_another_sets_history_over(tmp_path, capsys):
    """Engine.load_checkpoint with delayed scales (an engine of 8 rows stood in for: an fp8 engine
    needs a GPU): a sidecar history of 6 well-formed rows (a checkpoint of a version with another
    set of delayed scales) is dropped with a message naming the sidecar, and the state loads
    without it; 8 rows load as they are; 8 rows with a NaN are refused with a CheckpointError
    naming the sidecar and the field, before anything is loaded."""
    from types import SimpleNamespace

    from andrea.core.checkpoint import CheckpointError, write_checkpoint
    from andrea.core.engine import Engine
    from andrea.core.state import EngineState
    n = 5
    z = np.zeros(n, np.float32)
    loaded = []
    from andrea.backends.cuda import CudaBackend
    # be: the backend's class (fp8_history_rows checks a history without a device)
    eng = SimpleNamespace(layout=SimpleNamespace(n_params=n), fp8_delayed=True, be=CudaBackend,
                          fp8_scales=SimpleNamespace(block=np.zeros((8, 64), np.float32)),
                          state_counters=lambda history=True: EngineState(z, z, z, 1.0, 0, 0, 0).counters(),
                          load_state=loaded.append)
    counters = EngineState(z, z, z, 1.0, 0, 0, 0).counters()
    for step, hist in ((1, [[0.5] * 16] * 6), (2, [[0.25] * 16] * 8), (3, [[0.5] * 16] * 7 + [[float("nan")] * 16])):
        path = write_checkpoint(tmp_path, step, z + 1, z, z, {**counters, "fp8_amax_history": hist})
        if step == 3:
            with pytest.raises(CheckpointError, match=r"sidecar .*step_0*3\.json: field fp8_amax_history"):
                Engine.load_checkpoint(eng, path)
            assert len(loaded) == 2, "a refused checkpoint was loaded"
            continue
        Engine.load_checkpoint(eng, path)
        st = loaded[-1]
        assert np.array_equal(st.params, z + 1)
        if step == 1:
            assert st.fp8_amax_history is None
            err = capsys.readouterr().err
            assert "fp8_amax_history has 6 rows" in err and "step_00000001.json" in err and "start over" in err
        else:
            assert st.fp8_amax_history == hist
