"""FP8 (train.precision=fp8): the number formats, scales, rounding, encoding and the quantisation
kernels of kernels/fp8.cu (amax, casts, transposes, their forms over many tensors, the delayed
scales' roll, the passes over the MLP's act and dact). The FP8 forms of the layers live beside
their 16-bit forms (layernorm.py, linear.py, attention.py, mlp.py, loss.py, optim.py).

The linear layers' matrix products with FP8 operands (kernels/fp8.cu, cuda/fp8/; docs/FP8.md).
A tensor x is quantised with one scale for the whole tensor, taken from its own amax (current
scaling): scale = 2^k, the largest power of two with amax * scale <= the format's largest value,
and q = fp8(x * scale), rounded to nearest even and saturated to the largest finite value. The
product runs on q (exact in float32 accumulation terms) and is multiplied back by 1/scale of each
operand (exact: powers of two). Each tensor's (amax, 1/scale) pair is its "meta", a float32 (2,).
The formats and defaults (FP8_FORMATS, FP8_FWD, ...) and FP8_HIST are interface.py's.
"""
from __future__ import annotations

import numpy as np

from ..interface import FP8_FORMATS, FP8_HIST
from .gelu import _act, _dgelu

FP8_MAX_SHIFT = 126  # |log2 scale| at most this: 2^k and 2^-k stay normal float32 numbers


# ---------------------------------------------------------------- formats, scales, rounding


def _fp8_format(fmt):
    if fmt not in FP8_FORMATS:
        raise ValueError(f"FP8 format {fmt!r}: expected one of {', '.join(FP8_FORMATS)}")
    return FP8_FORMATS[fmt]


def fp8_scale(amax, fmt):
    """(scale, 1/scale) as float32 for a tensor of this amax: scale = 2^k with k the largest
    integer such that amax * 2^k <= the format's largest value (|k| <= FP8_MAX_SHIFT); 1 for an
    all-zero tensor; NaN for a non-finite amax (the step then becomes non-finite and is skipped).
    Read from the float32 bits of amax, as the CUDA kernels do."""
    M, bias, top = _fp8_format(fmt)
    top_exp = int(np.floor(np.log2(top)))  # 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15
    u = int(np.asarray(amax, dtype=np.float32).view(np.uint32)) & 0x7FFFFFFF
    if u >= 0x7F800000:
        return np.float32(np.nan), np.float32(np.nan)
    if u == 0:
        return np.float32(1.0), np.float32(1.0)
    e = (u >> 23) - 127  # amax = 1.m * 2^e (a subnormal amax clamps below anyway)
    k = top_exp - e - (1 if (u & 0x7FFFFF) > 0x600000 else 0)  # mantissa above 1.75: one less
    k = max(-FP8_MAX_SHIFT, min(FP8_MAX_SHIFT, k))
    return np.float32(2.0 ** k), np.float32(2.0 ** -k)


def fp8_round(y, fmt):
    """float32 values of fp8(y): round to nearest even on the format's grid (normal and
    subnormal), saturated to +-largest finite value (infinities too); NaN stays NaN."""
    M, bias, top = _fp8_format(fmt)
    y = np.asarray(y, dtype=np.float32)
    a = np.abs(y).astype(np.float64)
    emin = 1 - bias
    with np.errstate(divide="ignore", invalid="ignore"):
        _, E = np.frexp(a)  # a = f * 2^E, f in [0.5, 1)
    e = np.maximum(E.astype(np.int64) - 1, emin)  # subnormals share the quantum of the smallest binade
    quantum = np.ldexp(1.0, e - M)
    with np.errstate(invalid="ignore"):
        q = np.minimum(np.rint(a / quantum) * quantum, top)  # np.rint: half to even
    q = np.where(np.isnan(a), np.nan, q)
    return np.copysign(q, y).astype(np.float32)


