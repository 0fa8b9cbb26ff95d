"""Helpers of the FP8 GPU tests (tests/cuda/test_fp8_cuda.py, test_engine_cuda.py)."""
import numpy as np

from andrea.backends import ref
from cudakit import small_config


TOL = 1e-2


MODEL = {"n_layer": 2, "d_model": 48, "n_head": 3, "context": 40, "vocab_size": 97}  # head size 16


def bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def use_tuning(monkeypatch, be, **settings):
    """The backend's launch geometry with settings changed for this test (cuda/tuning.Tuning, a
    frozen copy), on the backend and on its FP8 state, which keeps its own reference."""
    tuning = be.tuning.with_settings(settings)
    monkeypatch.setattr(be, "tuning", tuning)
    if be.fp8 is not None:
        monkeypatch.setattr(be.fp8, "tuning", tuning)
    return tuning


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def on_dev(x):
    import cupy as cp
    return cp.asarray(np.ascontiguousarray(x).astype(bf16()))


def host(a):
    return a.get().astype(np.float64)


def fp8_steps_apart(a, b):
    """Per element, how many FP8 codes apart two byte arrays of one format are (-0 as +0)."""
    def ordinal(q):
        q = q.astype(np.int32)
        return np.where(q & 0x80, -(q & 0x7F), q & 0x7F)
    return np.abs(ordinal(a) - ordinal(b))


# ---------------------------------------------------------------- the engine in fp8
def cfg_for(tmp_path, **train):
    from andrea.config import load_run_config
    d = small_config(tmp_path, **train)
    d["model"], d["backend"] = dict(MODEL), {"name": "cuda"}
    return load_run_config(d)


def batch(seed, B=4, T=32, V=97):
    rng = np.random.default_rng(seed)
    xy = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    return xy[:, :-1], xy[:, 1:]


# ---------------------------------------------------------------- the FP8 weight cache
def fp8_engine(tmp_path, **train):
    from andrea.core.engine import Engine
    eng = Engine(cfg_for(tmp_path, batch_size=4, seq_len=32, precision="fp8", **train))
    assert eng.be.fp8 is not None and eng.be.fp8.cache.copies, "no FP8 weight cache in use"
    return eng


