"""CUDA: the FP8 quantisation kernels and the FP8 layers against the reference's FP8 section, on the GPU (skipped without one); moved from tests/test_fp8_cuda.py.

    python -m pytest -m gpu tests/cuda/test_fp8_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import ref
from fp8kit import TOL, bf16, cast_reference, fp8_neighbours_at_midpoint, fp8_steps_apart, host, on_dev, rel, use_tuning
from cudakit import fp8_gpu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores and CuPy")]


@pytest.fixture(scope="module")
def be():
    from andrea.backends import get_backend
    b = get_backend("cuda")
    b.reserve_workspace(4, 48, 80, 5, bf16(), fp8=True)
    return b


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


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("R,K", [(48, 80), (112, 208), (16, 16), (400, 96)])  # partial tiles
def test_gelu_kernels_match_the_reference(be, dtype, R, K, rows, monkeypatch):
    """k_fp8_gelu_amax and k_fp8_gelu_cast_transpose of pre against the reference's (both formats;
    both outputs or out_t alone, the same bytes; a NaN in pre makes the amax NaN). The GPU's act
    is gelu.cuh's sigmoid form in float32, the reference's the tanh form in float64: the same
    function, rounded to the dtype, so a few elements land one unit of the dtype apart, and so at
    most one FP8 code apart in under 1% of the bytes (the reference cast with the GPU's amax);
    the amax within one unit of the dtype. gelu.cuh's folded form, the one fp8.cu is
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
    reference's. gelu.cuh's folded form, the one fp8.cu is built with."""
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
    the reference. gelu.cuh's folded form, the one fp8.cu is built with."""
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
    folded form, the one fp8.cu is built with."""
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

