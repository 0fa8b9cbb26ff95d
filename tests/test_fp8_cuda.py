"""The FP8 path on the GPU (train.precision=fp8): the quantisation kernels byte for byte and the
FP8 linear layers against the reference's FP8 section, two fp8 runs bit-identical, and the FP8 weight
cache (copies of the weights made once per optimizer step) byte for byte what each product's own
quantisation writes (skipped without a GPU of compute capability 8.9 or later). SIGTERM + resume
of an fp8 run is tests/test_cuda_engine.py::test_sigterm_resume_bit_exact_on_gpu[fp8].

    python -m pytest -m gpu tests/test_fp8_cuda.py -q

Tolerances of the layers: GPU and reference quantise the same bf16 inputs to the same FP8 bytes
(checked exactly below), so what differs is the product's float32 accumulation order, cuBLASLt's
fast FP8 accumulation in the forward product, and the bf16 rounding of outputs (2^-9 relative per
element): 1e-2 relative (Frobenius) for every output, against the FP8 reference. Against the float64
layers without quantisation the E4M3 error is a few percent: asserted below 0.1, and above 1e-3 so
the FP8 path is seen to be in use.
"""
import numpy as np
import pytest

from andrea.backends import ref
from conftest import fp8_gpu, small_config


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores and CuPy")]

TOL = 1e-2
MODEL = {"n_layer": 2, "d_model": 48, "n_head": 3, "context": 40, "vocab_size": 97}  # head size 16


def bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def be():
    from andrea.backends import get_backend
    b = get_backend("cuda")
    b.reserve_workspace(4, 48, 80, 5, bf16(), fp8=True)
    return b


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


@pytest.mark.parametrize("rows", [64, 128, 256])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("R,K", [(48, 80), (112, 208), (16, 16), (400, 96)])  # partial tiles of every height
def test_cast_kernels_match_the_reference_bytes(be, fmt, R, K, rows, monkeypatch):
    """k_fp8_amax, k_fp8_cast_transpose (tiles of 64, 128 and 256 rows: Tuning.fp8_tile_rows;
    whole tiles and partial ones, which take fp8_cast_tile's two copies) and k_fp8_cast byte for
    byte against the reference; a NaN makes the amax NaN."""
    import cupy as cp
    use_tuning(monkeypatch, be, fp8_tile_rows=rows)
    rng = np.random.default_rng(R * K)
    x = (rng.standard_normal((R, K)) * np.exp2(rng.integers(-12, 6, (R, K)))).astype(bf16())
    xd = cp.asarray(x)
    meta, meta_ref = cp.full(2, -7, cp.float32), np.zeros(2, np.float32)
    be.fp8.k_fp8_amax(meta, xd)
    ref.k_fp8_amax(meta_ref, x.astype(np.float32))
    out, out_t = cp.zeros((R, K), cp.uint8), cp.zeros((K, R), cp.uint8)
    be.fp8.k_fp8_cast_transpose(out, out_t, meta, xd, fmt)
    o_ref, t_ref = np.zeros((R, K), np.uint8), np.zeros((K, R), np.uint8)
    ref.k_fp8_cast_transpose(o_ref, t_ref, meta_ref, x.astype(np.float32), fmt)
    np.testing.assert_array_equal(meta.get(), meta_ref)
    np.testing.assert_array_equal(out.get(), o_ref)
    np.testing.assert_array_equal(out_t.get(), t_ref)
    flat = cp.zeros(R * K, cp.uint8)
    be.fp8.k_fp8_cast(flat, meta, xd.reshape(-1), fmt)
    np.testing.assert_array_equal(flat.get(), o_ref.reshape(-1))
    x[R // 2, K // 3] = np.nan  # a NaN anywhere makes the scale NaN: the step becomes non-finite
    be.fp8.k_fp8_amax(meta, cp.asarray(x))
    assert np.isnan(meta.get()[0])


@pytest.mark.parametrize("rows", [64, 128, 256])
@pytest.mark.parametrize("R,K", [(48, 80), (112, 208), (16, 16), (400, 96), (272, 2320)])
def test_cast_transpose_colsum_matches_the_reference_bits(be, R, K, rows, monkeypatch):
    """k_fp8_cast_transpose_colsum: the bytes and 1/scale of k_fp8_cast_transpose, and each tile's
    column sums bit for bit as ref.fp8_tile_colsum adds them (partial tiles of every height,
    columns past the last whole tile, whole tiles); without out or out_t too."""
    import cupy as cp
    use_tuning(monkeypatch, be, fp8_tile_rows=rows)
    rng = np.random.default_rng(R * K + rows)
    x = (rng.standard_normal((R, K)) * np.exp2(rng.integers(-12, 6, (R, K)))).astype(bf16())
    xd, n = cp.asarray(x), -(-R // rows)
    meta = cp.zeros(2, cp.float32)
    be.fp8.k_fp8_amax(meta, xd)
    want = [cp.zeros((R, K), cp.uint8), cp.zeros((K, R), cp.uint8)]
    be.fp8.k_fp8_cast_transpose(*want, meta, xd, "e4m3")
    inv = meta.get()[1]
    ref_part = ref.fp8_tile_colsum(x.astype(np.float32), rows)
    for keep in ((1, 1), (1, 0), (0, 1)):
        out = [cp.full(a.shape, 0xAA, cp.uint8) if k else None for a, k in zip(want, keep)]
        part = cp.full(n * K, np.nan, cp.float32)
        meta[1] = 0
        be.fp8.k_fp8_cast_transpose_colsum(*out, meta, xd, "e4m3", part)
        assert meta.get()[1] == inv
        for o, w in zip(out, want):
            if o is not None:
                np.testing.assert_array_equal(o.get(), w.get())
        np.testing.assert_array_equal(part.get().reshape(n, K).view(np.uint32), ref_part.view(np.uint32))
    with pytest.raises(ValueError, match="partial"):
        be.fp8.k_fp8_cast_transpose_colsum(None, None, meta, xd, "e4m3", cp.zeros((n + 1) * K, cp.float32))


@pytest.mark.parametrize("IC,OC", [(80, 240), (320, 80)])
def test_linear_bias_gradient_from_the_cast(be, IC, OC, monkeypatch):
    """The bias gradient comes from dY's cast (k_fp8_cast_transpose_colsum and k_colsum_final; no
    two-pass column sums of dY): db within float32's rounding of the sum of dY."""
    import cupy as cp
    rng = np.random.default_rng(IC * OC)
    x, w = on_dev(rng.standard_normal((4, 48, IC))), on_dev(0.05 * rng.standard_normal((OC, IC)))
    dy = on_dev(rng.standard_normal((4, 48, OC)))
    launched, launch = [], be.rt.launch
    monkeypatch.setattr(be.rt, "launch", lambda f, k, *a, **kw: (launched.append(k), launch(f, k, *a, **kw))[1])
    g = [cp.zeros((4, 48, IC), bf16()), cp.zeros((OC, IC), cp.float32), cp.full(OC, 0.25, cp.float32)]
    be.k_fp8_linear_bwd(*g, dy, x, w)
    got = [a.get() for a in g]
    assert "k_fp8_cast_transpose_colsum" in launched and not any(k.startswith("k_colsum_partial") for k in launched)
    db = 0.25 + host(dy).reshape(-1, OC).sum(0)
    assert np.abs(got[2] - db).max() < 1e-5 * np.abs(host(dy)).sum(0).max()
    assert not np.array_equal(got[2], np.full(OC, 0.25, np.float32))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_many_kernels_are_each_tensor_alone(be, fmt):
    """k_fp8_amax_many + k_fp8_cast_transpose_many over tensors of several shapes (partial tiles,
    one with more tiles and more values than its blocks take at once, so the blocks stride; a zero
    tensor, a NaN; an output skipped) against k_fp8_amax + k_fp8_cast_transpose on each tensor
    alone and against the reference's *_many: the same bytes and meta, the rest of meta zeroed."""
    import cupy as cp
    from andrea.backends.cuda.fp8.plan import MANY_BLOCKS, META_STRIDE, TILE
    rng = np.random.default_rng(11)
    shapes = [(48, 80), (112, 208), (16, 16), (1040, 592), (240, 80), (80, 320)]
    assert (1040 // TILE + 1) * (592 // TILE + 1) > MANY_BLOCKS and 1040 * 592 > 8 * 256 * MANY_BLOCKS
    xs = [(rng.standard_normal(s) * np.exp2(rng.integers(-12, 6, s))).astype(bf16()) for s in shapes]
    xs[2][...] = 0
    xs[5][7, 9] = np.nan
    xd = [cp.asarray(x) for x in xs]
    outs = [cp.full(s, 0xAA, cp.uint8) for s in shapes]
    outs_t = [cp.full(s[::-1], 0xAA, cp.uint8) for s in shapes]
    outs[4] = None
    table = be.fp8.make_table(xd, outs, outs_t)
    meta = cp.full((len(xs), META_STRIDE), -7, cp.float32)
    be.fp8.k_fp8_amax_many(meta, table, bf16(), shapes)
    be.fp8.k_fp8_cast_transpose_many(meta, table, fmt, bf16(), shapes)
    inv = META_STRIDE // 2
    m_ref = np.zeros((len(xs), META_STRIDE), np.float32)
    o_ref = [np.zeros(s, np.uint8) for s in shapes]
    t_ref = [np.zeros(s[::-1], np.uint8) for s in shapes]
    ref.k_fp8_amax_many(m_ref, [x.astype(np.float32) for x in xs])
    ref.k_fp8_cast_transpose_many(o_ref, t_ref, m_ref, [x.astype(np.float32) for x in xs], fmt)
    got = meta.get()
    np.testing.assert_array_equal(got, m_ref)  # amax at 0, 1/scale at inv, zeros elsewhere
    for t, x in enumerate(xd):
        pair = cp.zeros(2, cp.float32)
        be.fp8.k_fp8_amax(pair, x)
        o, ot = cp.zeros(shapes[t], cp.uint8), cp.zeros(shapes[t][::-1], cp.uint8)
        be.fp8.k_fp8_cast_transpose(o, ot, pair, x, fmt)
        np.testing.assert_array_equal(got[t, [0, inv]], pair.get(), err_msg=f"tensor {t}: meta")
        finite = t != 5  # the NaN tensor's bytes are NaN encodings: compared GPU to GPU only
        if outs[t] is not None:
            np.testing.assert_array_equal(outs[t].get(), o.get(), err_msg=f"tensor {t}: out")
            if finite:
                np.testing.assert_array_equal(outs[t].get(), o_ref[t], err_msg=f"tensor {t}: out (reference)")
        np.testing.assert_array_equal(outs_t[t].get(), ot.get(), err_msg=f"tensor {t}: out_t")
        if finite:
            np.testing.assert_array_equal(outs_t[t].get(), t_ref[t], err_msg=f"tensor {t}: out_t (reference)")
    assert got[2, inv] == 1.0 and np.isnan(got[5, 0]) and np.isnan(got[5, inv])


def test_make_table_refuses_what_the_kernels_cannot_take(be):
    import cupy as cp
    x = on_dev(np.ones((32, 48)))
    with pytest.raises(ValueError, match="multiples of 16"):
        be.fp8.make_table([on_dev(np.ones((40, 24)))], [None], [cp.zeros((24, 40), cp.uint8)])
    with pytest.raises(ValueError, match="out_t has shape"):
        be.fp8.make_table([x], [None], [cp.zeros((32, 48), cp.uint8)])
    with pytest.raises(TypeError, match="dtype"):
        be.fp8.make_table([x], [cp.zeros((32, 48), cp.int8)], [None])


def test_cast_refuses_sizes_cublaslt_cannot_take(be):
    import cupy as cp
    with pytest.raises(ValueError, match="multiples of 16"):
        be.fp8.k_fp8_cast_transpose(None, cp.zeros(40 * 24, cp.uint8), cp.zeros(2, cp.float32),
                                    on_dev(np.ones((40, 24))), "e4m3")
    # tile rows the kernels are not built for: refused where the tuning is made
    with pytest.raises(ValueError, match="fp8_tile_rows = 96: expected one of"):
        be.tuning.with_settings({"fp8_tile_rows": 96})


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "write"])
@pytest.mark.parametrize("grad_fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("IC,OC", [(80, 240), (80, 80), (320, 80)])
def test_linear_layer_matches_the_fp8_reference(be, grad_fmt, IC, OC, accumulate):
    import cupy as cp
    rng = np.random.default_rng(IC + OC)
    Bn, T = 4, 48
    x = on_dev(rng.standard_normal((Bn, T, IC)))
    w, b = on_dev(0.05 * rng.standard_normal((OC, IC))), on_dev(0.05 * rng.standard_normal(OC))
    dy = on_dev(rng.standard_normal((Bn, T, OC)))
    X, W, Bv, DY = (host(a) for a in (x, w, b, dy))
    out = cp.full((Bn, T, OC), np.nan, bf16())
    be.k_fp8_linear_fwd(out, x, w, b)
    # backward ADDS: pre-filled, dinp small enough that its bf16 rounding stays below TOL; in the
    # write mode dinp starts as NaN and is compared as it is
    pre = [0.1 * rng.standard_normal(s) for s in ((Bn, T, IC), (OC, IC), (OC,))]
    dx, dw, db = on_dev(pre[0]), cp.asarray(pre[1], cp.float32), cp.asarray(pre[2], cp.float32)
    pre[0] = host(dx)
    if not accumulate:
        dx, pre[0] = cp.full(dx.shape, np.nan, bf16()), np.zeros_like(pre[0])
    be.k_fp8_linear_bwd(dx, dw, db, dy, x, w, grad_fmt=grad_fmt, accumulate=accumulate)
    o_ref = np.zeros((Bn, T, OC))
    ref.k_fp8_linear_fwd(o_ref, X, W, Bv)
    g_ref = [np.zeros_like(p) for p in pre]
    ref.k_fp8_linear_bwd(*g_ref, DY, X, W, grad_fmt)
    assert rel(host(out), o_ref) < TOL
    for name, got, p, r in zip(("dinp", "dw", "db"), (dx, dw, db), pre, g_ref):
        e = rel(host(got) - p, r)
        assert e < TOL, f"{name}: {e:.3g}"
    f64 = np.zeros((Bn, T, OC))
    ref._linear_fwd(f64, X, W, Bv)
    assert 1e-3 < rel(host(out), f64) < 0.1


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "write"])
def test_mlp_matches_the_fp8_reference(be, accumulate):
    """Stage by stage, each reference stage fed the GPU's bf16 intermediates (pre, act, dact), as
    every kernel test feeds the reference the inputs rounded to the compute dtype: an intermediate
    rounded to bf16 and then to FP8 lands on the other side of an FP8 rounding boundary now and
    then (double rounding), which the float64 reference of the whole MLP would not see. The
    forward does not write act (its FP8 operand comes from pre); the backward's dact *= gelu'(pre)
    by k_fp8_dgelu_colsum_amax."""
    import cupy as cp
    rng = np.random.default_rng(5)
    Bn, T, C, H = 4, 48, 80, 320
    x, dy = on_dev(rng.standard_normal((Bn, T, C))), on_dev(1e-3 * rng.standard_normal((Bn, T, C)))
    w1, b1 = on_dev(0.1 * rng.standard_normal((H, C))), on_dev(0.1 * rng.standard_normal(H))
    w2, b2 = on_dev(0.05 * rng.standard_normal((C, H))), on_dev(0.05 * rng.standard_normal(C))
    out, pre = cp.full((Bn, T, C), np.nan, bf16()), cp.full((Bn, T, H), np.nan, bf16())
    act, dact = cp.full((Bn, T, H), 7, bf16()), cp.empty((Bn, T, H), bf16())
    be.k_fp8_mlp_fwd(out, pre, act, x, w1, b1, w2, b2)
    assert bool((act == 7).all()), "the fp8 forward wrote act"
    X, DY, W1, B1, W2, B2 = (host(a) for a in (x, dy, w1, b1, w2, b2))
    P = host(pre)
    p_ref, o_ref = np.zeros((Bn, T, H)), np.zeros((Bn, T, C))
    ref.k_fp8_linear_fwd(p_ref, X, W1, B1)
    assert rel(P, p_ref) < TOL
    ref.k_fp8_linear_fwd(o_ref, ref._act(pre.get()).astype(np.float64), W2, B2)  # act = gelu(pre), in bf16
    assert rel(host(out), o_ref) < TOL
    g = [cp.zeros((Bn, T, C), bf16()), cp.zeros((H, C), cp.float32), cp.zeros(H, cp.float32),
         cp.zeros((C, H), cp.float32), cp.zeros(C, cp.float32)]
    if not accumulate:  # dinp written: NaN before
        g[0] = cp.full((Bn, T, C), np.nan, bf16())
    be.k_fp8_mlp_bwd(*g, dy, x, pre, w1, w2, act, dact, accumulate=accumulate)
    assert bool((act == 7).all()), "the fp8 backward wrote act"
    A, D = ref._act(pre.get()).astype(np.float64), host(dact)  # act = gelu(pre) in bf16; the GPU's dact
    d2 = [np.zeros((Bn, T, H)), np.zeros((C, H)), np.zeros(C)]
    ref.k_fp8_linear_bwd(*d2, DY, A, W2, be.fp8.grad_fmt)
    d2[0] *= ref._gelu_grad(P)
    assert rel(D, d2[0]) < TOL, "dact"
    d1 = [np.zeros((Bn, T, C)), np.zeros((H, C)), np.zeros(H)]
    ref.k_fp8_linear_bwd(*d1, D, X, W1, be.fp8.grad_fmt)
    for name, got, r in zip(("dinp", "dw1", "db1", "dw2", "db2"), g, d1 + d2[1:]):
        e = rel(host(got), r)
        assert e < TOL, f"{name}: {e:.3g}"


