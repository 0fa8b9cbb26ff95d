"""The FP8 reference (numpy_ref's FP8 section) against PyTorch's float8 casts, and the FP8 linear
layers against the float64 ones they approximate (CPU only).

    python -m pytest tests/test_fp8_ref.py -q

PyTorch's `x.to(torch.float8_e4m3fn / float8_e5m2)` rounds to nearest even but does not saturate,
so the comparisons clamp to the largest finite value first (what a saturating cast means). Sizes
are odd (the reference takes any; the CUDA path needs multiples of 16 and says so).
"""
import numpy as np
import pytest

from andrea.backends import numpy_ref as K

torch = pytest.importorskip("torch")
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FMTS = ["e4m3", "e5m2"]


def torch_round(x, fmt):
    top = K.FP8_FORMATS[fmt][2]
    t = torch.from_numpy(np.asarray(x, np.float32)).clamp(-top, top)
    return t.to(TORCH_FP8[fmt]).to(torch.float32).numpy()


def samples(rng, n=20000):
    """Values over every binade of both formats, subnormals, exact ties, zeros, overflow."""
    x = rng.normal(0, 1, n) * np.exp2(rng.integers(-24, 20, n))
    ties = (np.arange(1, 200) + 0.5) * 2.0 ** -9  # halfway between E4M3 subnormals
    ties2 = (1.0 + (2 * np.arange(8) + 1) / 16.0) * 4.0  # halfway between E4M3 normals (1.xxx1 * 4)
    extra = [0.0, -0.0, 448.0, 449.0, 463.9, 464.0, 1e6, -1e6, 57344.0, 61439.0, 61440.0, 1e30, np.inf, -np.inf]
    return np.concatenate([x, ties, -ties, ties2, -ties2, extra]).astype(np.float32)


