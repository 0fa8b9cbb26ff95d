"""Shared helpers of the reference's tests (tests/ref/test_<op>.py, one file per ref/<op>.py).

Gradient checks: backward kernels against central finite differences, in float64. Sizes are
deliberately not powers of two (B=2, T=7, C=12, NH=3, V=37). Each check defines the scalar
objective L = sum(R * out) for a fixed random R, runs the backward kernel with dout = R into
gradient buffers pre-filled with random values (so the ADD contract is checked too), and compares
the added part with (L(x + h) - L(x - h)) / 2h on every element. Tolerance 1e-6 relative: with
h = 1e-5 in float64 the central difference's truncation error is O(h^2) ~ 1e-10 and its rounding
error ~ 1e-16 / h ~ 1e-11, both far below it.

FP8: PyTorch's `x.to(torch.float8_e4m3fn / float8_e5m2)` rounds to nearest even but does not
saturate, so the comparisons clamp to the largest finite value first (what a saturating cast
means). Sizes are odd (the reference takes any; the CUDA path needs multiples of 16 and says so).
"""
import numpy as np
import pytest

from andrea.backends import ref as K

B, T, C, NH, V = 2, 7, 12, 3, 37
H = 1e-5
TOL = 1e-6
FMTS = ["e4m3", "e5m2"]


# ---------------------------------------------------------------- finite differences
def rnd(rng, *shape, scale=1.0):
    return rng.normal(0, scale, shape).astype(np.float64)


def fd_grad(objective, x):
    """Central finite differences of objective() w.r.t. every element of x (perturbed in place)."""
    g = np.zeros_like(x)
    flat, gf = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + H
        lp = objective()
        flat[i] = orig - H
        lm = objective()
        flat[i] = orig
        gf[i] = (lp - lm) / (2 * H)
    return g


def check(name, analytic, numeric):
    err = np.linalg.norm(analytic - numeric) / max(np.linalg.norm(numeric), 1e-30)
    worst = np.argmax(np.abs(analytic - numeric))
    msg = (f"{name}: relative error {err:.3e} (tol {TOL}); first pairs "
           f"{list(zip(analytic.reshape(-1)[:3], numeric.reshape(-1)[:3]))}, worst at {worst}: "
           f"{analytic.reshape(-1)[worst]} vs {numeric.reshape(-1)[worst]}")
    assert np.all(np.isfinite(analytic)), msg
    assert err < TOL, msg


def run_pair(rng, fwd, bwd, inputs, out_shape, wrt, extra_out=()):
    """Generic: fwd(out, *extra_out, **inputs); bwd(grads..., dout, inputs) -> compare."""
    R = rnd(rng, *out_shape)
    out = np.zeros(out_shape)

    def objective():
        fwd(out, *[np.zeros(s) for s in extra_out], **inputs)
        return float((R * out).sum())

    objective()
    pre = {k: rnd(rng, *inputs[k].shape) for k in wrt}  # random pre-fill: backward must ADD
    grads = {k: pre[k].copy() for k in wrt}
    bwd(grads, R)
    for k in wrt:
        check(f"{fwd.__name__} d{k}", grads[k] - pre[k], fd_grad(objective, inputs[k]))


# ---------------------------------------------------------------- accumulate=False
def check_written(kernel, args, i):
    """accumulate=False: the activation gradient args[i] (dinp, dqkv) is written, its old contents
    (NaN here) never read, and every output has the bits of the default mode adding into zeros;
    the parameter gradients (the zero float64 arguments, pre-filled at random in both runs) still
    add. The default mode's increments are checked against finite differences."""
    name = kernel.__name__
    prng = np.random.default_rng(15)
    pre = {j: prng.normal(size=a.shape) for j, a in enumerate(args)
           if isinstance(a, np.ndarray) and a.dtype == np.float64 and not a.any() and j != i}
    runs = []
    for accumulate, start in ((True, 0.0), (False, np.nan)):
        a = [x.copy() if isinstance(x, np.ndarray) else x for x in args]
        for j, p in pre.items():
            a[j][...] = p
        a[i][...] = start
        kernel(*a, accumulate=accumulate)
        runs.append(a)
    added, written = runs
    assert np.isfinite(written[i]).all() and np.abs(written[i]).sum() > 0
    for j, (x, y) in enumerate(zip(added, written)):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(y, x, err_msg=f"{name} argument {j}")
    assert name == "k_attn_bwd" or any(not np.array_equal(written[j], p) for j, p in pre.items())  # grads moved


# ---------------------------------------------------------------- FP8
def torch_fp8(fmt):
    """PyTorch's float8 dtype of the format (the test is skipped without PyTorch)."""
    torch = pytest.importorskip("torch")
    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]


def torch_round(x, fmt):
    """PyTorch's saturating cast of x to the format, as float32 values."""
    torch = pytest.importorskip("torch")
    top = K.FP8_FORMATS[fmt][2]
    t = torch.from_numpy(np.asarray(x, np.float32)).clamp(-top, top)
    return t.to(torch_fp8(fmt)).to(torch.float32).numpy()


def samples(rng, n=20000):
    """Values over every binade of both formats, subnormals, exact ties, zeros, overflow."""
    x = rng.normal(0, 1, n) * np.exp2(rng.integers(-24, 20, n))
    ties = (np.arange(1, 200) + 0.5) * 2.0 ** -9  # halfway between E4M3 subnormals
    ties2 = (1.0 + (2 * np.arange(8) + 1) / 16.0) * 4.0  # halfway between E4M3 normals (1.xxx1 * 4)
    extra = [0.0, -0.0, 448.0, 449.0, 463.9, 464.0, 1e6, -1e6, 57344.0, 61439.0, 61440.0, 1e30, np.inf, -np.inf]
    return np.concatenate([x, ties, -ties, ties2, -ties2, extra]).astype(np.float32)


def on_grid(rng, shape, fmt="e4m3"):
    """Values an FP8 product represents exactly: fp8 grid points times one power of two, and
    amax a power of two times 1.75 or less, so the tensor's own scale keeps them on the grid."""
    v = K.fp8_round(rng.normal(0, 40, shape), fmt).astype(np.float64)
    v.reshape(-1)[0] = 448.0 if fmt == "e4m3" else 57344.0
    return v * 2.0 ** -10


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


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