def fp8_steps_apart(a, b):
    """Per element, how many FP8 codes apart two byte arrays of one format are (-0 as +0)."""
    def ordinal(q):
        q = q.astype(np.int32)
        return np.where(q & 0x80, -(q & 0x7F), q & 0x7F)
    return np.abs(ordinal(a) - ordinal(b))


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("R,K", [(48, 80), (112, 208), (16, 16), (400, 96)])  # partial tiles
def test_gelu_kernels_match_the_reference(be, dtype, R, K, rows, monkeypatch):
    """k_fp8_gelu_amax and k_fp8_gelu_cast_transpose of pre against the reference's (both formats;
    both outputs or out_t alone, the same bytes; a NaN in pre makes the amax NaN). The GPU's act
    is gelu.cuh's sigmoid form in float32, the reference's the tanh form in float64: the same
    function, rounded to the dtype, so a few elements land one unit of the dtype apart, and so at
    most one FP8 code apart in under 1% of the bytes (the reference cast with the GPU's amax);
    the amax within one unit of the dtype. gelu.cuh's folded form (-DGELU_FMA=1), the one fp8.cu is
    built with."""
    import cupy as cp
    use_tuning(monkeypatch, be, fp8_tile_rows=rows)
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    unit = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
    rng = np.random.default_rng(R + K)
    p0 = rng.standard_normal((R, K)) * np.exp2(rng.integers(-4, 4, (R, K)))
    for nan in (False, True):
        if nan:
            p0[R - 1, K - 3] = np.nan
        pre = cp.asarray(p0.astype(dt))
        P = pre.get().astype(np.float32)
        for fmt in ("e4m3", "e5m2"):
            m = cp.full(64, 5, cp.float32)
            be.fp8.k_fp8_gelu_amax(m, pre)
            r_m = np.zeros(2, np.float32)
            ref.k_fp8_gelu_amax(r_m, P.astype(dt))
            a = m.get()[0]
            if nan:
                assert np.isnan(a) and np.isnan(r_m[0])
                continue
            assert abs(a - r_m[0]) <= unit * r_m[0] and a > 0, (fmt, a, r_m[0])
            outs = {}
            for both in (True, False):
                go, gt = cp.full((R, K), 3, cp.uint8), cp.full((K, R), 3, cp.uint8)
                be.fp8.k_fp8_gelu_cast_transpose(go if both else None, gt, m, pre, fmt)
                outs[both] = go.get(), gt.get()
            assert np.array_equal(outs[True][1], outs[False][1]) and (outs[False][0] == 3).all()
            assert np.array_equal(outs[True][0], outs[True][1].T)
            r_o, pair = np.zeros((R, K), np.uint8), np.array([a, 0], np.float32)
            ref.k_fp8_gelu_cast_transpose(r_o, None, pair, P.astype(dt), fmt)
            assert pair[1] == m.get()[32], "1/scale"
            apart = fp8_steps_apart(outs[True][0], r_o)
            assert apart.max() <= 1 and (apart > 0).mean() < 0.01, (fmt, int(apart.max()), (apart > 0).mean())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("N,H", [(53, 208), (256, 1024), (16, 8)])  # partial chunks and column strips