@pytest.mark.parametrize("fmt", FMTS)
def test_round_matches_torch_saturating_cast(fmt):
    x = samples(np.random.default_rng(0))
    ours, theirs = K.fp8_round(x, fmt), torch_round(x, fmt)
    bad = np.flatnonzero(ours != theirs)
    assert bad.size == 0, f"{bad.size} differ, e.g. x={x[bad[:5]]}: ours {ours[bad[:5]]}, torch {theirs[bad[:5]]}"
    assert np.isnan(K.fp8_round(np.float32(np.nan), fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_decode_every_byte_as_torch(fmt):
    bits = np.arange(256, dtype=np.uint8)
    theirs = torch.from_numpy(bits).view(TORCH_FP8[fmt]).to(torch.float32).numpy()
    ours = K.fp8_decode(bits, fmt)
    np.testing.assert_array_equal(ours, theirs)  # NaN where both are NaN
    finite = np.isfinite(ours)
    np.testing.assert_array_equal(K.fp8_encode(ours[finite], fmt), bits[finite])
    assert K.fp8_encode(np.float32(np.nan), fmt) == 0x7F


@pytest.mark.parametrize("fmt", FMTS)
def test_scale_is_the_largest_power_of_two_that_fits(fmt):
    top = K.FP8_FORMATS[fmt][2]
    rng = np.random.default_rng(1)
    amaxes = np.concatenate([np.abs(samples(rng, 2000)), [top, top * 1.0001, 1.75, 1.7500001, 2.0 ** -140]])
    for a in amaxes[np.isfinite(amaxes) & (amaxes > 0)]:
        s, inv = K.fp8_scale(a, fmt)
        k = np.log2(s)
        assert k == np.round(k) and s * inv == 1.0, (a, s, inv)
        if abs(k) < K.FP8_MAX_SHIFT:
            assert np.float64(a) * s <= top < np.float64(a) * s * 2, (a, s)
    assert K.fp8_scale(np.float32(0), fmt) == (1.0, 1.0)
    assert all(np.isnan(K.fp8_scale(np.float32(v), fmt)).all() for v in (np.nan, np.inf))


@pytest.mark.parametrize("fmt", FMTS)
def test_cast_and_cast_transpose_match_torch(fmt):
    rng = np.random.default_rng(2)
    x = (rng.normal(0, 3e-3, (37, 53)) * (1 + 50 * (rng.random((37, 53)) < 0.01))).astype(np.float32)
    meta = np.full(2, -1, np.float32)
    K.k_fp8_amax(meta, x)
    assert meta[0] == np.abs(x).max()
    out, out_t = np.zeros((37, 53), np.uint8), np.zeros((53, 37), np.uint8)
    K.k_fp8_cast_transpose(out, out_t, meta, x, fmt)
    scale, inv = K.fp8_scale(meta[0], fmt)
    assert meta[1] == inv
    theirs = torch.from_numpy(torch_round(x * scale, fmt)).to(TORCH_FP8[fmt]).view(torch.uint8).numpy()
    np.testing.assert_array_equal(out, theirs)
    np.testing.assert_array_equal(out_t, theirs.T)
    alone = np.zeros_like(out)
    K.k_fp8_cast(alone, meta, x, fmt)
    np.testing.assert_array_equal(alone, out)
    assert np.abs(K.fp8_decode(out, fmt)).max() <= K.FP8_FORMATS[fmt][2]
    nan_meta = np.zeros(2, np.float32)
    x[3, 4] = np.nan
    K.k_fp8_amax(nan_meta, x)
    assert np.isnan(nan_meta[0])


def on_grid(rng, shape, fmt="e4m3"):
    """Values an FP8 product represents exactly: fp8 grid points times one power of two, and
    amax a power of two times 1.75 or less, so the tensor's own scale keeps them on the grid."""
    v = K.fp8_round(rng.normal(0, 40, shape), fmt).astype(np.float64)
    v.reshape(-1)[0] = 448.0 if fmt == "e4m3" else 57344.0
    return v * 2.0 ** -10


def test_linear_is_exact_on_the_grid_and_close_off_it():
    """On-grid operands: the FP8 layer is the float64 layer exactly (forward and backward). Off
    the grid (normal inputs): E4M3 errors of a few percent, not zero."""
    rng = np.random.default_rng(3)
    N, IC, OC = 29, 21, 13
    inp, w, b = on_grid(rng, (N, IC)), on_grid(rng, (OC, IC)), rng.normal(0, 1, OC)
    out, ref = np.zeros((N, OC)), np.zeros((N, OC))
    K.k_fp8_linear_fwd(out, inp, w, b)
    K._linear_fwd(ref, inp, w, b)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    for grad_fmt in FMTS:
        dout = on_grid(rng, (N, OC), grad_fmt)
        g8 = [rng.normal(0, 1, s) for s in ((N, IC), (OC, IC), (OC,))]  # pre-filled: backward ADDS
        g64 = [a.copy() for a in g8]
        K.k_fp8_linear_bwd(*g8, dout, inp, w, grad_fmt)
        K._linear_bwd(*g64, dout, inp, w)
        for a, r in zip(g8, g64):
            np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-12)
    x, w = rng.normal(0, 1, (N, IC)), rng.normal(0, 0.02, (OC, IC))
    K.k_fp8_linear_fwd(out, x, w, b * 0)
    K._linear_fwd(ref, x, w, b * 0)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert 1e-3 < err < 0.08, err


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("grad_fmt,tol", [("e4m3", 0.08), ("e5m2", 0.15)])
def test_mlp_close_to_float64_and_consistent(grad_fmt, tol):
    """The FP8 MLP against the float64 one: within the formats' relative errors (E4M3 2^-4,
    E5M2 2^-3 per element, less after summing), and its backward is the float64 backward of the
    quantised operands (the straight-through rule)."""
    rng = np.random.default_rng(4)
    N, C, H = 23, 11, 44
    inp, dout = rng.normal(0, 1, (N, C)), rng.normal(0, 1e-3, (N, C))
    w1, b1, w2, b2 = rng.normal(0, 0.3, (H, C)), rng.normal(0, 0.1, H), rng.normal(0, 0.2, (C, H)), rng.normal(0, 0.1, C)
    outs = {}
    for name, fwd, bwd, extra in (("fp8", K.k_fp8_mlp_fwd, K.k_fp8_mlp_bwd, (grad_fmt,)),
                                  ("f64", K.k_mlp_fwd, K.k_mlp_bwd, ())):
        out, pre, act, dact = np.zeros((N, C)), np.zeros((N, H)), np.zeros((N, H)), np.zeros((N, H))
        fwd(out, pre, act, inp, w1, b1, w2, b2)
        g = [np.zeros((N, C)), np.zeros((H, C)), np.zeros(H), np.zeros((C, H)), np.zeros(C)]
        bwd(*g, dout, inp, pre, w1, w2, act, dact, *extra)
        outs[name] = [out] + g
    for i, (a, r) in enumerate(zip(outs["fp8"], outs["f64"])):
        e = rel(a, r)
        assert e < tol, (i, e)
    assert rel(outs["fp8"][0], outs["f64"][0]) > 1e-4  # the quantisation is there
    np.testing.assert_allclose(outs["fp8"][5], outs["f64"][5], rtol=1e-12)  # db2: dout itself, not quantised


def test_numpy_backend_refuses_fp8_clearly(tmp_path):
    from andrea.config import load_run_config
    from andrea.core.engine import Engine
    from conftest import small_config
    with pytest.raises(ValueError, match="precision=fp8 needs backend=cuda"):
        Engine(load_run_config(small_config(tmp_path, precision="fp8")))


@pytest.mark.parametrize("skip", [False, True])
def test_adamw_step_amax_is_the_update_then_the_amax_of_each_weight(skip):
    """numpy_ref.k_adamw_step_amax: the update of k_adamw_step, bit for bit, then for each
    segment of the compute copy the larger of what its meta row held and the segment's amax as
    k_fp8_amax takes it (NaN where either is NaN); rows past the segments and the other columns
    untouched; a skipped step takes the amax of the weights as they were."""
    rng = np.random.default_rng(11 + skip)
    n, n_decay, segs = 203, 101, [(120, 200), (3, 50), (50, 51)]
    p = rng.normal(0, 0.1, n).astype(np.float32)
    p[130] = np.nan
    g, m = rng.normal(0, 0.01, n).astype(np.float32), rng.normal(0, 1e-3, n).astype(np.float32)
    v = np.abs(rng.normal(0, 1e-5, n)).astype(np.float32)
    st = np.zeros(K.STATE_LEN)
    st[K.S_SKIP] = float(skip)
    st[K.S_CLIP], st[K.S_DECAY], st[K.S_STEP_SIZE], st[K.S_VHAT] = 0.5, 1 - 1e-4, 1e-3, 1.2
    pc0 = (p * 2).astype(np.float16)
    meta = np.full((4, 2), 7.0, np.float32)
    meta[1, 0], meta[2, 0] = 1e-9, 1e9  # a row holding less, one holding more than its amax
    ins = [x.copy() for x in (p, pc0, g, m, v)]
    K.k_adamw_step_amax(*ins[:5], st, 0.9, 0.95, 1e-8, n_decay, segs, meta)
    outs = [x.copy() for x in (p, pc0, g, m, v)]
    K.k_adamw_step(*outs[:5], st, 0.9, 0.95, 1e-8, n_decay)
    for name, a, b in zip(("params", "params_c", "grads", "m", "v"), ins, outs):
        assert a.tobytes() == b.tobytes(), name
    pc = outs[1].astype(np.float32)
    assert np.isnan(meta[0, 0]), "a NaN weight gives a NaN amax"
    assert meta[1, 0] == np.abs(pc[3:50]).max() and meta[1, 0] != 1e-9
    assert meta[2, 0] == np.float32(1e9)
    assert (meta[3] == 7.0).all() and (meta[:, 1] == 7.0).all()
    assert skip == (ins[1].tobytes() == pc0.tobytes())


def test_many_forms_are_each_tensor_alone():
    """k_fp8_amax_many and k_fp8_cast_transpose_many (the FP8 weight cache's two launches) give
    every tensor the bytes and meta of k_fp8_amax + k_fp8_cast_transpose on it alone: whatever meta
    held before, a zero tensor (scale 1), a NaN (scale NaN), an output skipped."""
    rng = np.random.default_rng(6)
    shapes = [(48, 16), (16, 80), (7, 5), (32, 32), (16, 16)]
    xs = [(rng.normal(0, 1, s) * np.exp2(rng.integers(-14, 8, s))).astype(np.float32) for s in shapes]
    xs[3][...] = 0.0
    xs[4][3, 7] = np.nan
    meta = rng.normal(0, 1e3, (len(xs), 4)).astype(np.float32)  # amax at 0, 1/scale at 2
    K.k_fp8_amax_many(meta, xs)
    outs = [np.full(s, 0xAA, np.uint8) for s in shapes]
    outs_t = [np.full(s[::-1], 0xAA, np.uint8) for s in shapes]
    outs[1] = None
    K.k_fp8_cast_transpose_many(outs, outs_t, meta, xs, "e4m3")
    for t, x in enumerate(xs):
        pair = np.zeros(2, np.float32)
        K.k_fp8_amax(pair, x)
        o, ot = np.zeros(x.shape, np.uint8), np.zeros(x.shape[::-1], np.uint8)
        K.k_fp8_cast_transpose(o, ot, pair, x, "e4m3")
        np.testing.assert_array_equal(meta[t, [0, 2]], pair)  # NaN where both are NaN
        assert meta[t, 1] == 0 and meta[t, 3] == 0, "the rest of a meta row is zeroed"
        if outs[t] is not None:
            np.testing.assert_array_equal(outs[t], o)
        np.testing.assert_array_equal(outs_t[t], ot)
    assert meta[3, 2] == 1.0 and np.isnan(meta[4, 0]) and np.isnan(meta[4, 2])
    s = 1.0 / float(meta[0, 2])  # and the bytes are PyTorch's saturating cast of x * scale
    np.testing.assert_array_equal(K.fp8_decode(outs[0], "e4m3"), torch_round(xs[0] * s, "e4m3"))


@pytest.mark.parametrize("tile_rows", [64, 128])
@pytest.mark.parametrize("R,Kc", [(48, 24), (200, 40), (64, 8), (336, 56)])
def test_cast_transpose_colsum_partials(tile_rows, R, Kc):
    """k_fp8_cast_transpose_colsum: the bytes of k_fp8_cast_transpose, and one row of column sums a
    tile of tile_rows rows (the last tile partial), each close to the float64 sum of its rows, all of
    them together the column sums (a bias gradient)."""
    rng = np.random.default_rng(R + Kc)
    x = (rng.standard_normal((R, Kc)) * np.exp2(rng.integers(-8, 4, (R, Kc)))).astype(np.float32)
    n = -(-R // tile_rows)
    meta, pair = np.zeros(2, np.float32), np.zeros(2, np.float32)
    K.k_fp8_amax(meta, x)
    K.k_fp8_amax(pair, x)
    o, ot, part = np.zeros((R, Kc), np.uint8), np.zeros((Kc, R), np.uint8), np.full(n * Kc, np.nan, np.float32)
    K.k_fp8_cast_transpose_colsum(o, ot, meta, x, "e4m3", part, tile_rows)
    o2, ot2 = np.zeros((R, Kc), np.uint8), np.zeros((Kc, R), np.uint8)
    K.k_fp8_cast_transpose(o2, ot2, pair, x, "e4m3")
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(ot, ot2)
    np.testing.assert_array_equal(meta, pair)
    want = np.stack([x[i * tile_rows:(i + 1) * tile_rows].astype(np.float64).sum(0) for i in range(n)])
    scale = np.abs(x).astype(np.float64).sum() / x.size * tile_rows
    np.testing.assert_allclose(part.reshape(n, Kc), want, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(part.reshape(n, Kc).sum(0), x.astype(np.float64).sum(0), rtol=0, atol=1e-5 * scale * n)


def test_tile_colsum_takes_its_stated_order():
    """fp8_tile_colsum adds rows as the kernel does: row 32h + 4w + l into a_wl over h, then
    (a_w0 + a_w1) + (a_w2 + a_w3), then the warps in order. With 2^24 in row 0 and 1 in rows 2 and 3
    the pairs keep the two ones (2^24 + 2); a sum down the rows loses each (2^24). Row 32 (h = 1)
    goes into a_00 with 2^24 and is lost; row 4 (w = 1) reaches the warps' sum, 2^24 + 2 + 1 rounds
    to 2^24 + 4 (ties to even)."""
    x = np.zeros((64, 2), np.float32)
    x[0, 0], x[2, 0], x[3, 0], x[32, 0] = 2.0**24, 1, 1, 1
    x[0, 1], x[2, 1], x[3, 1], x[4, 1] = 2.0**24, 1, 1, 1
    p = K.fp8_tile_colsum(x, 64)
    seq = np.float32(0)
    for v in x[:, 0]:
        seq = np.float32(seq + v)
    assert seq == 2.0**24
    assert p.shape == (1, 2) and p[0, 0] == 2.0**24 + 2 and p[0, 1] == 2.0**24 + 4, p
    with pytest.raises(ValueError, match="tile_rows = 48; expected a multiple of 32"):
        K.fp8_tile_colsum(x, 48)


def test_memory_plan_lists_the_fp8_weight_cache():
    """fp8 plans an FP8 copy of every linear weight and of its transpose (one byte an element each,
    each copy 256-byte aligned), a 64-float (amax, 1/scale) row and a table row per weight; the
    switch off plans none; at ANDREA-120M with B=8 the cache adds less than 10% to the plan."""
    from andrea.core import model
    from andrea.pipeline.compose import compose_config
    from andrea.core.engine import fp8_cached_weights, make_plan
    for exp, B in (("ANDREA-tiny", 4), ("ANDREA-120M", 8)):
        cfgs = {p: compose_config(exp, [f"train.precision={p}", f"train.batch_size={B}"]) for p in ("bf16", "fp8")}
        m = cfgs["fp8"].model
        shapes = dict(model.param_shapes(m)[0])
        names = fp8_cached_weights(m)
        assert len(names) == 4 * m.n_layer and all(shapes[n] for n in names)
        assert {shapes[n] for n in names[:4]} == {(3 * m.d_model, m.d_model), (m.d_model, m.d_model),
                                                  (4 * m.d_model, m.d_model), (m.d_model, 4 * m.d_model)}
        on, off = make_plan(cfgs["fp8"]), make_plan(cfgs["fp8"], fp8_weight_cache=False)
        rows = {r.name: r for r in on.rows if r.group == "fp8 weight cache"}
        assert set(rows) == {"fp8_wcache", "fp8_wmeta", "fp8_wtable"}
        copies = sum(2 * -(-int(np.prod(shapes[n])) // 256) * 256 for n in names)
        assert copies >= 2 * sum(int(np.prod(shapes[n])) for n in names)
        assert rows["fp8_wcache"].nbytes == copies
        assert rows["fp8_wmeta"].nbytes == len(names) * 64 * 4
        assert rows["fp8_wtable"].shape == (len(names), 5) and rows["fp8_wtable"].dtype == "int64"
        assert on.by_group()["fp8 weight cache"] == copies + len(names) * (256 + 40)
        assert "fp8 weight cache" not in off.by_group() and "fp8 weight cache" not in make_plan(cfgs["bf16"]).by_group()
        assert [r for r in on.rows if r.group != "fp8 weight cache"] == off.rows
        if exp == "ANDREA-120M":
            assert on.total() - off.total() < 0.10 * off.total(), (on.total(), off.total())


@pytest.mark.parametrize("residual", [False, True], ids=["layernorm", "residual_layernorm"])
def test_layernorm_amax_is_k_fp8_amax_of_its_output(residual):
    """The layer norms' optional amax: max |out| as k_fp8_amax takes it (NaN where out has one),
    out itself the same with and without it; odd sizes."""
    rng = np.random.default_rng(3)
    B, T, C = 3, 7, 37
    a, b = rng.normal(0, 2, (B, T, C)), rng.normal(0, 1, (B, T, C))
    w, bias = rng.normal(1, 0.5, C), rng.normal(0, 0.1, C)
    for nan in (False, True):
        if nan:
            a[1, 4, 9] = np.nan
        outs = []
        for amax in (None, np.full(2, -7.0, np.float32)):
            res, out, mean, rstd = (np.zeros((B, T, C)), np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T)))
            if residual:
                K.k_residual_layernorm_fwd(res, out, mean, rstd, a, b, w, bias, amax=amax)
            else:
                K.k_layernorm_fwd(out, mean, rstd, a, w, bias, amax=amax)
            outs.append((out, amax))
        np.testing.assert_array_equal(outs[0][0], outs[1][0])
        got, want = outs[1][1], np.zeros(2, np.float32)
        K.k_fp8_amax(want, outs[1][0])
        assert got[1] == -7.0, "amax wrote beyond its [0]"
        if nan:
            assert np.isnan(got[0]) and np.isnan(want[0])
        else:
            assert got[0] == want[0] == np.float32(np.abs(outs[1][0]).max()) > 0


def test_memory_plan_lists_the_fp8_input_slots():
    """The input slots (fp8_keep_xt, fp8_producer_amax): a 64-float (amax, 1/scale) row for the
    input of every QKV, attention-output and MLP product (four a layer, the last one's input act)
    with either switch, and with fp8_keep_xt FP8 X^T of each (IC x B*T bytes, 256-byte aligned:
    C for the first three, 4C for act); none with both off or in 16 bits. At ANDREA-120M with
    B=8 the kept X^T are (3 + 4) x 12 x 768 x 8192 bytes (528.5 MB)."""
    from andrea.pipeline.compose import compose_config
    from andrea.core.engine import fp8_input_slots, make_plan
    for exp, B in (("ANDREA-tiny", 4), ("ANDREA-120M", 8)):
        cfg = compose_config(exp, ["train.precision=fp8", f"train.batch_size={B}"])
        m, N = cfg.model, B * cfg.train.seq_len
        slots = fp8_input_slots(m)
        assert [(w, x) for w, l, x in slots[:4]] == [("h0.qkv_w", "ln1"), ("h0.attn_out_w", "atty"),
                                                     ("h0.mlp_w1", "ln2"), ("h0.mlp_w2", "act")]
        assert len(slots) == 4 * m.n_layer and [l for _, l, _ in slots[-4:]] == [m.n_layer - 1] * 4
        plans = {(k, a): make_plan(cfg, fp8_keep_xt=k, fp8_producer_amax=a) for k in (False, True) for a in (False, True)}
        group = "fp8 input slots"
        assert group not in plans[False, False].by_group()
        assert group not in make_plan(compose_config(exp, ["train.precision=bf16"])).by_group()
        meta = len(slots) * 64 * 4
        C = m.d_model
        xt = m.n_layer * (3 * (-(-C * N // 256) * 256) + (-(-4 * C * N // 256) * 256))
        assert plans[False, True].by_group()[group] == meta
        assert plans[True, False].by_group()[group] == plans[True, True].by_group()[group] == meta + xt
        assert {r.name for r in plans[True, True].rows if r.group == group} == {"fp8_xmeta", "fp8_xt"}
        assert [r for r in plans[True, True].rows if r.group != group] == plans[False, False].rows
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
        "from andrea.core.engine import make_plan\n"
        "for p in ('bf16', 'fp8'):\n"
        "    plan = make_plan(compose_config('ANDREA-tiny', [f'train.precision={p}']))\n"
        "    rows = {r.name: r for r in plan.rows}\n"
        "    c = rows['params_c']\n"
        "    assert c.dtype == 'bfloat16' and c.nbytes == 2 * c.shape[0], (p, c)\n"
        "    assert plan.total() > 0\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gelu_passes_against_pytorch(dtype):
    """The FP8 MLP's passes over pre and dact (N, H) = (37, 24). act (k_mlp_bwd_gelu's, in pre's
    dtype) and the GELU's derivative against PyTorch's tanh GELU and its autograd in float64 (equal
    up to the final rounding to the dtype, one unit of it, and float64's own rounding); k_fp8_gelu_amax and
    k_fp8_gelu_cast_transpose are k_fp8_amax and k_fp8_cast of that act; k_fp8_dgelu_colsum_amax
    multiplies dact by the derivative, adds its column sums into db and takes its amax; a NaN in
    pre makes both amax NaN."""
    torch = pytest.importorskip("torch")
    dt = np.dtype(dtype)
    eps = float(np.finfo(dt).eps)
    tiny = max(1e-15, float(np.finfo(dt).smallest_subnormal))  # float16's subnormal spacing
    rng = np.random.default_rng(11)
    N, H = 37, 24
    pre = (rng.standard_normal((N, H)) * 3).astype(dt)
    dact = (1e-3 * rng.standard_normal((N, H))).astype(dt)
    t = torch.tensor(pre.astype(np.float64), requires_grad=True)
    g = torch.nn.functional.gelu(t, approximate="tanh")
    (slope,) = torch.autograd.grad(g, t, torch.ones_like(g))
    act = K._act(pre)
    assert act.dtype == dt
    # atol: far in the negative tail 1 + tanh(u) cancels, and the two float64 formulas differ by
    # about |x| * 2^-53 before the rounding to dt (or by its subnormal spacing)
    np.testing.assert_allclose(act.astype(np.float64), g.detach().numpy(), rtol=eps, atol=tiny)
    # the derivative's two terms cancel in the tail too, the larger one of size x^3: atol 1e-13
    np.testing.assert_allclose(K._gelu_grad(pre.astype(np.float64)), slope.numpy(), rtol=1e-12, atol=1e-13)
    for fmt in ("e4m3", "e5m2"):
        meta, want = np.zeros(2, np.float32), np.zeros(2, np.float32)
        K.k_fp8_gelu_amax(meta, pre)
        assert meta[0] == np.float32(np.abs(act.astype(np.float32)).max()) > 0
        out, out_t = np.zeros((N, H), np.uint8), np.zeros((H, N), np.uint8)
        K.k_fp8_gelu_cast_transpose(out, out_t, meta, pre, fmt)
        want[0] = meta[0]
        w_out = np.zeros((N, H), np.uint8)
        K.k_fp8_cast(w_out, want, act, fmt)
        np.testing.assert_array_equal(out, w_out)
        np.testing.assert_array_equal(out_t, w_out.T)
        assert meta[1] == want[1] and 0 < meta[1] <= 1
    db0 = rng.standard_normal(H)
    db, meta, d = db0.copy(), np.zeros(2, np.float32), dact.copy()
    K.k_fp8_dgelu_colsum_amax(db, meta, d, pre)
    want_dact = dact.astype(np.float64) * slope.numpy()
    np.testing.assert_allclose(d.astype(np.float64), want_dact, rtol=eps, atol=tiny)
    np.testing.assert_allclose(db, db0 + d.astype(np.float64).sum(axis=0), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(db, db0 + want_dact.sum(axis=0), rtol=N * eps, atol=1e-15)
    assert meta[0] == np.float32(np.abs(d.astype(np.float32)).max()) > 0
    pre[5, 7] = np.nan
    K.k_fp8_gelu_amax(meta, pre)
    assert np.isnan(meta[0])
    K.k_fp8_dgelu_colsum_amax(db, meta, dact.copy(), pre)
    assert np.isnan(meta[0])


# ---------------------------------------------------------------- the classifier in FP8
def classifier_case(rng, N=37, C=24, V=53):
    x = rng.normal(0, 1, (N, C)).astype(np.float32)
    w = rng.normal(0, 0.5, (V, C)).astype(np.float32)
    t = rng.integers(0, V, N).astype(np.int64)
    return x, w, t


@pytest.mark.parametrize("fmt", FMTS)
def test_dlogits_row_pass_against_torch(fmt):
    """loss_bwd_fp8: losses and lse as PyTorch's cross-entropy, q8 PyTorch's saturating cast of
    (softmax - onehot) * 2^k (k of an amax of 1: 8 for E4M3, 15 for E5M2), 1/scale = dloss / 2^k."""
    rng = np.random.default_rng(1)
    z = rng.normal(0, 3, (41, 67))
    t = rng.integers(0, 67, 41)
    losses, lse, q8, meta = np.zeros(41), np.zeros(41), np.zeros((41, 67), np.uint8), np.zeros(2, np.float32)
    K.loss_bwd_fp8(losses, lse, q8, meta, z, t, np.float32(0.125), fmt, rounding="nearest")
    zt = torch.from_numpy(z)
    ce = torch.nn.functional.cross_entropy(zt, torch.from_numpy(t), reduction="none").numpy()
    np.testing.assert_allclose(losses, ce, rtol=1e-12)
    np.testing.assert_allclose(lse, torch.logsumexp(zt, -1).numpy(), rtol=1e-12)
    g = torch.softmax(zt, -1).numpy()
    g[np.arange(41), t] -= 1.0
    k = {"e4m3": 8, "e5m2": 15}[fmt]
    assert K.fp8_bound_scale(fmt) == (2.0 ** k, 2.0 ** -k)
    want = torch_round(g * 2.0 ** k, fmt)
    np.testing.assert_array_equal(K.fp8_decode(q8, fmt), want)
    assert meta[1] == np.float32(0.125 * 2.0 ** -k)
    assert (q8 != 0).mean() > 0.5  # most of dlogits survives the scale (not all flushed to zero)


def grid_neighbours(y, fmt):
    """The grid values just below and just above |y| (equal where |y| is on the grid), signed as y:
    found in the list of every finite non-negative value of the format (fp8_decode of each byte)."""
    y = np.asarray(y, np.float32)
    grid = K.fp8_decode(np.arange(128, dtype=np.uint8), fmt).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid)])
    a = np.abs(y).astype(np.float64)
    hi = grid[np.minimum(np.searchsorted(grid, a, side="left"), grid.size - 1)]
    lo = grid[np.maximum(np.searchsorted(grid, a, side="right") - 1, 0)]
    return np.copysign(lo, y), np.copysign(hi, y)


@pytest.mark.parametrize("fmt", FMTS)
def test_stochastic_rounding_takes_a_neighbour_with_its_probability(fmt):
    """fp8_round_stochastic over all 2^16 random values u: on-grid values stay; any other value goes
    to the grid value below or above it, the one above for exactly floor(frac * 2^16) of the u
    (frac = how far it lies between them), so its mean is the value to 2^-16 of a quantum; from
    the subnormals (and below the smallest one, where nearest gives 0) to the top binade. Below
    2^emin, |v| counts as float32(|v| + 2^emin) - 2^emin, the sum that finds its quantum."""
    rng = np.random.default_rng(5)
    M, bias, top = K.FP8_FORMATS[fmt]
    y = np.concatenate([K.fp8_round(rng.normal(0, 4, 12), fmt),  # on the grid
                        rng.normal(0, 1, 12) * np.exp2(rng.integers(-2 - bias - M, 7, 12)),
                        [2.0 ** (1 - bias - M) * 0.3, -2.0 ** (1 - bias - M) * 0.01, 200.0,
                         2.0 ** (1 - bias) * (1 - 2.0 ** -20), 2.0 ** (1 - bias - M) * (3 + 2.0 ** -18)]]
                       ).astype(np.float32)
    u = np.arange(65536)
    for v in y:
        r = K.fp8_round_stochastic(np.full(u.shape, v, np.float32), u, fmt).astype(np.float64)
        lo, hi = (float(b) for b in grid_neighbours(v, fmt))
        assert set(np.unique(r)) <= {lo, hi}, (v, lo, hi, np.unique(r))
        if lo == hi:
            assert np.all(r == v)
            continue
        a = abs(float(v))
        if a < 2.0 ** (1 - bias):  # the subnormals: |v| as the float sum with 2^emin rounds it
            a = float(np.float32(a) + np.float32(2.0 ** (1 - bias))) - 2.0 ** (1 - bias)
        frac = (a - abs(lo)) / abs(hi - lo)
        assert (r == hi).sum() == np.floor(frac * 65536), (v, frac)
        assert np.all(np.diff(np.abs(r)) >= 0)  # the larger u, the further from zero
        assert abs(r.mean() - v) <= abs(hi - lo) * 2.0 ** -16 + 1e-30
    assert K.fp8_round_stochastic(np.float32(np.nan), 0, fmt)[()] != K.fp8_round_stochastic(np.float32(np.nan), 0, fmt)[()]


def test_sr_bits_are_a_function_of_the_logits_and_the_row():
    """fp8_sr_bits: the same logits give the same bits (and the same in chunks: row0), a change of
    one logit by one unit changes the bits of its group of 16 bytes only, equal rows draw different
    bits, and the bits are spread evenly over 16 bits."""
    rng = np.random.default_rng(6)
    z = rng.normal(0, 2, (64, 333)).astype(np.float16)  # 2 bytes an element, as bf16 (no ml_dtypes needed)
    b = K.fp8_sr_bits(z)
    assert b.shape == z.shape and b.max() < 65536
    np.testing.assert_array_equal(b, K.fp8_sr_bits(z.copy()))
    np.testing.assert_array_equal(b[40:], K.fp8_sr_bits(z[40:], row0=40))
    z2 = z.copy()
    z2.view(np.uint16)[3, 20] += 1
    changed = np.argwhere(K.fp8_sr_bits(z2) != b)
    assert set(map(tuple, changed)) <= {(3, j) for j in range(16, 24)} and len(changed) >= 6
    same = np.repeat(z[:1], 4, axis=0)
    bs = K.fp8_sr_bits(same)
    assert all((bs[i] != bs[0]).mean() > 0.99 for i in range(1, 4))
    assert abs(b.mean() / 65535 - 0.5) < 0.01
    hist = np.bincount(b.ravel() >> 12, minlength=16) / b.size
    assert np.all(np.abs(hist - 1 / 16) < 0.01), hist
    f32 = K.fp8_sr_bits(z.astype(np.float32))  # 4 bytes an element: groups of 4
    assert f32.shape == z.shape and not np.array_equal(f32, b)


def test_stochastic_dlogits_keep_the_small_probabilities():
    """E4M3 dlogits with the bound's scale 2^8: probabilities under 2^-18 round to 0 to nearest,
    so their push on the logits is lost; rounded stochastically the sum of the many small entries
    is kept (within 3%), and each element is one of its two grid neighbours."""
    rng = np.random.default_rng(8)
    R, V = 64, 1024
    z = np.full((R, V), -14.0) + rng.normal(0, 0.05, (R, V))
    t = rng.integers(0, V, R)
    z[np.arange(R), t] = 0.0
    z = z.astype(np.float32)
    out = {}
    for rounding in ("nearest", "stochastic"):
        q8, meta = np.zeros((R, V), np.uint8), np.zeros(2, np.float32)
        K.loss_bwd_fp8(np.zeros(R), np.zeros(R), q8, meta, z, t, 1.0, "e4m3", rounding=rounding)
        out[rounding] = K.fp8_decode(q8, "e4m3").astype(np.float64) / 256
    zz = z.astype(np.float64)
    g = np.exp(zz - np.log(np.exp(zz).sum(1, keepdims=True)))
    tail = np.ones((R, V), bool)
    tail[np.arange(R), t] = False
    assert g[tail].max() < 2.0 ** -18
    assert np.all(out["nearest"][tail] == 0)
    assert abs(out["stochastic"][tail].sum() / g[tail].sum() - 1) < 0.03
    g[np.arange(R), t] -= 1.0
    lo, hi = grid_neighbours((g * 256).astype(np.float32), "e4m3")
    s = out["stochastic"] * 256
    assert np.all((s == lo) | (s == hi))


def dlogits_on_grid(g, scale, fmt, rounding, logits):
    """The FP8 values of dlogits g times the bound's scale: rounded to nearest, or stochastically
    with the random bits of the workspace's logits."""
    y = (g * float(scale)).astype(np.float32)
    if rounding == "stochastic":
        y = K.fp8_round_stochastic(y, K.fp8_sr_bits(logits), fmt)
    return K.fp8_decode(K.fp8_encode(K.fp8_round(y, fmt), fmt), fmt)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt,tol", [("e4m3", 0.08), ("e5m2", 0.15)])
@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "write"])
def test_fp8_classifier_against_autograd(fmt, tol, accumulate, rounding):
    """k_fp8_loss_bwd against PyTorch autograd of dloss * sum(cross-entropy) over the
    FP8-rounded operands (float64): the same losses; gradients that differ from autograd's only by
    dlogits' quantisation, each element of dinp and dwte within the bound |dq - g| @ |w| (and
    |dq - g|.T @ |x|) of what the rounding of dlogits can change, and the whole within tol; in
    chunks of R rows (2 here) as one chunk. k_fp8_loss_fwd gives the same losses and lse. Rounded
    stochastically, each dlogit is within one step of the grid of its value."""
    rng = np.random.default_rng(2)
    x, w, t = classifier_case(rng)
    N, C = x.shape
    V = w.shape[0]
    dloss = 1.0 / N
    xf, wf = K.fp8_fake(x, K.FP8_FWD), K.fp8_fake(w, K.FP8_FWD)
    xt = torch.from_numpy(xf).requires_grad_()
    wt = torch.from_numpy(wf).requires_grad_()
    ce = torch.nn.functional.cross_entropy(xt @ wt.T, torch.from_numpy(t), reduction="none")
    (ce.sum() * dloss).backward()
    g = torch.softmax(torch.from_numpy(xf @ wf.T), -1).numpy()
    g[np.arange(N), t] -= 1.0
    scale, inv = K.fp8_bound_scale(fmt)
    dq = dlogits_on_grid(g, scale, fmt, rounding, xf @ wf.T) * float(inv) * dloss
    err = np.abs(dq - g * dloss)
    lo, hi = grid_neighbours((g * float(scale)).astype(np.float32), fmt)
    assert np.all(err <= np.abs(hi - lo) * float(inv) * dloss * (1 if rounding == "stochastic" else 0.5) + 1e-15)
    base = rng.normal(0, 1, (N, C))
    out = {}
    for R in (2, N):
        losses, lse, dinp, dwte = np.zeros(N), np.zeros(N), base.copy(), np.zeros((V, C))
        K.k_fp8_loss_bwd(losses, lse, dinp, dwte, np.zeros((R, V)), x, w, t, dloss, fmt, accumulate, rounding=rounding)
        out[R] = losses, dinp, dwte
        np.testing.assert_allclose(losses, ce.detach().numpy(), rtol=1e-10)
        want_dx = xt.grad.numpy() + (base if accumulate else 0)
        assert np.all(np.abs(dinp - want_dx) <= err @ np.abs(wf) + 1e-12)
        assert np.all(np.abs(dwte - wt.grad.numpy()) <= err.T @ np.abs(xf) + 1e-12)
        r = np.linalg.norm(dwte - wt.grad.numpy()) / np.linalg.norm(wt.grad.numpy())
        assert 0 < r < tol, r
        lf, lsef = np.zeros(N), np.zeros(N)
        K.k_fp8_loss_fwd(lf, lsef, np.zeros((R, V)), x, w, t)
        np.testing.assert_allclose(lf, losses, rtol=1e-12)
    for a, b in zip(out[2], out[N]):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    # fp8_logits=False: the logits of the unquantised operands, the backward's products as above
    losses, lse, dinp, dwte = np.zeros(N), np.zeros(N), base.copy(), np.zeros((V, C))
    K.k_fp8_loss_bwd(losses, lse, dinp, dwte, np.zeros((N, V)), x, w, t, dloss, fmt, accumulate, fp8_logits=False,
                     rounding=rounding)
    z = x.astype(np.float64) @ w.astype(np.float64).T
    ce = torch.nn.functional.cross_entropy(torch.from_numpy(z), torch.from_numpy(t), reduction="none").numpy()
    np.testing.assert_allclose(losses, ce, rtol=1e-10)
    g = torch.softmax(torch.from_numpy(z), -1).numpy()
    g[np.arange(N), t] -= 1.0
    inv_dl = float(np.float32(dloss * float(inv)))  # the float32 1/scale the products get
    dq = dlogits_on_grid(g, scale, fmt, rounding, z).astype(np.float64) * inv_dl
    np.testing.assert_allclose(dinp, dq @ wf + (base if accumulate else 0), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(dwte, dq.T @ xf, rtol=1e-10, atol=1e-14)
    q = np.arange(12, dtype=np.uint8).reshape(3, 4)
    qt = np.zeros((4, 3), np.uint8)
    K.k_fp8_transpose(qt, q)
    np.testing.assert_array_equal(qt, q.T)


def test_memory_plan_and_workspace_of_the_fp8_classifier():
    """With the classifier in FP8 the weight cache holds wte (V, C) first and its copies grow by
    2 x V x C bytes (aligned); the workspace rows add one chunk's FP8 dlogits (R x V), the chunk's
    input in both forms (R x C each) and room for wte in fp8_w. Where V or B*T is no multiple of
    16 the classifier stays in bf16 (fp8_classifier_runs False) and nothing is added."""
    from andrea.backends.cuda.fp8 import classifier_in_fp8, fp8_rows
    from andrea.pipeline.compose import compose_config
    from andrea.core.engine import fp8_cached_weights, fp8_classifier_runs, make_plan
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
    rows = {name: int(np.prod(shape)) for name, shape, _ in fp8_rows(8, cfg.train.seq_len, m.d_model, m.vocab_size)}
    plain = {name: int(np.prod(shape)) for name, shape, _ in fp8_rows(8, cfg.train.seq_len, m.d_model)}
    assert rows["fp8_dz"] == R * m.vocab_size and rows["fp8_cx"] == rows["fp8_cxt"] == R * m.d_model
    assert rows["fp8_w"] == wte > plain["fp8_w"] and not {"fp8_dz", "fp8_cx", "fp8_cxt"} & set(plain)
    assert not classifier_in_fp8(N, 50257) and classifier_in_fp8(N, 50304) and not classifier_in_fp8(8200, 50304)
    odd = compose_config("ANDREA-tiny", ["train.precision=fp8", "model.vocab_size=97"])
    assert not fp8_classifier_runs(odd, True)


def test_fp8_classifier_settings_in_the_run_config():
    """train.fp8_classifier / fp8_dlogits / fp8_dlogits_rounding: checked (clear errors naming the field), handed to
    the backend by the engine where set, and part of the config hash only where set, so every run
    made before they existed hashes (and resumes) as before."""
    import hashlib
    import json
    from types import SimpleNamespace

    from andrea.pipeline.compose import compose_config
    from andrea.config import config_hash, to_dict
    from andrea.core.engine import apply_fp8_settings
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
    be = SimpleNamespace(fp8_classifier=0, fp8_dlogits="e4m3", fp8_dlogits_rounding="stochastic")
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


# ---------------------------------------------------------------- delayed scaling (act and dact)
def test_delayed_roll_moves_the_history_unless_skipped():
    """k_fp8_delayed_roll: a step taken puts [1] (the step's amax) first in the history and drops
    the oldest of 16; [0] is then the history's largest and [1] zero. A skipped step, or a
    non-finite amax, moves nothing (and still makes [0] the history's largest, [1] zero)."""
    H = K.FP8_HIST
    rows = np.zeros((3, 64), np.float32)
    rows[:, 2:2 + H] = np.arange(1, H + 1, dtype=np.float32)[::-1]  # newest (16) first
    rows[:, 1] = [0.5, np.inf, np.nan]
    r = rows.copy()
    K.k_fp8_delayed_roll(r, skipped=False)
    assert list(r[0, 2:2 + H]) == [0.5] + list(range(H, 1, -1)), r[0]
    np.testing.assert_array_equal(r[1:, 2:2 + H], rows[1:, 2:2 + H])  # inf, NaN: not entered
    assert list(r[:, 0]) == [H, H, H] and not r[:, 1].any()
    r = rows.copy()
    K.k_fp8_delayed_roll(r, skipped=True)
    np.testing.assert_array_equal(r[:, 2:], rows[:, 2:])
    assert list(r[:, 0]) == [H] * 3 and not r[:, 1].any()
    r = np.zeros((1, 64), np.float32)  # an empty history: 16 steps fill it, the 17th drops the first
    for step in range(1, H + 2):
        r[0, 1] = step
        K.k_fp8_delayed_roll(r, skipped=False)
        assert r[0, 0] == step
    assert list(r[0, 2:2 + H]) == list(range(H + 1, 1, -1))
    r[0, 2:2 + H] = 0
    r[0, 5] = 3.0
    r[0, 0] = r[0, 1] = 7.0
    K.k_fp8_delayed_roll(r, skipped=True)
    assert r[0, 0] == 3.0 and r[0, 1] == 0 and r[0, 2] == 0


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_delayed_passes_are_the_current_ones(dtype):
    """The reference of the delayed passes: k_fp8_gelu_cast_transpose_amax is
    k_fp8_gelu_cast_transpose plus act's amax (into a larger value already there: kept);
    k_fp8_dgelu_cast_transpose_colsum_amax is dact * gelu'(pre) in dact's dtype (as
    k_fp8_dgelu_colsum_amax makes it), then k_fp8_cast_transpose_colsum with the given scale, and
    its amax; dact is not written. gelu' against PyTorch autograd."""
    rng = np.random.default_rng(8)
    R, Kc = 80, 48
    pre = (rng.standard_normal((R, Kc)) * 2).astype(dtype)
    dact = (rng.standard_normal((R, Kc)) * 1e-2).astype(dtype)
    meta = np.array([3.0, 0], np.float32)
    o, ot = np.zeros((R, Kc), np.uint8), np.zeros((Kc, R), np.uint8)
    amax = np.array([1e6], np.float32)
    K.k_fp8_gelu_cast_transpose_amax(o, ot, meta, pre, "e4m3", amax)
    o2, ot2, m2 = np.zeros_like(o), np.zeros_like(ot), np.array([3.0, 0], np.float32)
    K.k_fp8_gelu_cast_transpose(o2, ot2, m2, pre, "e4m3")
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(ot, ot2)
    assert amax[0] == 1e6
    amax[0] = 0
    K.k_fp8_gelu_cast_transpose_amax(None, ot, meta, pre, "e4m3", amax)
    ga = np.zeros(2, np.float32)
    K.k_fp8_gelu_amax(ga, pre)
    assert amax[0] == ga[0] > 0
    kept = dact.copy()
    part, amax = np.zeros((2, Kc), np.float32), np.zeros(1, np.float32)
    meta = np.array([0.01, 0], np.float32)
    K.k_fp8_dgelu_cast_transpose_colsum_amax(o, ot, meta, dact, pre, "e5m2", part, amax)
    np.testing.assert_array_equal(dact, kept)
    d = dact.copy()
    db, dm = np.zeros(Kc), np.zeros(2, np.float32)
    K.k_fp8_dgelu_colsum_amax(db, dm, d, pre)  # in place: the new dact
    import torch
    p = torch.tensor(pre.astype(np.float64), requires_grad=True)
    torch.nn.functional.gelu(p, approximate="tanh").backward(torch.tensor(dact.astype(np.float64)))
    np.testing.assert_allclose(d.astype(np.float64), p.grad.numpy(), rtol=2e-3, atol=1e-7)
    o2, ot2, p2, m2 = np.zeros_like(o), np.zeros_like(ot), np.zeros_like(part), np.array([0.01, 0], np.float32)
    K.k_fp8_cast_transpose_colsum(o2, ot2, m2, d.astype(np.float32), "e5m2", p2)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(ot, ot2)
    np.testing.assert_array_equal(part, p2)
    np.testing.assert_array_equal(meta, m2)
    assert amax[0] == dm[0] and (K.fp8_decode(o, "e5m2") == 57344).any(), "a small scale saturates"
    x = d.astype(np.float32)  # the plain casts with an amax
    for colsum in (False, True):
        o3, ot3, p3, a3 = np.zeros_like(o), np.zeros_like(ot), np.zeros_like(part), np.array([0.0], np.float32)
        m3 = np.array([0.01, 0], np.float32)
        if colsum:
            K.k_fp8_cast_transpose_colsum_amax(o3, ot3, m3, x, "e5m2", p3, a3)
            np.testing.assert_array_equal(p3, p2)
        else:
            K.k_fp8_cast_transpose_amax(o3, ot3, m3, x, "e5m2", a3)
        np.testing.assert_array_equal(o3, o2)
        np.testing.assert_array_equal(ot3, ot2)
        assert a3[0] == dm[0]


def test_memory_plan_and_state_of_the_delayed_scales():
    """fp8_delayed plans a 64-float row for each of eight tensors a layer (group "fp8 delayed
    scales"; five without input slots: the three inputs keep current scaling), nothing else changed; EngineState keeps the amax history in the sidecar's fields only
    where there is one, and from_checkpoint takes it from the sidecar (not from the engine's
    defaults: a checkpoint without one starts over)."""
    from types import SimpleNamespace

    from andrea.pipeline.compose import compose_config
    from andrea.core.engine import EngineState, make_plan
    cfg = compose_config("ANDREA-120M", ["train.precision=fp8", "train.batch_size=8"])
    on, off = make_plan(cfg, fp8_delayed=True), make_plan(cfg)
    assert on.by_group()["fp8 delayed scales"] == 8 * 12 * 64 * 4
    no_slots = make_plan(cfg, fp8_delayed=True, fp8_keep_xt=False, fp8_producer_amax=False)
    assert no_slots.by_group()["fp8 delayed scales"] == 5 * 12 * 64 * 4  # the three inputs: current
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


@pytest.mark.parametrize("residual", [False, True], ids=["layernorm", "residual_layernorm"])
def test_layernorm_fwd_fp8_reference(residual):
    """numpy_ref.k_layernorm_fwd_fp8 (odd sizes): res, mean and rstd as the layer norm writes them;
    its bytes the E4M3 rounding of the layer norm's output times the scale of meta[0] (saturating
    at 448 for a smaller one), out_t their transpose, meta[1] the inverse scale; amax_out the
    largest |output| where that is more than what it held, else unchanged."""
    rng = np.random.default_rng(11)
    N, C = 13, 37
    a, b = rng.normal(0, 2, (N, C)).astype(np.float32), rng.normal(0, 1, (N, C)).astype(np.float32)
    w, bias = rng.normal(1, 0.5, C).astype(np.float32), rng.normal(0, 0.1, C).astype(np.float32)
    x = a + b if residual else a
    mu = x.mean(axis=1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w + bias
    top = np.float32(np.abs(y).max())
    for shrink, held in ((1.0, 0.0), (0.25, 1e6)):
        out, out_t, res = np.zeros((N, C), np.uint8), np.zeros((C, N), np.uint8), np.zeros((N, C), np.float32)
        mean, rstd = np.zeros(N, np.float32), np.zeros(N, np.float32)
        meta, amax = np.array([top * shrink, 0], np.float32), np.array([held], np.float32)
        K.k_layernorm_fwd_fp8(out, out_t, res, mean, rstd, a, b if residual else None, w, bias, meta, amax)
        scale, inv = K.fp8_scale(meta[0], "e4m3")
        assert meta[1] == inv
        np.testing.assert_array_equal(out_t, out.T)
        np.testing.assert_allclose(K.fp8_decode(out, "e4m3"), K.fp8_round(y * scale, "e4m3"), rtol=0, atol=1e-6)
        np.testing.assert_allclose(mean, mu[:, 0], rtol=1e-5, atol=1e-6)
        if residual:
            np.testing.assert_array_equal(res, x)
        else:
            assert not res.any(), "res written without a residual"
        if held:
            assert amax[0] == np.float32(held) and (K.fp8_decode(out, "e4m3") == 448).any()
        else:
            np.testing.assert_allclose(amax[0], top, rtol=1e-6)


@pytest.mark.parametrize("fmt", FMTS)
def test_attention_fp8_references(fmt):
    """numpy_ref.k_attn_fwd_fp8 and k_attn_bwd_fp8 (odd sizes, rows past a whole tile): out and
    lse as k_attn_fwd writes them; the bytes the rounding of out (E4M3), or of dqkv as k_attn_bwd
    writes it (fmt), times the scale of meta[0], q_t their transpose, meta[1] the inverse scale,
    amax_out the largest |value|; the backward's partials the column sums of dqkv over each tile
    of 64 rows (float32 order: close to the float64 sums), none with partial None."""
    rng = np.random.default_rng(5)
    B, T, NH, hs = 2, 75, 3, 5
    C, N = NH * hs, B * T
    qkv = rng.normal(0, 1, (B, T, 3 * C)).astype(np.float32)
    out, lse = np.zeros((B, T, C), np.float32), np.zeros((B, NH, T), np.float32)
    K.k_attn_fwd(out, lse, qkv, NH)
    dout = rng.normal(0, 1, (B, T, C)).astype(np.float32)
    dqkv = np.zeros_like(qkv)
    K.k_attn_bwd(dqkv, dout, qkv, out, lse, NH, accumulate=False)
    for name, x, f in (("fwd", out.reshape(N, C), "e4m3"), ("bwd", dqkv.reshape(N, 3 * C), fmt)):
        top = np.float32(np.abs(x).max())
        R, W = x.shape
        q, q_t = np.zeros((R, W), np.uint8), np.zeros((W, R), np.uint8)
        meta, amax = np.array([top, 0], np.float32), np.zeros(1, np.float32)
        partial = np.full((-(-R // 64), W), np.nan, np.float32)
        if name == "fwd":
            o2, l2 = np.zeros_like(out), np.zeros_like(lse)
            K.k_attn_fwd_fp8(o2, l2, q, q_t, meta, amax, qkv, NH)
            np.testing.assert_array_equal(o2, out)
            np.testing.assert_array_equal(l2, lse)
        else:
            K.k_attn_bwd_fp8(q, q_t, partial, meta, amax, dout, qkv, out, lse, NH, f)
            sums = np.add.reduceat(x.astype(np.float64), np.arange(0, R, 64), axis=0)
            np.testing.assert_allclose(partial, sums, rtol=1e-5, atol=1e-5 * np.abs(x).max())
            q2, amax2 = np.zeros_like(q), np.zeros(1, np.float32)
            K.k_attn_bwd_fp8(q2, None, None, meta.copy(), amax2, dout, qkv, out, lse, NH, f)
            np.testing.assert_array_equal(q2, q)
        scale, inv = K.fp8_scale(top, f)
        assert meta[1] == inv and amax[0] == top, name
        np.testing.assert_array_equal(q_t, q.T)
        np.testing.assert_allclose(K.fp8_decode(q, f), K.fp8_round(x * scale, f), rtol=0, atol=1e-6)


def test_load_checkpoint_starts_another_sets_history_over(tmp_path, capsys):
    """Engine.load_checkpoint with delayed scales (an engine of 8 rows stood in for: an fp8 engine
    needs a GPU): a sidecar history of 6 well-formed rows (a checkpoint of a version with another
    set of delayed scales) is dropped with a message naming the sidecar, and the state loads
    without it; 8 rows load as they are; 8 rows with a NaN are refused with a CheckpointError
    naming the sidecar and the field, before anything is loaded."""
    from types import SimpleNamespace

    from andrea.core.checkpoint import CheckpointError, write_checkpoint
    from andrea.core.engine import Engine, EngineState
    n = 5
    z = np.zeros(n, np.float32)
    loaded = []
    eng = SimpleNamespace(layout=SimpleNamespace(n_params=n), fp8_delayed=True,
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