def fp8_round_stochastic(y, u, fmt):
    """float32 values of y rounded stochastically onto the format's grid, as fp8.cuh's
    fp8_round_stochastic does it on the float's bits (u: 16 random bits an element, same shape).
    With drop = 23 - M mantissa bits the format drops and r = u << (drop - 16):
    |y| >= 2^emin: (bits(|y|) + r) with the dropped bits cleared, i.e. the grid value above for
    floor(frac * 2^16) of the 2^16 values of u; below: the same on s = float32(|y| + 2^emin), then
    s - 2^emin (the subnormals' fixed quantum). Sign kept; beyond the largest value not clamped
    (fp8_round after it saturates); infinities and NaN pass."""
    M, bias, top = _fp8_format(fmt)
    y = np.asarray(y, dtype=np.float32)
    drop = 23 - M
    keep = np.uint32((~((1 << drop) - 1)) & 0xFFFFFFFF)
    r = ((np.asarray(u).astype(np.uint64) & 0xFFFF) << np.uint64(drop - 16)).astype(np.uint32)
    lo = np.float32(2.0 ** (1 - bias))
    bits = y.view(np.uint32)
    a = bits & np.uint32(0x7FFFFFFF)
    with np.errstate(over="ignore", invalid="ignore"):
        s = (a.view(np.float32) + lo).astype(np.float32)
        sub = (((s.view(np.uint32) + r) & keep).view(np.float32) - lo).astype(np.float32)
        out = np.where(a >= np.uint32((127 + 1 - bias) << 23), (a + r) & keep, sub.view(np.uint32))
    out = (out.astype(np.uint32) | (bits & np.uint32(0x80000000))).view(np.float32)
    return np.where(a >= np.uint32(0x7F800000), y, out).astype(np.float32)


def fp8_encode(v, fmt):
    """The fp8 bytes (uint8) of values already on the grid (fp8_round's output). NaN is 0x7F."""
    M, bias, top = _fp8_format(fmt)
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v).astype(np.float64)
    sign = np.signbit(v).astype(np.uint8) << 7
    emin = 1 - bias
    with np.errstate(divide="ignore", invalid="ignore"):
        _, E = np.frexp(a)
    normal = a >= 2.0 ** emin
    e = np.where(normal, E.astype(np.int64) - 1, emin)
    mant = np.where(normal, a / np.ldexp(1.0, e) - 1.0, a / np.ldexp(1.0, emin)) * (1 << M)
    mant = np.nan_to_num(mant)
    field = np.where(normal, e + bias, 0)
    bits = (field.astype(np.int64) << M) | np.rint(mant).astype(np.int64)
    bits = np.where(np.isnan(a), 0x7F, bits).astype(np.uint8)
    return np.where(np.isnan(a), bits, bits | sign).astype(np.uint8)