def test_dgelu_colsum_amax_matches_the_reference(be, dtype, N, H):
    """k_fp8_dgelu_colsum_amax: dact *= gelu'(pre) within one unit of the dtype of the reference's
    (the sigmoid form in float32 against the tanh form in float64; near the derivative's zero,
    within float32's absolute error of it); the column sums (k_colsum_final
    of its partials) the bits of the two-pass column sums (GradPass.add) of the dact it wrote, its
    amax that of k_fp8_amax of that dact (a NaN: NaN); the column sums within rounding of the
    reference's. gelu.cuh's folded form (-DGELU_FMA=1), the one fp8.cu is built with."""
    import cupy as cp
    from andrea.backends.cuda.geometry import colsum_chunks
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    unit = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
    half_subnormal = 2.0 ** -134 if dtype == "bfloat16" else 2.0 ** -25
    rng = np.random.default_rng(N * H)
    p0, d0 = rng.standard_normal((N, H)) * 2, 1e-3 * rng.standard_normal((N, H))
    rpc, chunks = colsum_chunks(N)
    for nan in (False, True):
        if nan:
            p0[N // 2, 1] = np.nan
        pre, d = cp.asarray(p0.astype(dt)), cp.asarray(d0.astype(dt))
        m = cp.full(64, 9, cp.float32)
        part = cp.full(chunks * H, np.nan, cp.float32)
        be.fp8.k_fp8_dgelu_colsum_amax(part, m, d, pre, rpc)
        db = cp.full(H, 0.25, cp.float32)
        be.grads.final(db, part, chunks, H)
        m_sep, db_sep = cp.zeros(64, cp.float32), cp.full(H, 0.25, cp.float32)
        be.fp8.k_fp8_amax(m_sep, d)
        a, b = m_sep.get()[0], m.get()[0]
        if nan:
            assert np.isnan(a) and np.isnan(b)
            continue
        be.grads.add(db_sep, d, N, H)
        assert a == b > 0 and m.get()[1] == 9, "amax, or a write beyond it"
        assert np.array_equal(db_sep.get().view(np.uint32), db.get().view(np.uint32)), "column sums"
        r_d, r_db, r_m = d0.astype(dt).astype(np.float64), np.full(H, 0.25), np.zeros(2, np.float32)
        ref.k_fp8_dgelu_colsum_amax(r_db, r_m, r_d, pre.get().astype(np.float64))
        got = host(d)
        # plus an absolute 2e-6 of the incoming dact (gelu' in float32 sums terms of order 1 that
        # cancel at its zero, x = -0.7524, and float64's tanh form itself cancels below x = -9) and
        # half the dtype's subnormal spacing (float16's products of 1e-3 and a small gelu' land there)
        err = np.abs(got - r_d) - unit * np.abs(r_d) - half_subnormal
        assert np.all(err <= 2e-6 * np.abs(d0.astype(dt).astype(np.float64))), ("dact", float(err.max()))
        assert abs(b - r_m[0]) <= unit * r_m[0]
        assert rel(db.get(), r_db) < 1e-3


@pytest.mark.parametrize("where", [0, 1234567, -1], ids=["first", "middle", "last"])
def test_amax_of_a_large_tensor_either_grid(be, where, monkeypatch):
    """k_fp8_amax and k_fp8_gelu_amax over 4.6M values (enough that each thread of the default
    grid, Tuning.fp8_amax_blocks blocks an SM, takes its vectors four at a time, with a remainder)
    with the largest value first, in the middle or last: the amax of the reference, the same with
    the old grid (fp8_amax_blocks = 0), and NaN with a NaN there."""
    import cupy as cp
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((2304, 2000)).astype(np.float32)
    x0.reshape(-1)[where] = 300.0
    for nan in (False, True):
        if nan:
            x0.reshape(-1)[where] = np.nan
        x = cp.asarray(x0.astype(bf16()))
        got = {}
        for grid in (4, 0):
            use_tuning(monkeypatch, be, fp8_amax_blocks=grid)
            for kernel in ("k_fp8_amax", "k_fp8_gelu_amax"):
                m = cp.full(64, 5, cp.float32)
                getattr(be.fp8, kernel)(m, x)
                got[grid, kernel] = m.get()[0]
        want = np.zeros(2, np.float32)
        ref.k_fp8_amax(want, x.get().astype(np.float32))
        g_want = np.zeros(2, np.float32)
        ref.k_fp8_gelu_amax(g_want, x.get().astype(np.float32))
        for (grid, kernel), v in got.items():
            if nan:
                assert np.isnan(v), (grid, kernel)
            elif kernel == "k_fp8_amax":
                assert v == want[0] == 300.0, (grid, v)
            else:  # gelu(300) = 300: the same amax, through the GPU's float32 GELU
                assert v == got[0, kernel] and abs(v - g_want[0]) <= 2 ** -8 * g_want[0], (grid, v, g_want[0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gelu_amax_same_bits_either_grid(be, dtype, monkeypatch):
    """k_fp8_gelu_amax (the maximum of max(pre, 0), one GELU a thread, the GELU of every value only
    where a thread's values are all small) gives the same bits with either grid: on mixed scales
    and signs, on all-negative pre and pre below 0.25 (every thread takes the full pass), with the
    largest value in one place, with zeros, with -3e4 (bfloat16: -1e36) among them (where the
    GPU's capped exponential makes |gelu| large in bfloat16), and with a NaN (NaN) or -inf
    (infinite: gelu8(-inf) is -inf); and, but for the last three, within one unit of the dtype of
    the reference. gelu.cuh's folded form (-DGELU_FMA=1), the one fp8.cu is built with."""
    import cupy as cp
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(11)
    shape = (1000, 2056)
    cases = {
        "mixed": rng.standard_normal(shape) * np.exp2(rng.integers(-6, 5, shape)),
        "negative": -np.abs(rng.standard_normal(shape)) * 3,
        "small": rng.uniform(-3, 0.25, shape),
        "one-peak": np.concatenate([-np.abs(rng.standard_normal(shape[0] * shape[1] - 1)), [7.5]]).reshape(shape),
        "zeros": np.zeros(shape),
        "nan": rng.standard_normal(shape),
        "-inf": rng.standard_normal(shape),
    }
    cases["huge"] = rng.standard_normal(shape)
    cases["huge"][3, 4] = -3e4 if dtype == "float16" else -1e36
    cases["nan"][517, 1031] = np.nan
    cases["-inf"][999, 2055] = -np.inf
    for name, x0 in cases.items():
        x = cp.asarray(x0.astype(dt))
        got = {}
        for grid in (4, 0):
            use_tuning(monkeypatch, be, fp8_amax_blocks=grid)
            m = cp.full(64, 5, cp.float32)
            be.fp8.k_fp8_gelu_amax(m, x)
            got[grid] = m.get()[:1].view(np.uint32)[0]
        assert len(set(got.values())) == 1, (name, {k: hex(v) for k, v in got.items()})
        a = np.uint32(got[4]).view(np.float32)
        want = np.zeros(2, np.float32)
        ref.k_fp8_gelu_amax(want, x.get().astype(np.float32))
        if name == "nan":
            assert np.isnan(a) and np.isnan(want[0]), name
        elif name == "-inf":
            assert np.isinf(a) and np.isnan(want[0]), name
        elif name != "huge":
            unit = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
            assert abs(a - want[0]) <= unit * want[0], (name, a, want[0])


def test_gelu_kernels_refuse_what_they_cannot_take(be):
    import cupy as cp
    m = cp.zeros(64, cp.float32)
    with pytest.raises(ValueError, match="k_fp8_gelu_cast_transpose: x has shape"):
        be.fp8.k_fp8_gelu_cast_transpose(None, cp.zeros(24 * 24, cp.uint8), m, cp.zeros((24, 24), bf16()), "e4m3")
    with pytest.raises(ValueError, match="k_fp8_dgelu_colsum_amax: partial"):
        be.fp8.k_fp8_dgelu_colsum_amax(cp.zeros(3, cp.float32), m, cp.zeros((16, 16), bf16()),
                                       cp.zeros((16, 16), bf16()), 1)
    with pytest.raises(ValueError, match="k_fp8_dgelu_colsum_amax: pre"):
        be.fp8.k_fp8_dgelu_colsum_amax(cp.zeros(16 * 16, cp.float32), m, cp.zeros((16, 16), bf16()),
                                       cp.zeros((16, 8), bf16()), 1)


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


def test_engine_fp8_uses_fp8_and_two_runs_same_bits(tmp_path):
    from andrea.core.engine import Engine
    runs = []
    for _ in range(2):
        eng = Engine(cfg_for(tmp_path, batch_size=4, seq_len=32, precision="fp8"))
        assert eng.be.fp8 is not None and str(eng.params_c.dtype) == "bfloat16"
        assert {"fp8_x", "fp8_dy", "fp8_dyt", "fp8_w", "fp8_meta"} <= {r[0] for r in eng.be.workspace_rows(
            4, 32, 48, 3, eng.params_c.dtype, fp8=True)}
        losses = [eng.train_step(s, [batch(s)])["loss"] for s in range(1, 8)]
        runs.append((losses, eng.host_state()))
    assert all(np.isfinite(runs[0][0])), runs[0][0]
    assert runs[0][0] == runs[1][0], "losses differ between two identical fp8 runs"
    for a, b in zip(runs[0][1], runs[1][1]):
        assert np.array_equal(a, b), "weights or Adam state differ between two identical fp8 runs"
    bf = Engine(cfg_for(tmp_path, batch_size=4, seq_len=32, precision="bf16"))
    l_bf = [bf.train_step(s, [batch(s)])["loss"] for s in range(1, 8)]
    assert l_bf != runs[0][0], "fp8 gave the bf16 losses: the FP8 products did not run"
    assert max(abs(a - b) for a, b in zip(l_bf, runs[0][0])) < 0.05 * l_bf[0]


def test_fp8_refuses_sizes_it_cannot_run(tmp_path):
    from andrea.core.engine import Engine
    with pytest.raises(ValueError, match="multiple of 16"):
        Engine(cfg_for(tmp_path, batch_size=3, seq_len=37, precision="fp8"))


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


def test_weight_cache_same_bits_as_per_product_casts(tmp_path):
    """Steps of two microbatches with the FP8 weight cache, a skipped (non-finite) step among them,
    and a resume from a state: the copies match what each product's own quantisation makes of the
    weights (check_cache) after start-up, after updates, after the skipped step and after
    load_state; a step's products quantise no weight themselves and the optimizer's graph rewrites
    every copy with one k_fp8_cast_transpose_many, the amax taken by the update
    (k_adamw_step_amax). (The MLP's act and dact take their amax in k_fp8_gelu_amax and
    k_fp8_dgelu_colsum_amax, so 9 k_fp8_amax passes a layer remain with the cache and without the
    input slots: 3 inputs, 3 output gradients, the 3 inputs again.)"""
    from andrea.backends.cuda import CudaBackend
    n_layer, n_micro = MODEL["n_layer"], 2
    mid = None
    eng = fp8_engine(tmp_path)
    check_cache(eng, "start-up")
    recs, log = [], None
    for s in range(1, 8):
        if s == 1:
            log = launches(eng.be)
        if s == 5:  # a non-finite loss gradient: the step is skipped, the weights stay
            eng.loss_scale = float("inf")
        rec = dict(eng.train_step(s, [batch(2 * s), batch(2 * s + 1)]))
        if s == 1:
            eng.be.synchronize()
            counts = {k: log.count(k) for k in ("k_fp8_amax", "k_fp8_amax_many", "k_fp8_cast_transpose_many")}
            del eng.be.rt.launch  # the recording off again
        if s == 5:
            eng.loss_scale = 1.0
            check_cache(eng, "skipped step")
        if s == 3:
            mid = eng.state()
        recs.append(rec)
    check_cache(eng, "after 7 steps")
    on = recs, counts, eng.host_state()
    assert [r["skipped"] for r in on[0]] == [False] * 4 + [True] + [False] * 2, on[0]
    assert all(np.isfinite(r["loss"]) for r in on[0] if not r["skipped"])
    # the input slots take 3 (X^T kept) and, under current scaling, 2 (amax in the layer norms)
    # more amax passes a layer away (test_input_slots_in_the_engine)
    # (with delayed scaling ln1 and ln2 are delayed tensors: their layer norms reduce no amax, and
    # step 1 takes it first with k_fp8_amax, as for every delayed tensor)
    slots = 3 + 2 * (CudaBackend.fp8_scaling != "delayed")
    # the optimizer takes the cached weights' amax in its update (k_adamw_step_amax): no
    # k_fp8_amax_many before the cast
    assert on[1] == {"k_fp8_amax": (9 - slots) * n_layer * n_micro, "k_fp8_amax_many": 0,
                     "k_fp8_cast_transpose_many": 1}
    # resume: a fresh engine (its copies made from its own initial weights) loads the state after
    # step 3 and runs steps 4..7: the same bits as the straight run
    check_resume(fp8_engine(tmp_path, seed=99), mid, on, check_cache)


@pytest.mark.parametrize("skip", [False, True])
def test_adamw_step_amax_is_the_update_then_its_amax(skip):
    """k_adamw_step_amax on weights laid in a flat compute copy with gaps between them (8 to 40
    elements), one of them (512 x 1024) across many blocks, one holding a NaN, the decay boundary
    inside a weight: the update's bits those of k_adamw_step, each weight's amax that of
    ref.k_adamw_step_amax (the reference update, then k_fp8_amax of each weight) before the
    refresh, and the refresh after it the same copies and (amax, 1/scale) as the refresh that
    takes its own amax passes (after the plain update: the weight cache's adamw_amax_fits stood in
    for by False). A skipped step still takes the amax. A buffer of n % 4 == 2 elements, the
    weights given to the cache out of address order, or m one element off 16-byte alignment: the
    plain update and the amax passes run."""
    import cupy as cp
    from andrea.backends import get_backend
    from andrea.backends.cuda.fp8 import META_STRIDE, weight_cache_rows
    shapes, gaps = [(48, 80), (16, 32), (512, 1024), (32, 16), (64, 48)], [8, 24, 40, 0, 16, 8]
    offs, n = [], gaps[0]
    for (R, K), gap in zip(shapes, gaps[1:]):
        offs.append(n)
        n += R * K + gap
    n_decay = offs[2] + 1001
    rng = np.random.default_rng(7 + skip)
    assert n % 4 == 0
    n2 = n + 2  # the buffers, of which the last 2 elements only for the case that does not fit
    p = rng.normal(0, 0.05, n2).astype(np.float32)
    p[offs[3] + 17] = np.nan
    g, m = rng.normal(0, 0.01, n2).astype(np.float32), rng.normal(0, 1e-3, n2).astype(np.float32)
    v = np.abs(rng.normal(0, 1e-5, n2)).astype(np.float32)
    st = np.zeros(ref.STATE_LEN)
    st[ref.S_SKIP] = float(skip)
    st[ref.S_CLIP], st[ref.S_DECAY] = np.float32(0.37), np.float32(1 - 3e-3 * 0.1)
    st[ref.S_STEP_SIZE], st[ref.S_VHAT] = np.float32(3e-3 / (1 - 0.9 ** 7)), np.float32(1 / (1 - 0.95 ** 7))
    pc0 = (p + np.float32(1e-3)).astype(bf16())  # what the last update wrote: not the weights' own cast

    def run(on, size, order=(0, 1, 2, 3, 4), m_off=0):
        be = get_backend("cuda")
        be.reserve_workspace(4, 48, 80, 5, bf16(), fp8=True)
        bufs = [cp.asarray(x[:size]) for x in (p, g)]
        bufs.append(cp.asarray(np.concatenate([np.zeros(m_off, np.float32), m[:size]]))[m_off:])
        bufs.append(cp.asarray(v[:size]))
        pc = cp.asarray(pc0[:size])
        ws = [pc[offs[i]:offs[i] + R * K].reshape(R, K) for i, (R, K) in enumerate(shapes)]
        rows = {name: cp.zeros(shape, dt) for name, shape, dt in weight_cache_rows([shapes[i] for i in order])}
        be.fp8.use_weight_cache([ws[i] for i in order], rows["fp8_wcache"], rows["fp8_wmeta"], rows["fp8_wtable"])
        fits = be.fp8.cache.adamw_amax_fits(pc, bufs)
        if not on:  # the plain update and the refresh's own amax passes
            be.fp8.cache.adamw_amax_fits = lambda params_c, floats: False
        be.k_adamw_step(bufs[0], pc, bufs[1], bufs[2], bufs[3], cp.asarray(st), 0.9, 0.95, 1e-8, n_decay,
                        zero_grads=False)
        taken = be.fp8.cache.amax_taken
        amax = rows["fp8_wmeta"].reshape(-1, META_STRIDE)[:, 0].get()
        be.fp8.refresh_weight_cache()
        out = [x.get().view(np.uint32) for x in bufs] + [pc.get().view(np.uint16)]
        return fits, taken, amax, out + [rows["fp8_wcache"].get(), rows["fp8_wmeta"].get().view(np.uint32)]

    fits0, taken0, _, want = run(False, n)
    assert fits0 and not taken0
    fits, taken, amax, got = run(True, n)
    assert fits and taken, "k_adamw_step_amax did not run"
    for name, a, b in zip(("params", "grads", "m", "v", "params_c", "cache", "cache meta"), got, want):
        assert np.array_equal(a, b), f"{name} differ with the amax in the update and in its own pass"
    hp, hc, hm, hv = p[:n].copy(), pc0[:n].copy(), m[:n].copy(), v[:n].copy()
    meta = np.zeros((len(shapes), 2), np.float32)
    segs = [(o, o + R * K) for o, (R, K) in zip(offs, shapes)]
    ref.k_adamw_step_amax(hp, hc, g[:n].copy(), hm, hv, st, 0.9, 0.95, 1e-8, n_decay, segs, meta, zero_grads=False)
    np.testing.assert_array_equal(amax, meta[:, 0])
    assert np.isnan(amax[3]) and np.all(np.delete(amax, 3) > 0)
    # the reference's update, the same values (NaN's bits aside: ml_dtypes and the kernel write
    # different NaNs)
    np.testing.assert_array_equal(got[4].view(bf16()).astype(np.float32), hc.astype(np.float32))
    for size, order, m_off in ((n2, (0, 1, 2, 3, 4), 0), (n, (0, 2, 1, 3, 4), 0), (n, (0, 1, 2, 3, 4), 1)):
        fits, taken, _, out = run(True, size, order, m_off)
        assert not fits and not taken
        if m_off:  # the plain update on the misaligned m: the same bits
            for name, a, b in zip(("params", "grads", "m", "v", "params_c"), out, want):
                assert np.array_equal(a, b), f"{name} differ with m misaligned"


def test_weight_cache_plan_and_views(tmp_path):
    """The engine's memory plan holds the cache (fp8 weight cache rows); the products read the
    arena's copies, not the workspace's weight slot."""
    from andrea.core.plan import fp8_cached_weights
    on = fp8_engine(tmp_path)
    assert "fp8 weight cache" in on.plan.by_group()
    data = on.bufs["fp8_wcache"]
    lo, hi = data.data.ptr, data.data.ptr + data.nbytes
    for name in fp8_cached_weights(on.cfg.model):
        q, q_t, row = on.be.fp8.cached(on.p[name])
        for a in (q, q_t):
            assert lo <= a.data.ptr and a.data.ptr + a.nbytes <= hi and a.data.ptr % 256 == 0, name


# ---------------------------------------------------------------- amax in the layer norms, X^T kept
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("C", [80, 37], ids=["vec", "rowwise"])  # 37: no whole 16-byte rows, version 1
@pytest.mark.parametrize("residual", [False, True], ids=["layernorm", "residual_layernorm"])
def test_layernorm_amax_is_k_fp8_amax_of_its_output(be, dtype, C, residual):
    """The layer norms' amax (53 rows: a partial block; a NaN) equal to k_fp8_amax of the output
    they wrote (padded with zeros to a multiple of 16 values, which k_fp8_amax's launcher wants),
    and to the reference's; the outputs' bits the same as without it."""
    import cupy as cp
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(C)
    N = 53
    a0, b0 = rng.normal(0, 2, (N, C)) * np.exp2(rng.integers(-3, 4, (N, C))), rng.normal(0, 1, (N, C))
    w, bias = cp.asarray(rng.normal(1, 0.5, C).astype(dt)), cp.asarray(rng.normal(0, 0.1, C).astype(dt))
    for nan in (False, True):
        if nan:
            a0[N - 1, 5] = np.nan  # the last row, in the partial block
        a, b = cp.asarray(a0.astype(dt)), cp.asarray(b0.astype(dt))
        outs = []
        for amax in (None, cp.full(2, -7, cp.float32)):
            out, res = cp.full((N, C), 3, dt), cp.full((N, C), 3, dt)
            mean, rstd = cp.zeros(N, cp.float32), cp.zeros(N, cp.float32)
            if residual:
                be.k_residual_layernorm_fwd(res, out, mean, rstd, a, b, w, bias, amax=amax)
            else:
                be.k_layernorm_fwd(out, mean, rstd, a, w, bias, amax=amax)
            outs.append((out.get(), res.get(), amax))
        assert outs[0][0].tobytes() == outs[1][0].tobytes() and outs[0][1].tobytes() == outs[1][1].tobytes()
        got = outs[1][2].get()
        assert got[1] == -7, "the kernel wrote beyond amax[0]"
        flat = np.zeros(-(-N * C // 16) * 16, dt)
        flat[:N * C] = outs[1][0].reshape(-1)
        pair = cp.zeros(2, cp.float32)
        be.fp8.k_fp8_amax(pair, cp.asarray(flat))
        want = np.zeros(2, np.float32)
        ref.k_fp8_amax(want, outs[1][0].astype(np.float32))
        if nan:
            assert np.isnan(got[0]) and np.isnan(pair.get()[0]) and np.isnan(want[0])
        else:
            assert got[0] == pair.get()[0] == want[0] > 0, (got[0], pair.get()[0], want[0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("rows,warps", [(8, 8), (32, 8), (32, 16), (16, 4)])
@pytest.mark.parametrize("N,C", [(48, 80), (16, 768), (208, 144)])  # partial tiles of 32 rows
@pytest.mark.parametrize("residual", [False, True], ids=["layernorm", "residual_layernorm"])
def test_layernorm_fwd_fp8_is_the_layer_norm_then_its_cast(be, dtype, N, C, residual, rows, warps, monkeypatch):
    """k_layernorm_fwd_fp8: res, mean and rstd bit for bit those of k_residual_layernorm_fwd /
    k_layernorm_fwd (the vector kernel), and its FP8 bytes, transpose, 1/scale and amax (reduced
    into a smaller value already there) those of k_fp8_cast_transpose_amax of that kernel's output
    with the same meta; a scale from a quarter of the amax (a delayed one) saturates, as the cast
    does; a NaN makes the amax NaN. The bytes also within one FP8 step of the reference's."""
    import cupy as cp
    use_tuning(monkeypatch, be, fp8_layernorm_rows=rows, fp8_layernorm_warps=warps)
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(N + C)
    a0 = rng.normal(0, 2, (N, C)) * np.exp2(rng.integers(-3, 4, (N, C)))
    b0 = rng.normal(0, 1, (N, C))
    w, bias = cp.asarray(rng.normal(1, 0.5, C).astype(dt)), cp.asarray(rng.normal(0, 0.1, C).astype(dt))
    for case in ("plain", "saturate", "nan"):
        if case == "nan":
            a0[N - 1, 5] = np.nan
        a, b = cp.asarray(a0.astype(dt)), cp.asarray(b0.astype(dt)) if residual else None
        out, res = cp.full((N, C), 3, dt), cp.full((N, C), 3, dt)
        mean, rstd = cp.zeros(N, cp.float32), cp.zeros(N, cp.float32)
        if residual:
            be.k_residual_layernorm_fwd(res, out, mean, rstd, a, b, w, bias)
        else:
            be.k_layernorm_fwd(out, mean, rstd, a, w, bias)
        meta, want, want_rec, inv, top = cast_reference(be, out, "e4m3", case == "saturate")
        got = [cp.full((N, C), 0xAA, cp.uint8), cp.full((C, N), 0xAA, cp.uint8)]
        g_res, g_mean, g_rstd = cp.full((N, C), 5, dt), cp.full(N, 5, cp.float32), cp.full(N, 5, cp.float32)
        rec = cp.asarray(np.array([1e-3], np.float32))
        be.k_layernorm_fwd_fp8(*got, g_res if residual else None, g_mean, g_rstd, a, b, w, bias, meta, rec)
        for g, x in zip(got, want):
            np.testing.assert_array_equal(g.get(), x.get(), err_msg=case)
        assert meta.get()[1].tobytes() == np.float32(inv).tobytes(), case
        assert rec.get()[0].tobytes() == want_rec.get()[0].tobytes(), case
        for g, x in ((g_mean, mean), (g_rstd, rstd)) + (((g_res, res),) if residual else ()):
            assert g.get().tobytes() == x.get().tobytes(), case
        if case == "nan":
            assert np.isnan(rec.get()[0])
            continue
        assert rec.get()[0] == top > 1e-3
        if case == "saturate":
            assert (ref.fp8_decode(got[0].get(), "e4m3") == 448).any(), "nothing saturated"
        # the reference normalises res as the kernel rounded it to the dtype (a float32 sum of a and
        # b moves values near zero by many FP8 codes: the subnormals are dense there)
        o, ot = np.zeros((N, C), np.uint8), np.zeros((C, N), np.uint8)
        r_meta, r_rec = meta.get().copy(), np.zeros(1, np.float32)
        ref.k_layernorm_fwd_fp8(o, ot, None, np.zeros(N, np.float32), np.zeros(N, np.float32),
                                (g_res if residual else a).get().astype(np.float32), None,
                                w.get().astype(np.float32), bias.get().astype(np.float32), r_meta, r_rec)
        np.testing.assert_array_equal(ot.T, o)
        assert fp8_steps_apart(got[0].get(), o).max() <= 1 and r_meta[1] == inv
        np.testing.assert_allclose(r_rec[0], top, rtol=2 ** -7)


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


def test_layernorm_fwd_fp8_refuses_what_it_cannot_take(be):
    """Rows that are no whole 16-byte vectors, wider than the vector kernels hold, or a row count
    that is not a multiple of 8: a ValueError naming the kernel and what it expected."""
    import cupy as cp
    for N, C in ((8, 34), (8, 1032), (12, 80)):
        a = cp.zeros((N, C), cp.float32)
        w = cp.zeros(C, cp.float32)
        with pytest.raises(ValueError, match="k_layernorm_fwd_fp8: rows of"):
            be.k_layernorm_fwd_fp8(cp.zeros((N, C), cp.uint8), cp.zeros((C, N), cp.uint8), None,
                                   cp.zeros(N, cp.float32), cp.zeros(N, cp.float32), a, None, w, w,
                                   cp.zeros(2, cp.float32), None)


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


def test_input_slots_in_the_engine(tmp_path):
    """Steps of two microbatches (current scaling), a skipped step among them and a resume from a
    state: the slots hold what the per-product quantisation makes of each saved input, the
    backward quantises no kept input again and the products of ln1 and ln2 run no k_fp8_amax: per
    layer and microbatch 4 k_fp8_amax passes (of the 9 without slots: 3 inputs in the forward, 3
    output gradients and the 3 inputs again in the backward; act's and dact's amax come from
    k_fp8_gelu_amax and k_fp8_dgelu_colsum_amax); no k_fp8_cast (the forward's casts transpose
    too), and no second k_fp8_gelu_amax and k_fp8_gelu_cast_transpose in the backward (fp8(act)^T
    kept)."""
    n_layer, n_micro = MODEL["n_layer"], 2
    mid = None
    eng = slot_engine(tmp_path)
    recs, counts = [], None
    for s in range(1, 8):
        if s == 1:
            log = launches(eng.be)
        if s == 5:
            eng.loss_scale = float("inf")
        recs.append(dict(eng.train_step(s, [batch(2 * s), batch(2 * s + 1)])))
        if s == 1:
            eng.be.synchronize()
            counts = {k: log.count(k) for k in ("k_fp8_amax", "k_fp8_cast", "k_fp8_cast_transpose",
                                                "k_fp8_cast_transpose_colsum", "k_fp8_gelu_amax",
                                                "k_fp8_gelu_cast_transpose", "k_fp8_dgelu_colsum_amax",
                                                "k_mlp_bwd_gelu")}
            del eng.be.rt.launch
            check_slots(eng, "step 1")
        if s == 5:
            eng.loss_scale = 1.0
        if s == 3:
            mid = eng.state()
    base = recs, counts, eng.host_state()
    assert [r["skipped"] for r in base[0]] == [False] * 4 + [True] + [False] * 2, base[0]
    assert all(np.isfinite(r["loss"]) for r in base[0] if not r["skipped"])
    per = n_layer * n_micro
    # cast_transpose: dact, and 3 kept X^T in the forward; the 3 dY of the layers with a bias (QKV,
    # the projection, the MLP's second) cast with their column sums; act's are
    # k_fp8_gelu_cast_transpose's, once a layer
    n_amax, n_cast, n_ct = 4, 0, 4
    n_gelu = 1
    assert counts == {"k_fp8_amax": n_amax * per, "k_fp8_cast": n_cast * per,
                      "k_fp8_cast_transpose": n_ct * per, "k_fp8_cast_transpose_colsum": 3 * per,
                      "k_fp8_gelu_amax": n_gelu * per,
                      "k_fp8_gelu_cast_transpose": n_gelu * per, "k_fp8_dgelu_colsum_amax": per,
                      "k_mlp_bwd_gelu": 0}, counts
    eng = slot_engine(tmp_path, seed=99)
    check_resume(eng, mid, base)
    eng.val_loss([batch(40)])  # a forward pass outside the step's graphs: the slots follow it
    check_slots(eng, "after val_loss")


def test_input_slots_plan_and_views(tmp_path):
    """The plan's input-slot rows are the arena's, each kept X^T a 256-byte aligned (IC, B*T)
    view inside fp8_xt (IC = C, and 4C for act). The layer-norm launchers find a slot by the
    input they write (ln1, ln2; the attention output's is never asked for); act, the workspace
    every layer's slot names, is found by none."""
    from andrea.core.plan import fp8_input_slots
    both = slot_engine(tmp_path)
    assert "fp8_xt" in both.bufs and "fp8_xmeta" in both.bufs
    data = both.bufs["fp8_xt"]
    lo, hi = data.data.ptr, data.data.ptr + data.nbytes
    for w, l, x in fp8_input_slots(both.cfg.model):
        slot = both.be.fp8.slots[both.p[w].data.ptr]
        IC = 4 * 48 if x == "act" else 48
        assert slot.xt.shape == (IC, 4 * 32) and lo <= slot.xt.data.ptr < hi and slot.xt.data.ptr % 256 == 0, w
        want = None if x == "act" else slot
        assert both.be.fp8.slot_of_input.get(both.slot_input(l, x).data.ptr) is want, w


# ---------------------------------------------------------------- the classifier in FP8
@pytest.mark.parametrize("R,K", [(16, 16), (48, 80), (112, 208), (400, 96), (64, 4112)])  # partial tiles
def test_fp8_transpose_is_the_transpose(be, R, K):
    import cupy as cp
    x = cp.asarray(np.random.default_rng(R * K).integers(0, 256, (R, K), dtype=np.uint8))
    out = cp.zeros((K, R), cp.uint8)
    be.fp8.k_fp8_transpose(out, x)
    want = np.zeros((K, R), np.uint8)
    ref.k_fp8_transpose(want, x.get())
    np.testing.assert_array_equal(out.get(), want)
    with pytest.raises(ValueError, match="multiples of 16"):
        be.fp8.k_fp8_transpose(cp.zeros((K, R - 8), cp.uint8), x[:R - 8])


def fp8_neighbours_at_midpoint(got, want, exact, fmt):
    """Where bytes differ: adjacent codes of one sign with the exact value within 1e-5 (relative)
    of the midpoint between them (the GPU's ex2.approx and float32 against float64)."""
    g, w = ref.fp8_decode(got, fmt).astype(np.float64), ref.fp8_decode(want, fmt).astype(np.float64)
    step = np.abs(got.astype(np.int64) - want.astype(np.int64))
    mid = (g + w) / 2
    return bool(np.all((step == 1) & (np.abs(exact - mid) <= 1e-5 * np.abs(mid))))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("version", ["regs", "v1"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("V", [96, 1008, 99])
def test_dlogits_row_pass_matches_the_reference(be, fmt, V, version, rounding, monkeypatch):
    """loss_bwd_fp8(_regs): losses and lse bit-equal to the 16-bit row pass (loss_bwd(_regs)) on
    the same logits, the logits left as they were, *q8_inv = dloss / 2^k, and the FP8 dlogits
    ref.loss_bwd_fp8's bytes (rounded to nearest, or stochastically with its random bits for
    rows from row0 = 5) but for values at a rounding midpoint, or at the random threshold (fewer than
    1 in 1000, and then the neighbouring byte). V = 99: rows of no whole vectors, byte by byte."""
    import cupy as cp
    from andrea.backends.cuda.fp8.quant import Quant
    from andrea.backends.cuda.ops.loss import dloss_args
    if version == "v1":
        use_tuning(monkeypatch, be, loss_vectors=0)
    n = 48
    rng = np.random.default_rng(V)
    z = on_dev(rng.normal(0, 4, (n, V)))
    t = cp.asarray(rng.integers(0, V, n).astype(np.int32))
    dloss = cp.asarray(np.array([1.0 / 384], np.float32))
    ct = z.dtype
    q8, meta = cp.zeros((n, V), cp.uint8), cp.zeros(2, cp.float32)
    lf, lse = cp.zeros(n, cp.float32), cp.zeros(n, cp.float32)
    z0 = z.copy()
    be._loss_rows(True, n, z, ct, (lf, lse, z, t, np.int64(n), np.int32(V)) + dloss_args("t", dloss)
                  + (q8, meta[1:], np.int64(5)), fp8_defs=Quant.fmt_defs(fmt) + (f"-DFP8_SR={int(rounding == 'stochastic')}",))
    assert np.array_equal(z.get().view(np.uint16), z0.get().view(np.uint16)), "the logits were changed"
    lf16, lse16, z16 = cp.zeros(n, cp.float32), cp.zeros(n, cp.float32), z0.copy()
    be._loss_rows(True, n, z16, ct, (lf16, lse16, z16, t, np.int64(n), np.int32(V)) + dloss_args("t", dloss))
    assert np.array_equal(lf.get(), lf16.get()) and np.array_equal(lse.get(), lse16.get())
    k = {"e4m3": 8, "e5m2": 15}[fmt]
    assert meta.get()[1] == np.float32(1.0 / 384 * 2.0 ** -k)
    want, m_ref = np.zeros((n, V), np.uint8), np.zeros(2, np.float32)
    zh = host(z0)
    ref.loss_bwd_fp8(np.zeros(n), np.zeros(n), want, m_ref, z0.get(), t.get(), dloss.get(), fmt, rounding, row0=5)
    got = q8.get()
    bad = got != want
    assert bad.mean() < 1e-3, f"{bad.sum()} of {bad.size} bytes differ"
    g = np.exp(zh - lse.get().astype(np.float64)[:, None])
    g[np.arange(n), t.get()] -= 1.0
    if rounding == "nearest":
        assert fp8_neighbours_at_midpoint(got[bad], want[bad], (g * 2.0 ** k)[bad], fmt)
    else:  # the same sign and the next code: the two values around it, the threshold between
        assert np.all(np.abs(got[bad].astype(np.int64) - want[bad].astype(np.int64)) == 1)
        near = np.zeros((n, V), np.uint8)  # and the bits were used: not the bytes of nearest
        ref.loss_bwd_fp8(np.zeros(n), np.zeros(n), near, m_ref, z0.get(), t.get(), dloss.get(), fmt, "nearest")
        assert (near != got).mean() > 0.05


# Stochastic rounding is compared with the reference at level 1 only: its random bits are keyed by
# the logits' bits, and at level 2 the GPU's FP8 logits (cuBLASLt's fast accumulation) and the
# reference's (a float64 product rounded to bf16) differ in some last bits, so the two draw
# different bits there and differ by two roundings' noise. Level 2's logits are checked with
# rounding to nearest, stochastic rounding's bytes by test_dlogits_row_pass_matches_the_reference.
@pytest.mark.parametrize("level,rounding", [(1, "nearest"), (2, "nearest"), (1, "stochastic")],
                         ids=["backward", "all", "backward-sr"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "write"])
def test_fp8_classifier_matches_the_reference(be, fmt, accumulate, level, rounding, monkeypatch):
    """k_loss_bwd / k_loss_fwd with the FP8 classifier (V a multiple of 16; the backend's
    fp8_classifier 1: the backward's products in FP8, 2: the logits too) against
    ref.k_fp8_loss_bwd / k_fp8_loss_fwd (bf16 logits, as the GPU's) within TOL, in chunks of
    48 rows; against the float64 classifier without quantisation within 0.1 and not equal to it.
    k_loss_fwd gives the losses and lse of k_loss_bwd, bit for bit (its logits in FP8 at level 2,
    in bf16 at level 1)."""
    import cupy as cp
    monkeypatch.setattr(be, "fp8_dlogits", fmt)
    monkeypatch.setattr(be, "fp8_classifier", level)
    monkeypatch.setattr(be, "fp8_dlogits_rounding", rounding)
    B, T, C, V, R = 4, 48, 80, 96, 48
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (B, T, C))
    w = rng.normal(0, 0.3, (V, C))
    t = rng.integers(0, V, (B, T)).astype(np.int32)
    base = rng.normal(0, 0.01, (B, T, C))
    dloss = 1.0 / (B * T)
    xd, wd, td = on_dev(x), on_dev(w), cp.asarray(t)
    xh, wh = host(xd), host(wd)
    lf, lse, dx, dw = cp.zeros((B, T), cp.float32), cp.zeros((B, T), cp.float32), on_dev(base), cp.zeros((V, C), cp.float32)
    be.k_loss_bwd(lf, lse, dx, dw, cp.zeros((R, V), xd.dtype), xd, wd, td, dloss, accumulate=accumulate)
    want = [np.zeros((B, T)), np.zeros((B, T)), host(on_dev(base)), np.zeros((V, C))]
    ref.k_fp8_loss_bwd(*want[:2], want[2], want[3], np.zeros((R, V), bf16()), xh, wh, t, dloss, fmt, accumulate,
                       fp8_logits=level == 2, rounding=rounding)
    for what, a, b in zip(("losses", "lse", "dinp", "dwte"), (lf, lse, dx, dw), want):
        assert rel(host(a), b) < TOL, what
    exact = [np.zeros((B, T)), np.zeros((B, T)), host(on_dev(base)), np.zeros((V, C))]
    ref.k_loss_bwd(exact[0], exact[1], exact[2], exact[3], np.zeros((R, V)), xh, wh, t, dloss, accumulate)
    for a, b in zip((dx, dw), exact[2:]):
        assert 1e-4 < rel(host(a), b) < 0.1
    lf2, lse2 = cp.zeros((B, T), cp.float32), cp.zeros((B, T), cp.float32)
    be.k_loss_fwd(lf2, lse2, cp.zeros((R, V), xd.dtype), xd, wd, td)
    assert np.array_equal(lf2.get(), lf.get()) and np.array_equal(lse2.get(), lse.get())


def test_engine_fp8_classifier_same_bits_and_resume(tmp_path):
    """An fp8 engine whose vocabulary is a multiple of 16 runs the classifier in FP8 (wte in the
    weight cache, refreshed on its own): two runs bit-identical, a resume from the state after step
    3 bit-exact with the copies matching the weights, and close to (not equal to) the classifier in
    bf16 (the backend's fp8_classifier 0)."""
    from andrea.backends import get_backend
    from andrea.core.engine import Engine
    from andrea.core.plan import fp8_cached_weights
    model = dict(MODEL, vocab_size=96)

    def make(classifier=True, seed=None):
        from andrea.config import load_run_config
        d = small_config(tmp_path, batch_size=4, seq_len=32, precision="fp8", **({"seed": seed} if seed else {}))
        d["model"], d["backend"] = model, {"name": "cuda"}
        be = get_backend("cuda")
        be.fp8_classifier = 2 if classifier else 0  # level 2 (the logits too), dlogits rounded stochastically
        eng = Engine(load_run_config(d), backend=be)
        assert eng.fp8_classifier is classifier
        return eng

    def run(eng, steps=range(1, 8), mid=None):
        recs = []
        for s in steps:
            recs.append(dict(eng.train_step(s, [batch(2 * s, V=96), batch(2 * s + 1, V=96)])))
            if s == 3 and mid is not None:
                mid.append(eng.state())
        return recs, eng.host_state()

    mid = []
    a = run(make(), mid=mid)
    b = run(make())
    assert all(np.isfinite(r["loss"]) for r in a[0])
    assert repr(a[0]) == repr(b[0]), "two fp8 runs with the FP8 classifier differ"
    eng = make(seed=99)
    assert fp8_cached_weights(eng.cfg.model, eng.fp8_classifier)[0] == "wte"
    eng.load_state(mid[0])
    check_cache(eng, "load_state")
    c = run(eng, range(4, 8))
    assert repr(c[0]) == repr(a[0][3:]), "resumed run differs"
    for x, y in zip(c[1], a[1]):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), "resumed run's state differs"
    check_cache(eng, "after the resumed steps")
    off = run(make(classifier=False))
    la, lo = [r["loss"] for r in a[0]], [r["loss"] for r in off[0]]
    assert la != lo and max(abs(p - q) for p, q in zip(la, lo)) < 0.05 * lo[0]


# ---------------------------------------------------------------- delayed scaling (act and dact)
@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("R,K", [(48, 80), (112, 208), (400, 96)])  # partial tiles
def test_delayed_kernels_are_the_current_passes(be, R, K, rows, monkeypatch):
    """k_fp8_gelu_cast_transpose_amax: the bytes and 1/scale of k_fp8_gelu_cast_transpose with the
    same meta, and the amax it reduces (into a value already there) that of k_fp8_gelu_amax;
    k_fp8_cast_transpose_amax and k_fp8_cast_transpose_colsum_amax those of their casts without it
    and the amax of k_fp8_amax.
    k_fp8_dgelu_cast_transpose_colsum_amax: the bytes of k_fp8_dgelu_colsum_amax (dact *= gelu'(pre)
    in place, on a copy) followed by k_fp8_cast_transpose with the same meta; its column sums
    ref.fp8_tile_colsum of that dact bit for bit, its amax k_fp8_amax of it; dact not
    written. A scale from a smaller amax (a delayed one) saturates, as the cast does. gelu.cuh's
    folded form (-DGELU_FMA=1), the one fp8.cu is built with."""
    import cupy as cp
    use_tuning(monkeypatch, be, fp8_tile_rows=rows)
    rng = np.random.default_rng(R + K + rows)
    pre = cp.asarray((rng.standard_normal((R, K)) * 2).astype(bf16()))
    dact = cp.asarray((rng.standard_normal((R, K)) * np.exp2(rng.integers(-10, 2, (R, K)))).astype(bf16()))
    n = -(-R // rows)
    for shrink in (1.0, 0.25):  # the current amax, then a quarter of it: values past 448 saturate
        amax = cp.zeros(2, cp.float32)
        be.fp8.k_fp8_gelu_amax(amax, pre)
        meta = cp.asarray(np.array([amax.get()[0] * shrink, 0], np.float32))
        want = [cp.zeros((R, K), cp.uint8), cp.zeros((K, R), cp.uint8)]
        be.fp8.k_fp8_gelu_cast_transpose(*want, meta, pre, "e4m3")
        inv = meta.get()[1]
        got = [cp.full((R, K), 0xAA, cp.uint8), cp.full((K, R), 0xAA, cp.uint8)]
        meta[1] = 0
        rec = cp.asarray(np.array([amax.get()[0] / 3], np.float32))  # a smaller value there already
        be.fp8.k_fp8_gelu_cast_transpose_amax(*got, meta, pre, "e4m3", rec)
        assert meta.get()[1] == inv
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.get(), w.get())
        assert rec.get()[0] == amax.get()[0]
        be.fp8.k_fp8_gelu_cast_transpose_amax(None, got[1], meta, pre, "e4m3", None)  # no amax taken
        np.testing.assert_array_equal(got[1].get(), want[1].get())

        d = dact.copy()
        dm = cp.zeros(2, cp.float32)
        rpc = max(1, -(-R // 64))
        be.fp8.k_fp8_dgelu_colsum_amax(cp.zeros(-(-R // rpc) * K, cp.float32), dm, d, pre, rpc)
        meta = cp.asarray(np.array([dm.get()[0] * shrink, 0], np.float32))
        want = [cp.zeros((R, K), cp.uint8), cp.zeros((K, R), cp.uint8)]
        be.fp8.k_fp8_cast_transpose(*want, meta, d, "e4m3")
        inv = meta.get()[1]
        before = dact.copy()
        got = [cp.full((R, K), 0xAA, cp.uint8), cp.full((K, R), 0xAA, cp.uint8)]
        part, rec = cp.full(n * K, np.nan, cp.float32), cp.zeros(1, cp.float32)
        meta[1] = 0
        be.fp8.k_fp8_dgelu_cast_transpose_colsum_amax(*got, meta, dact, pre, "e4m3", part, rec)
        assert bool((dact == before).all()), "dact was written"
        assert meta.get()[1] == inv
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.get(), w.get())
        np.testing.assert_array_equal(part.get().reshape(n, K).view(np.uint32),
                                      ref.fp8_tile_colsum(d.get().astype(np.float32), rows).view(np.uint32))
        assert rec.get()[0] == dm.get()[0]
        if shrink < 1:
            assert (ref.fp8_decode(got[0].get(), "e4m3") == 448).any(), "nothing saturated"
        d_meta, d_bytes = meta.get(), got[0].get()  # for the reference below
        # the plain casts with an amax: k_fp8_cast_transpose_amax, k_fp8_cast_transpose_colsum_amax
        meta = cp.asarray(np.array([dm.get()[0] * shrink, 0], np.float32))
        want = [cp.zeros((R, K), cp.uint8), cp.zeros((K, R), cp.uint8)]
        be.fp8.k_fp8_cast_transpose(*want, meta, dact, "e5m2")
        xm = cp.zeros(2, cp.float32)
        be.fp8.k_fp8_amax(xm, dact)
        for colsum in (False, True):
            got = [cp.full((R, K), 0xAA, cp.uint8), cp.full((K, R), 0xAA, cp.uint8)]
            rec, part = cp.zeros(1, cp.float32), cp.full(n * K, np.nan, cp.float32)
            if colsum:
                be.fp8.k_fp8_cast_transpose_colsum_amax(*got, meta, dact, "e5m2", part, rec)
                np.testing.assert_array_equal(part.get().reshape(n, K).view(np.uint32),
                                              ref.fp8_tile_colsum(dact.get().astype(np.float32), rows).view(np.uint32))
            else:
                be.fp8.k_fp8_cast_transpose_amax(*got, meta, dact, "e5m2", rec)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g.get(), w.get())
            assert rec.get()[0] == xm.get()[0]
    # and the reference within one unit of the dtype of d (its GELU in float64)
    d_ref = ref._dgelu(dact.get(), pre.get())
    o, ot, p2, m2 = np.zeros((R, K), np.uint8), np.zeros((K, R), np.uint8), np.zeros((n, K), np.float32), np.zeros(1, np.float32)
    ref.k_fp8_dgelu_cast_transpose_colsum_amax(o, ot, d_meta, dact.get(), pre.get(), "e4m3", p2, m2, rows)
    assert np.allclose(np.float32(m2[0]), np.abs(d_ref.astype(np.float32)).max(), rtol=2 ** -7)
    assert np.mean(o != d_bytes) < 0.01


def test_delayed_roll_matches_the_reference(be):
    """k_fp8_delayed_roll on rows of random histories: a step taken (the amax enters, the oldest
    leaves), a skipped one (nothing moves), a non-finite amax (not entered), an empty history."""
    import cupy as cp
    from andrea.backends.cuda.fp8 import META_STRIDE
    from andrea.backends.interface import S_SKIP, STATE_LEN
    rng = np.random.default_rng(3)
    rows = (rng.random((37, META_STRIDE)) * np.exp2(rng.integers(-20, 8, (37, META_STRIDE)))).astype(np.float32)
    rows[5, 1], rows[6, 1] = np.inf, np.nan
    rows[7, 2:] = 0  # an empty history
    for skipped in (False, True):
        dev = cp.asarray(rows)
        state = cp.zeros(STATE_LEN, cp.float64)
        state[S_SKIP] = float(skipped)
        be.fp8.k_fp8_delayed_roll(dev, state)
        want = rows.copy()
        ref.k_fp8_delayed_roll(want, skipped)
        np.testing.assert_array_equal(dev.get(), want, err_msg=f"skipped={skipped}")
    assert want[7, 0] == 0 and want[0, 0] == want[0, 2:18].max()


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


def test_delayed_scales_in_the_engine(tmp_path):
    """fp8_scaling="delayed" (eight tensors a layer: act, dact, the attention output, dqkv, the
    residual stream's two gradients, ln1 and ln2): step 1 takes their amax first (k_fp8_gelu_amax,
    the dGELU pass once more, k_fp8_amax), the steps after take none (no amax pass at all: the
    classifier is in bf16 at this vocabulary) and the layer norms write ln1 and ln2 as FP8
    operands (k_layernorm_fwd_fp8, no cast after); after a step of one microbatch each history's
    newest entry is that step's amax (act, the attention output, ln1 and ln2 of every layer, dact
    of layer 0, whose raw gradient the workspace still holds), the older ones moved one place; a skipped step leaves them. Two runs are bit-identical, and an evaluation
    pass between steps changes nothing; a resume from a state (its history in it) repeats the steps
    bit for bit, a state without one starts over with the amax taken first. The same steps with
    current scaling end close to these."""
    import cupy as cp
    from andrea.backends.cuda.fp8.plan import DELAYED_HIST_AT
    n_layer = MODEL["n_layer"]
    runs, mid = [], None
    for run in range(2):
        eng = delayed_engine(tmp_path)
        fp8, sc = eng.be.fp8, eng.fp8_scales
        assert not sc.live and eng.state().fp8_amax_history is None
        recs, counts = [], []
        for s in range(1, 8):
            log = launches(eng.be)
            if s == 5:
                eng.loss_scale = float("inf")
            micro = [batch(2 * s)] if s in (2, 3) else [batch(2 * s), batch(2 * s + 1)]
            before = sc.block.get()
            ln_w = {n: eng.p[n].copy() for n in eng.p if ".ln1_" in n or ".ln2_" in n}  # as the step's forward had them
            recs.append(dict(eng.train_step(s, micro)))
            eng.be.synchronize()
            counts.append({k: log.count(k) for k in ("k_fp8_amax", "k_fp8_gelu_amax", "k_fp8_dgelu_colsum_amax",
                                                     "k_fp8_dgelu_cast_transpose_colsum_amax",
                                                     "k_fp8_gelu_cast_transpose_amax", "k_fp8_cast_transpose_amax",
                                                     "k_fp8_cast_transpose_colsum_amax", "k_fp8_cast_transpose",
                                                     "k_fp8_delayed_roll", "k_layernorm_fwd_fp8")})
            del eng.be.rt.launch
            after = sc.block.get()
            h0, h1 = before[:, DELAYED_HIST_AT:DELAYED_HIST_AT + 16], after[:, DELAYED_HIST_AT:DELAYED_HIST_AT + 16]
            if s == 5:
                eng.loss_scale = 1.0
                np.testing.assert_array_equal(h1, h0, err_msg="a skipped step moved the history")
            else:
                np.testing.assert_array_equal(h1[:, 1:], h0[:, :-1], err_msg=f"step {s}: the history did not move")
                assert np.all(h1[:, 0] > 0) and np.all(after[:, 0] == h1.max(axis=1)) and np.all(after[:, 1] == 0)
            if s in (2, 3):  # one microbatch: its amax is the newest entry
                for l in range(n_layer):
                    m, a = cp.zeros(2, cp.float32), cp.zeros(2, cp.float32)
                    fp8.k_fp8_gelu_amax(m, eng.layers[l]["pre"].reshape(-1, 4 * 48))
                    fp8.k_fp8_amax(a, eng.layers[l]["atty"].reshape(-1, 48))
                    assert h1[8 * l, 0] == m.get()[0], f"step {s}: act amax of layer {l}"
                    assert h1[8 * l + 2, 0] == a.get()[0], f"step {s}: attention output amax of layer {l}"
                    # ln1 and ln2 (never written in bf16): their layer norms again, with an amax
                    src1 = eng.g["x0"] if l == 0 else eng.layers[l - 1]["res_out"]
                    for k, (src, name) in enumerate(((src1, "ln1"), (eng.layers[l]["xmid"], "ln2"))):
                        out, am = cp.empty_like(src), cp.zeros(2, cp.float32)
                        stats = [cp.empty(src.shape[:-1], cp.float32) for _ in range(2)]
                        eng.be.k_layernorm_fwd(out, *stats, src, ln_w[f"h{l}.{name}_w"], ln_w[f"h{l}.{name}_b"],
                                               amax=am)
                        assert h1[8 * l + 6 + k, 0] == am.get()[0], f"step {s}: {name} amax of layer {l}"
                d, m = eng.g["dact"].reshape(-1, 4 * 48).copy(), cp.zeros(2, cp.float32)
                fp8.k_fp8_dgelu_colsum_amax(cp.zeros(64 * 4 * 48, cp.float32), m, d,
                                            eng.layers[0]["pre"].reshape(-1, 4 * 48), 2)
                assert h1[1, 0] == m.get()[0], f"step {s}: dact amax of layer 0"
            if run == 0 and s in (1, 4):  # evaluation (right after the first step too): records nothing
                eng.val_loss([batch(40)])
            if s == 3:
                mid = eng.state()
                assert np.array(mid.fp8_amax_history).shape == (8 * n_layer, 16)
        runs.append((recs, eng.host_state()))
        # step 1: two microbatches, eager (ln1 and ln2 written in bf16, their amax taken, then cast);
        # step 2: one, eager (its graphs' first run with a history): ln1 and ln2 from their layer norms
        per = n_layer * 2
        assert counts[0] == {"k_fp8_amax": 6 * per, "k_fp8_gelu_amax": per, "k_fp8_dgelu_colsum_amax": 0,
                             "k_fp8_dgelu_cast_transpose_colsum_amax": 2 * per,
                             "k_fp8_gelu_cast_transpose_amax": per, "k_fp8_cast_transpose_amax": 3 * per,
                             "k_fp8_cast_transpose_colsum_amax": 3 * per, "k_fp8_cast_transpose": 0,
                             "k_fp8_delayed_roll": 1, "k_layernorm_fwd_fp8": 0}, counts[0]
        assert counts[1] == {"k_fp8_amax": 0, "k_fp8_gelu_amax": 0, "k_fp8_dgelu_colsum_amax": 0,
                             "k_fp8_dgelu_cast_transpose_colsum_amax": n_layer,
                             "k_fp8_gelu_cast_transpose_amax": n_layer, "k_fp8_cast_transpose_amax": n_layer,
                             "k_fp8_cast_transpose_colsum_amax": 3 * n_layer, "k_fp8_cast_transpose": 0,
                             "k_fp8_delayed_roll": 1, "k_layernorm_fwd_fp8": 2 * n_layer}, counts[1]
        assert sc.live
    (a, sa), (b, sb) = runs
    assert [r["skipped"] for r in a] == [False] * 4 + [True] + [False] * 2, a
    assert_same_runs((a, sa), (b, sb), "two delayed runs (one with an evaluation between steps) differ")
    # resume from the state after step 3 (with its history): steps 4..7 as straight

    def live(e, when):
        assert e.fp8_scales.live, when
    eng = delayed_engine(tmp_path, seed=99)
    check_resume(eng, mid, (a, None, sa), live)
    # a state without a history (a checkpoint of current scaling): the next step takes its amax first
    mid.fp8_amax_history = None
    eng.load_state(mid)
    assert not eng.fp8_scales.live
    # current scaling, the same steps: close, not equal
    cur = delayed_engine(tmp_path, "current")
    c = [dict(cur.train_step(s, [batch(2 * s)] if s in (2, 3) else [batch(2 * s), batch(2 * s + 1)]))
         for s in range(1, 5)]
    assert all(abs(x["loss"] - y["loss"]) < 0.02 * y["loss"] for x, y in zip(a[:4], c)), (a[:4], c)
    assert repr(a[1:4]) != repr(c[1:4])


# ---------------------------------------------------------------- the attention's FP8 epilogues
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("hs,NH", [(64, 2), (16, 3), (128, 1)])
def test_attention_fp8_kernels_are_the_attention_then_its_cast(be, hs, NH, fmt, monkeypatch):
    """k_attn_fwd_fp8 and k_attn_bwd_fp8 (attention_hopper.cu's _fp8 kernels, T = 192: the last
    dQ block's second warpgroup has no rows): out and lse bit for bit k_attn_fwd's; the FP8 bytes,
    their transpose, 1/scale, the amax (reduced into a smaller value already there) and, for dqkv,
    the column partials of its 64-row tiles bit for bit what k_fp8_cast_transpose_amax /
    k_fp8_cast_transpose_colsum_amax (64-row tiles) make of k_attn_fwd's out and of k_attn_bwd's
    dqkv (accumulate=False), with the same meta; a delayed scale of a quarter of the amax saturates
    as the cast does. Against ref.k_attn_bwd_fp8 in float32: the decoded values within the
    FP8 layers' 0.1."""
    import cupy as cp
    if not be._hopper(hs):
        pytest.skip("the FP8 attention kernels are the wgmma ones (compute capability 9.0)")
    use_tuning(monkeypatch, be, fp8_tile_rows=64)
    B, T = 2, 192
    C, N = NH * hs, B * T
    rng = np.random.default_rng(hs + NH)
    qkv = on_dev(rng.normal(0, 1, (B, T, 3 * C)))
    dout = on_dev(rng.normal(0, 1, (B, T, C)))
    out, lse = cp.empty((B, T, C), bf16()), cp.empty((B, NH, T), cp.float32)
    be.k_attn_fwd(out, lse, qkv, NH)
    dqkv = cp.empty((B, T, 3 * C), bf16())
    be.k_attn_bwd(dqkv, dout, qkv, out, lse, NH, accumulate=False)
    for case in ("plain", "saturate"):
        for name, x, f in (("fwd", out.reshape(N, C), "e4m3"), ("bwd", dqkv.reshape(N, 3 * C), fmt)):
            W = x.shape[1]
            want_part = cp.zeros((N // 64) * W, cp.float32) if name == "bwd" else None
            meta, want, want_rec, inv, top = cast_reference(be, x, f, case == "saturate", want_part)
            got = [cp.full((N, W), 0xAA, cp.uint8), cp.full((W, N), 0xAA, cp.uint8)]
            rec, part = cp.asarray(np.array([1e-3], np.float32)), cp.full((N // 64, W), np.nan, cp.float32)
            if name == "fwd":
                o2, l2 = cp.full_like(out, 7), cp.full_like(lse, 7)
                be.k_attn_fwd_fp8(o2, l2, *got, meta, rec, qkv, NH)
                assert o2.get().tobytes() == out.get().tobytes() and l2.get().tobytes() == lse.get().tobytes()
            else:
                be.k_attn_bwd_fp8(*got, part, meta, rec, dout, qkv, out, lse, NH, f)
                assert part.get().tobytes() == want_part.get().tobytes(), (case, name, "column partials")
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g.get(), w.get(), err_msg=f"{case} {name}")
            assert meta.get()[1].tobytes() == np.float32(inv).tobytes(), (case, name)
            assert rec.get()[0] == top > 1e-3, (case, name)
            if case == "saturate":
                assert (ref.fp8_decode(got[0].get(), f) == ref.FP8_FORMATS[f][2]).any(), f"{name}: nothing saturated"
                continue
            if name == "bwd":  # the float32 reference of the whole backward, through its FP8 bytes
                hq = np.zeros((N, W), np.uint8)
                r_meta = np.array([top, 0], np.float32)
                args = [host(a).astype(np.float32) for a in (dout, qkv, out)] + [lse.get()]
                ref.k_attn_bwd_fp8(hq, None, None, r_meta, None, *args, NH, f)
                assert rel(ref.fp8_decode(got[0].get(), f), ref.fp8_decode(hq, f)) < 0.1


def test_attention_fp8_kernels_refuse_what_they_cannot_take(be):
    """T not a multiple of 64: a ValueError naming the kernel and what it expected."""
    import cupy as cp
    B, T, NH, hs = 1, 96, 2, 64
    C = NH * hs
    qkv, out = cp.zeros((B, T, 3 * C), bf16()), cp.zeros((B, T, C), bf16())
    lse, meta = cp.zeros((B, NH, T), cp.float32), cp.zeros(2, cp.float32)
    with pytest.raises(ValueError, match="k_attn_fwd_fp8: .*T a multiple of 64"):
        be.k_attn_fwd_fp8(out, lse, cp.zeros((B * T, C), cp.uint8), cp.zeros((C, B * T), cp.uint8), meta,
                          None, qkv, NH)
    with pytest.raises(ValueError, match="k_attn_bwd_fp8: .*T a multiple of 64"):
        be.k_attn_bwd_fp8(cp.zeros((B * T, 3 * C), cp.uint8), cp.zeros((3 * C, B * T), cp.uint8), None, meta,
                          None, out, qkv, out, lse, NH, "e4m3")


def test_attention_cast_in_the_engine(tmp_path):
    """Delayed scaling with the attention writing its output and dqkv as FP8 operands (T = 64,
    head size 16), over steps of two microbatches and one, a skipped step and an evaluation: step
    2 (the first with a history) runs the _fp8 kernels (a forward and a backward a layer) and no
    cast of the attention output or dqkv, step 1 none."""
    n_layer = MODEL["n_layer"]
    eng = engine_t64(tmp_path)
    recs, counts = [], []
    for s in range(1, 6):
        log = launches(eng.be)
        if s == 4:
            eng.loss_scale = float("inf")
        micro = [batch(3 * s, B=2, T=64)] if s == 2 else [batch(3 * s, B=2, T=64), batch(3 * s + 1, B=2, T=64)]
        recs.append(dict(eng.train_step(s, micro)))
        eng.be.synchronize()
        counts.append((len(micro), {k: log.count(k) for k in ("k_attn_flash_fwd_fp8", "k_attn_flash_bwd_dq_fp8",
                                                              "k_attn_flash_bwd_dkv_fp8",
                                                              "k_fp8_cast_transpose_amax",
                                                              "k_fp8_cast_transpose_colsum_amax")}))
        del eng.be.rt.launch
        eng.loss_scale = 1.0
        if s == 3:
            recs.append(eng.val_loss([batch(50, B=2, T=64)]))
    # step 2 (one microbatch, eager: its graphs' first run with a history); the residual stream's
    # two gradients are still cast
    assert counts[1][1] == {"k_attn_flash_fwd_fp8": n_layer, "k_attn_flash_bwd_dq_fp8": n_layer,
                            "k_attn_flash_bwd_dkv_fp8": n_layer, "k_fp8_cast_transpose_amax": 0,
                            "k_fp8_cast_transpose_colsum_amax": 2 * n_layer}, counts[1]
    assert counts[0][1]["k_attn_flash_fwd_fp8"] == 0, "step 1 (no history yet) took the FP8 attention"


def test_pdl_same_bits_t64(tmp_path):
    """Programmatic dependent launch (Runtime.pdl) at T = 64, where the attention runs its FP8
    forms (attention_hopper.cu) and the scales are delayed: the same records, weights and Adam
    state bits as ordinary launches over steps of two microbatches and one (eager, then from CUDA
    graphs), a skipped step and an evaluation; the attention's kernels went through
    cuLaunchKernelEx."""
    runs = []
    for on in (True, False):
        eng = engine_t64(tmp_path, pdl=on)
        launched = []
        launch = eng.be.rt.launch
        eng.be.rt.launch = lambda f, k, *a, **kw: (launched.append((k, eng.be.rt._pdl_launchable(f, k))),
                                                   launch(f, k, *a, **kw))[1]
        recs = []
        for s in range(1, 6):
            if s == 4:
                eng.loss_scale = float("inf")
            micro = [batch(7 * s, B=2, T=64)] if s == 2 else [batch(7 * s, B=2, T=64), batch(7 * s + 1, B=2, T=64)]
            recs.append(dict(eng.train_step(s, micro)))
            eng.be.synchronize()
            eng.loss_scale = 1.0
            if s == 3:
                recs.append(eng.val_loss([batch(70, B=2, T=64)]))
        del eng.be.rt.launch
        ready = {k for k, ok in launched if ok}
        assert {"k_attn_flash_fwd_fp8", "k_attn_flash_bwd_dq_fp8", "k_attn_flash_bwd_dkv_fp8"} <= ready, ready
        assert (eng.be.rt.pdl_launches > 0) == on, eng.be.rt.pdl_launches
        runs.append((recs, eng.host_state()))
    assert_same_runs(*runs, what="programmatic launches changed the run")