def check_cache(eng, when):
    """Every cached copy (W, W^T) and its (amax, 1/scale) byte-equal to what k_fp8_amax +
    k_fp8_cast_transpose make of the weight as it is now (the per-product path), and to ref."""
    import cupy as cp
    from andrea.backends.cuda.fp8 import META_STRIDE
    from andrea.core.plan import fp8_cached_weights
    be = eng.be
    names = fp8_cached_weights(eng.cfg.model, eng.fp8_classifier)
    assert len(be.fp8.cache.copies) == len(names)
    for name in names:
        w = eng.p[name]
        q, q_t, row = be.fp8.cached(w)
        pair = cp.zeros(2, cp.float32)
        be.fp8.k_fp8_amax(pair, w)
        o, ot = cp.zeros(w.shape, cp.uint8), cp.zeros(w.shape[::-1], cp.uint8)
        be.fp8.k_fp8_cast_transpose(o, ot, pair, w, "e4m3")
        r = row.get()
        np.testing.assert_array_equal(r[[0, META_STRIDE // 2]], pair.get(), err_msg=f"{when}: {name} meta")
        np.testing.assert_array_equal(q.get(), o.get(), err_msg=f"{when}: {name} W")
        np.testing.assert_array_equal(q_t.get(), ot.get(), err_msg=f"{when}: {name} W^T")
        m_ref, o_ref = np.zeros(2, np.float32), np.zeros(w.shape, np.uint8)
        w32 = w.get().astype(np.float32)
        ref.k_fp8_amax(m_ref, w32)
        ref.k_fp8_cast(o_ref, m_ref, w32, "e4m3")
        np.testing.assert_array_equal(q.get(), o_ref, err_msg=f"{when}: {name} W (reference)")
        np.testing.assert_array_equal(r[[0, META_STRIDE // 2]], m_ref, err_msg=f"{when}: {name} meta (reference)")


def check_resume(eng, state, straight, check=None):
    """eng (a fresh engine) loads state, the straight run's after step 3, and runs steps 4..7 of
    two microbatches (step 5 skipped: a non-finite loss gradient); check(eng, "load_state") first
    where given. Its records and final weights and Adam state are the straight run's (records,
    counts, host state), bit for bit."""
    eng.load_state(state)
    if check is not None:
        check(eng, "load_state")
    recs = []
    for s in range(4, 8):
        if s == 5:
            eng.loss_scale = float("inf")
        recs.append(dict(eng.train_step(s, [batch(2 * s), batch(2 * s + 1)])))
        if s == 5:
            eng.loss_scale = 1.0
    assert repr(recs) == repr(straight[0][3:]), "resumed run's records differ"
    for a, b in zip(eng.host_state(), straight[2]):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), "resumed run differs from the straight run"


def launches(be):
    """Kernel names be launches from now on, in order."""
    got, launch = [], be.rt.launch
    be.rt.launch = lambda f, k, *a, **kw: (got.append(k), launch(f, k, *a, **kw))[1]
    return got


def cast_reference(be, x, fmt, saturate, partial=None):
    """What the delayed tile casts make of x (R, K) in format fmt, with meta[0] its amax (a quarter
    of it where saturate): the bytes and their transpose, the amax reduced into a record holding
    1e-3 (k_fp8_cast_transpose_amax; with partial, k_fp8_cast_transpose_colsum_amax, its column
    partials there). Returns (meta, its 1/scale zeroed again for the kernel under test, [bytes,
    transpose], the record, 1/scale, the amax)."""
    import cupy as cp
    R, K = x.shape
    am = cp.zeros(2, cp.float32)
    be.fp8.k_fp8_amax(am, x)
    top = float(am.get()[0])
    meta = cp.asarray(np.array([top * (0.25 if saturate else 1.0), 0], np.float32))
    want = [cp.zeros((R, K), cp.uint8), cp.zeros((K, R), cp.uint8)]
    rec = cp.asarray(np.array([1e-3], np.float32))
    if partial is None:
        be.fp8.k_fp8_cast_transpose_amax(*want, meta, x, fmt, rec)
    else:
        be.fp8.k_fp8_cast_transpose_colsum_amax(*want, meta, x, fmt, partial, rec)
    inv = meta.get()[1]
    meta[1] = 0
    return meta, want, rec, inv, top


def slot_engine(tmp_path, **train):
    from andrea.backends import get_backend
    from andrea.core.engine import Engine
    be = get_backend("cuda")
    be.fp8_scaling = "current"  # act's slot as current scaling fills it (check_slots); delayed: below
    eng = Engine(cfg_for(tmp_path, batch_size=4, seq_len=32, precision="fp8", **train), backend=be)
    assert be.fp8.slots, "no FP8 input slots in use"
    return eng


def check_slots(eng, when):
    """After a forward pass: each input slot's amax, 1/scale and kept X^T byte-equal to what
    k_fp8_amax + k_fp8_cast_transpose make of the saved input as it is now (for act,
    k_fp8_gelu_amax + k_fp8_gelu_cast_transpose of the layer's saved pre)."""
    import cupy as cp
    from andrea.backends.cuda.fp8 import META_STRIDE
    from andrea.core.plan import fp8_input_slots
    for w, l, x in fp8_input_slots(eng.cfg.model):
        slot = eng.be.fp8.slots[eng.p[w].data.ptr]
        if x == "act":  # made from the layer's saved pre by the FP8 GELU kernels
            pre = eng.layers[l]["pre"]
            x2 = pre.reshape(-1, pre.shape[-1])
            amax, cast = eng.be.fp8.k_fp8_gelu_amax, eng.be.fp8.k_fp8_gelu_cast_transpose
        else:
            x2 = eng.layers[l][x].reshape(-1, eng.cfg.model.d_model)
            amax, cast = eng.be.fp8.k_fp8_amax, eng.be.fp8.k_fp8_cast_transpose
        pair, xt = cp.zeros(2, cp.float32), cp.zeros(x2.shape[::-1], cp.uint8)
        amax(pair, x2)
        cast(None, xt, pair, x2, "e4m3")
        np.testing.assert_array_equal(slot.meta.get()[[0, META_STRIDE // 2]], pair.get(), err_msg=f"{when}: {w} meta")
        if slot.xt is not None:
            assert slot.ready, f"{when}: {w}"
            np.testing.assert_array_equal(slot.xt.get(), xt.get(), err_msg=f"{when}: {w} X^T")


def fp8_neighbours_at_midpoint(got, want, exact, fmt):
    """Where bytes differ: adjacent codes of one sign with the exact value within 1e-5 (relative)
    of the midpoint between them (the GPU's ex2.approx and float32 against float64)."""
    g, w = ref.fp8_decode(got, fmt).astype(np.float64), ref.fp8_decode(want, fmt).astype(np.float64)
    step = np.abs(got.astype(np.int64) - want.astype(np.int64))
    mid = (g + w) / 2
    return bool(np.all((step == 1) & (np.abs(exact - mid) <= 1e-5 * np.abs(mid))))


def delayed_engine(tmp_path, scaling="delayed", **train):
    from andrea.backends import get_backend
    from andrea.core.engine import Engine
    be = get_backend("cuda")
    be.fp8_scaling = scaling
    eng = Engine(cfg_for(tmp_path, batch_size=4, seq_len=32, precision="fp8", **train), backend=be)
    assert eng.fp8_delayed is (scaling == "delayed")
    return eng


def assert_same_runs(one, other, what="the two runs differ"):
    """Two runs' (records, host state) bit for bit: the records' text, every weight and Adam state."""
    (a, sa), (b, sb) = one, other
    assert repr(a) == repr(b), (what, a, b)
    for x, y in zip(sa, sb):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), what


def engine_t64(tmp_path, pdl=True):
    """An fp8 engine of MODEL at T = 64, B = 2 (the FP8 attention kernels want T % 64 == 0) on a
    backend of its own, programmatic dependent launch on or off (Runtime.pdl)."""
    from andrea.backends import get_backend
    from andrea.config import load_run_config
    from andrea.core.engine import Engine
    be = get_backend("cuda")
    be.rt.pdl = pdl
    d = small_config(tmp_path, batch_size=2, seq_len=64, precision="fp8")
    d["model"], d["backend"] = {**MODEL, "context": 64}, {"name": "cuda"}
    return Engine(load_run_config(d), backend=be)