def fp8_decode(bits, fmt):
    """float32 values of fp8 bytes (NaN encodings to NaN; E5M2's infinities to inf)."""
    M, bias, top = _fp8_format(fmt)
    b = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    field, mant = (b >> M) & ((1 << (7 - M)) - 1), b & ((1 << M) - 1)
    emin = 1 - bias
    mag = np.where(field == 0, np.ldexp(mant.astype(np.float64), emin - M),
                   np.ldexp(1.0 + mant / (1 << M), field - bias))
    top_field = (1 << (7 - M)) - 1
    if fmt == "e4m3":  # E4M3 ("fn"): no infinities, S.1111.111 is NaN
        mag = np.where((field == top_field) & (mant == (1 << M) - 1), np.nan, mag)
    else:  # E5M2: IEEE-like, the top exponent holds inf and NaN
        mag = np.where(field == top_field, np.where(mant == 0, np.inf, np.nan), mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


def fp8_fake(x, fmt):
    """x as the FP8 product sees it: fp8(x * scale) / scale with x's own scale, in float64."""
    meta = np.zeros(2, dtype=np.float32)
    k_fp8_amax(meta, x)
    q = _fp8_quantise(meta, x, fmt)
    return fp8_decode(q, fmt).astype(np.float64) * float(meta[1])


# ---------------------------------------------------------------- amax, casts, transposes


def k_fp8_amax(meta, x):
    """meta[0] = max |x| over the whole tensor (float32; NaN if any element is NaN)."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    meta[0] = np.nan if np.isnan(a).any() else (a.max() if a.size else 0.0)


def _fp8_quantise(meta, x, fmt):
    scale, inv = fp8_scale(meta[0], fmt)
    meta[1] = inv
    return fp8_encode(fp8_round(np.asarray(x, dtype=np.float32) * scale, fmt), fmt)


def k_fp8_cast(out, meta, x, fmt):
    """out (uint8, x's shape) = fp8 bytes of x * scale, scale from meta[0] (k_fp8_amax);
    meta[1] = 1/scale, what the product multiplies back."""
    out[...] = _fp8_quantise(meta, x, fmt)


def k_fp8_cast_transpose(out, out_t, meta, x, fmt):
    """As k_fp8_cast for x (R, K), writing out (R, K) and/or out_t (K, R), its transpose (either
    may be None): the backward pass's operands must be contiguous along the summed axis."""
    q = _fp8_quantise(meta, x, fmt)
    if out is not None:
        out[...] = q
    if out_t is not None:
        out_t[...] = q.T


def fp8_tile_colsum(x, tile_rows=64):
    """The column sums of x (R, K) over each tile of tile_rows rows, (ceil(R / tile_rows), K)
    float32, in k_fp8_cast_transpose_colsum's order (fp8.cu fp8_tile_colsum_warps): row 32h + 4w + l
    of a tile (h < tile_rows / 32, warp w < 8, l < 4) goes to a_wl = x_0 + x_1 + ... over h, then
    s_w = (a_w0 + a_w1) + (a_w2 + a_w3), then s_0 + s_1 + ... + s_7. Rows past R add zeros."""
    x = np.asarray(x, dtype=np.float32)
    R, K = x.shape
    if tile_rows % 32:
        raise ValueError(f"fp8_tile_colsum: tile_rows = {tile_rows}; expected a multiple of 32")
    n = -(-R // tile_rows)
    xp = np.zeros((n * tile_rows, K), np.float32)
    xp[:R] = x
    t = xp.reshape(n, tile_rows // 32, 8, 4, K)  # (tile, h, w, l, K): row = 32h + 4w + l
    a = np.zeros((n, 8, 4, K), np.float32)
    for h in range(tile_rows // 32):
        a = a + t[:, h]
    s = (a[:, :, 0] + a[:, :, 1]) + (a[:, :, 2] + a[:, :, 3])
    out = s[:, 0]
    for w in range(1, 8):
        out = out + s[:, w]
    return out


def k_fp8_cast_transpose_colsum(out, out_t, meta, x, fmt, partial, tile_rows=64):
    """k_fp8_cast_transpose of x (R, K), and partial (ceil(R / tile_rows), K) float32 = the column
    sums of x over each tile of tile_rows rows (fp8_tile_colsum's order): a bias gradient's first
    pass, made by the cast of its dY."""
    k_fp8_cast_transpose(out, out_t, meta, x, fmt)
    partial[...] = fp8_tile_colsum(x, tile_rows).reshape(np.shape(partial))


def k_fp8_amax_many(meta, xs):
    """Many tensors at once (the FP8 copies of the weights, cuda/fp8/): meta (n, 2m) float32 =
    0, then meta[t, 0] = max |xs[t]| (k_fp8_amax of each)."""
    meta[...] = 0
    for t, x in enumerate(xs):
        k_fp8_amax(meta[t], x)


def k_fp8_cast_transpose_many(outs, outs_t, meta, xs, fmt):
    """k_fp8_cast_transpose of each xs[t] (R, K) into outs[t] and/or outs_t[t] (an entry None
    skips it), scale from meta[t, 0], 1/scale into meta[t, m] (meta (n, 2m))."""
    m = meta.shape[1] // 2
    for t, x in enumerate(xs):
        pair = np.array([meta[t, 0], 0.0], dtype=np.float32)
        k_fp8_cast_transpose(outs[t], outs_t[t], pair, x, fmt)
        meta[t, m] = pair[1]


def k_fp8_transpose(out_t, x):
    """out_t (K, R) = x.T of fp8 bytes x (R, K): the FP8 dlogits as the weight gradient's product
    wants them (contiguous along the rows it sums over)."""
    out_t[...] = np.asarray(x).T


# ---------------------------------------------------------------- the MLP's act and dact


def k_fp8_gelu_amax(meta, pre):
    """meta[0] = max |act| (k_fp8_amax of act), act = gelu(pre) in pre's dtype: the FP8 MLP's
    amax of its second product's input, taken from pre without act being stored."""
    k_fp8_amax(meta, _act(pre))


def k_fp8_gelu_cast_transpose(out, out_t, meta, pre, fmt):
    """k_fp8_cast_transpose of act = gelu(pre) in pre's dtype (scale from meta[0]:
    k_fp8_gelu_amax), without act being stored."""
    k_fp8_cast_transpose(out, out_t, meta, _act(pre), fmt)


def k_fp8_dgelu_colsum_amax(db, meta, dact, pre):
    """The FP8 MLP's pass over dact (N.., H) after its product: dact *= gelu'(pre) (in dact's
    dtype), db (H,) += the column sums of the new dact, meta[0] = max |new dact| (k_fp8_amax)."""
    dact[...] = _dgelu(dact, pre)
    db += np.asarray(dact, np.float64).reshape(-1, np.shape(dact)[-1]).sum(axis=0)
    k_fp8_amax(meta, dact)


# ---------------------------------------------------------------- delayed scaling
# A delayed scale's row (interface.FP8_HIST): [0] the largest amax of the history, [1] the amax of
# the step under way, then the history; the kernel that makes a tensor casts it with the scale of
# [0] and reduces its amax into [1].


def _amax_into(amax_out, x):
    """amax_out[0] = max(amax_out[0], max |x|) (as the kernels' atomicMax on the float bits; NaN wins)."""
    if amax_out is None:
        return
    m = np.zeros(1, np.float32)
    k_fp8_amax(m, x)
    a = np.array([amax_out[0], m[0]], np.float32)
    amax_out[0] = np.nan if np.isnan(a).any() else a.max()


def k_fp8_cast_transpose_amax(out, out_t, meta, x, fmt, amax_out):
    """k_fp8_cast_transpose, and amax_out[0] = max(amax_out[0], max |x|) (None: not taken)."""
    k_fp8_cast_transpose(out, out_t, meta, x, fmt)
    _amax_into(amax_out, x)


def k_fp8_cast_transpose_colsum_amax(out, out_t, meta, x, fmt, partial, amax_out, tile_rows=64):
    """k_fp8_cast_transpose_colsum, and amax_out[0] = max(amax_out[0], max |x|) (None: not taken)."""
    k_fp8_cast_transpose_colsum(out, out_t, meta, x, fmt, partial, tile_rows)
    _amax_into(amax_out, x)


def k_fp8_gelu_cast_transpose_amax(out, out_t, meta, pre, fmt, amax_out):
    """k_fp8_gelu_cast_transpose, and amax_out[0] = max(amax_out[0], max |act|) (None: not taken)."""
    act = _act(pre)
    k_fp8_cast_transpose(out, out_t, meta, act, fmt)
    _amax_into(amax_out, act.astype(np.float32))


def k_fp8_dgelu_cast_transpose_colsum_amax(out, out_t, meta, dact, pre, fmt, partial, amax_out, tile_rows=64):
    """The FP8 MLP backward's pass with a delayed scale: d = dact * gelu'(pre) in dact's dtype, cast
    as k_fp8_cast_transpose_colsum casts it (scale from meta[0]; partial the tiles' column sums of
    d, None: not written) and amax_out[0] = max(amax_out[0], max |d|) (None: not taken). dact is
    not written."""
    d = _dgelu(dact, pre).astype(np.float32)
    k_fp8_cast_transpose(out, out_t, meta, d, fmt)
    if partial is not None:
        partial[...] = fp8_tile_colsum(d, tile_rows).reshape(np.shape(partial))
    _amax_into(amax_out, d)


def k_fp8_delayed_roll(rows, skipped):
    """The delayed scales' rows (n, >= 2 + FP8_HIST) float32 at the end of an optimizer step: unless
    the step was skipped or [1] is not finite, the history (columns 2..) moves one place and [1]
    enters it at 2; then [1] = 0 and [0] = the history's largest."""
    h = rows[:, 2:2 + FP8_HIST]
    if not skipped:
        ok = np.isfinite(rows[:, 1])
        h[ok] = np.concatenate([rows[ok, 1:2], h[ok, :-1]], axis=1)
    rows[:, 0] = np.abs(h).max(axis=1)
    rows[:, 1] = 0
