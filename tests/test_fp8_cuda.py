"""The FP8 path on the GPU (train.precision=fp8): the quantisation kernels byte for byte and the
FP8 linear layers against numpy_ref's FP8 section, and two fp8 runs bit-identical (skipped without a
GPU of compute capability 8.9 or later). SIGTERM + resume of an fp8 run is
tests/test_cuda_engine.py::test_sigterm_resume_bit_exact_on_gpu[fp8].

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

from andrea.backends import numpy_ref as ref
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


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def on_dev(x):
    import cupy as cp
    return cp.asarray(np.ascontiguousarray(x).astype(bf16()))


def host(a):
    return a.get().astype(np.float64)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("R,K", [(48, 80), (112, 208), (16, 16)])  # partial 64 x 64 tiles
def test_cast_kernels_match_the_reference_bytes(be, fmt, R, K):
    import cupy as cp
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


def test_cast_refuses_sizes_cublaslt_cannot_take(be):
    import cupy as cp
    with pytest.raises(ValueError, match="multiples of 16"):
        be.fp8.k_fp8_cast_transpose(None, cp.zeros(40 * 24, cp.uint8), cp.zeros(2, cp.float32),
                                    on_dev(np.ones((40, 24))), "e4m3")


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
    be.fp8.k_fp8_linear_fwd(out, x, w, b)
    # backward ADDS: pre-filled, dinp small enough that its bf16 rounding stays below TOL; in the
    # write mode dinp starts as NaN and is compared as it is
    pre = [0.1 * rng.standard_normal(s) for s in ((Bn, T, IC), (OC, IC), (OC,))]
    dx, dw, db = on_dev(pre[0]), cp.asarray(pre[1], cp.float32), cp.asarray(pre[2], cp.float32)
    pre[0] = host(dx)
    if not accumulate:
        dx, pre[0] = cp.full(dx.shape, np.nan, bf16()), np.zeros_like(pre[0])
    be.fp8.k_fp8_linear_bwd(dx, dw, db, dy, x, w, grad_fmt=grad_fmt, accumulate=accumulate)
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
    then (double rounding), which the float64 reference of the whole MLP would not see."""
    import cupy as cp
    rng = np.random.default_rng(5)
    Bn, T, C, H = 4, 48, 80, 320
    x, dy = on_dev(rng.standard_normal((Bn, T, C))), on_dev(1e-3 * rng.standard_normal((Bn, T, C)))
    w1, b1 = on_dev(0.1 * rng.standard_normal((H, C))), on_dev(0.1 * rng.standard_normal(H))
    w2, b2 = on_dev(0.05 * rng.standard_normal((C, H))), on_dev(0.05 * rng.standard_normal(C))
    out, pre = cp.full((Bn, T, C), np.nan, bf16()), cp.full((Bn, T, H), np.nan, bf16())
    act, dact = cp.empty((Bn, T, H), bf16()), cp.empty((Bn, T, H), bf16())
    be.fp8.k_fp8_mlp_fwd(out, pre, act, x, w1, b1, w2, b2)
    X, DY, W1, B1, W2, B2 = (host(a) for a in (x, dy, w1, b1, w2, b2))
    P, A = host(pre), host(act)
    p_ref, o_ref = np.zeros((Bn, T, H)), np.zeros((Bn, T, C))
    ref.k_fp8_linear_fwd(p_ref, X, W1, B1)
    assert rel(P, p_ref) < TOL
    gelu = np.zeros_like(P)
    ref._gelu(P, gelu)
    assert rel(A, gelu) < TOL  # act = gelu(pre), in bf16
    ref.k_fp8_linear_fwd(o_ref, A, W2, B2)
    assert rel(host(out), o_ref) < TOL
    g = [cp.zeros((Bn, T, C), bf16()), cp.zeros((H, C), cp.float32), cp.zeros(H, cp.float32),
         cp.zeros((C, H), cp.float32), cp.zeros(C, cp.float32)]
    if not accumulate:  # dinp written: NaN before
        g[0] = cp.full((Bn, T, C), np.nan, bf16())
    be.fp8.k_fp8_mlp_bwd(*g, dy, x, pre, w1, w2, act, dact, accumulate=accumulate)
    A, D = host(act), host(dact)  # the backward pass's own act (recomputed) and dact
    d2 = [np.zeros((Bn, T, H)), np.zeros((C, H)), np.zeros(C)]
    ref.k_fp8_linear_bwd(*d2, DY, A, W2, be.fp8.grad_fmt)
    d2[0] *= ref._gelu_grad(P)
    assert rel(D, d2[0]) < TOL, "dact"
    d1 = [np.zeros((Bn, T, C)), np.zeros((H, C)), np.zeros(H)]
    ref.k_fp8_linear_bwd(*d1, D, X, W1, be.fp8.grad_fmt)
    for name, got, r in zip(("dinp", "dw1", "db1", "dw2", "db2"), g, d1 + d2[1:]):
        e = rel(host(got), r)
        assert e < TOL, f"{name}: {e:.3g}"


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
    from andrea.engine import Engine
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
    from andrea.engine import Engine
    with pytest.raises(ValueError, match="multiple of 16"):
        Engine(cfg_for(tmp_path, batch_size=3, seq_len=37, precision="fp8"))
