"""ref/fp8.py: the FP8 formats against PyTorch's float8 casts (rounding, every byte, scales), the
casts and transposes (one tensor, many, with column sums in the kernel's order), the passes over
the MLP's act and dact against PyTorch's GELU, stochastic rounding, and delayed scaling's roll
and passes (refkit's notes on PyTorch's casts)."""
import numpy as np
import pytest

from andrea.backends import ref as K
from refkit import FMTS, grid_neighbours, samples, torch_round

torch = pytest.importorskip("torch")
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


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
