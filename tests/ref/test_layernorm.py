"""ref/layernorm.py: the layer norm, the fused residual + layer norm (finite differences), the
optional amax of the output, accumulate=False, and the FP8 form k_layernorm_fwd_fp8 (odd sizes)."""
import numpy as np
import pytest

from andrea.backends import ref as K
from refkit import B, C, T, check, check_written, fd_grad, rnd, run_pair


def test_layernorm(rng=np.random.default_rng(2)):
    inp = {"inp": rnd(rng, B, T, C), "weight": rnd(rng, C), "bias": rnd(rng, C)}
    mean, rstd = np.zeros((B, T)), np.zeros((B, T))

    def fwd(out, **kw):
        K.k_layernorm_fwd(out, mean, rstd, **kw)

    fwd.__name__ = "k_layernorm_fwd"
    run_pair(rng, fwd,
             lambda g, R: K.k_layernorm_bwd(g["inp"], g["weight"], g["bias"], R, inp["inp"],
                                            inp["weight"], mean, rstd),
             inp, (B, T, C), ["inp", "weight", "bias"])


def test_residual_layernorm(rng=np.random.default_rng(13)):
    """The fused residual + layer norm against finite differences of L = sum(R1 * res) +
    sum(R2 * out); its backward is the residual gradient with k_layernorm_bwd added in place."""
    inp = {"a": rnd(rng, B, T, C), "b": rnd(rng, B, T, C), "weight": 1 + rnd(rng, C, scale=0.1),
           "bias": rnd(rng, C, scale=0.1)}
    R1, R2 = rnd(rng, B, T, C), rnd(rng, B, T, C)
    res, out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))

    def objective():
        K.k_residual_layernorm_fwd(res, out, mean, rstd, **inp)
        return float((R1 * res).sum() + (R2 * out).sum())

    objective()
    want_res, want_out = np.zeros_like(res), np.zeros_like(out)
    K.k_residual_add(want_res, inp["a"], inp["b"])
    K.k_layernorm_fwd(want_out, np.zeros((B, T)), np.zeros((B, T)), want_res, inp["weight"], inp["bias"])
    np.testing.assert_array_equal(res, want_res)
    np.testing.assert_array_equal(out, want_out)
    dres = R1.copy()  # the gradient of res from above; the layer norm adds its part in place
    dw, db = np.zeros(C), np.zeros(C)
    K.k_layernorm_bwd(dres, dw, db, R2, res, inp["weight"], mean, rstd)
    for k in ("a", "b"):
        check(f"k_residual_layernorm_fwd d{k}", dres, fd_grad(objective, inp[k]))
    check("k_residual_layernorm_fwd dweight", dw, fd_grad(objective, inp["weight"]))
    check("k_residual_layernorm_fwd dbias", db, fd_grad(objective, inp["bias"]))


def test_accumulate_false_writes_dinp():
    """k_layernorm_bwd(accumulate=False) writes dinp (refkit.check_written)."""
    rng = np.random.default_rng(14)
    x, z = rnd(rng, B, T, C), np.zeros
    mean, rstd = np.zeros((B, T)), np.zeros((B, T))
    weight = 1 + rnd(rng, C, scale=0.1)
    K.k_layernorm_fwd(np.zeros((B, T, C)), mean, rstd, x, weight, rnd(rng, C))
    check_written(K.k_layernorm_bwd, [z((B, T, C)), z(C), z(C), rnd(rng, B, T, C), x, weight, mean, rstd], 0)


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


@pytest.mark.parametrize("residual", [False, True], ids=["layernorm", "residual_layernorm"])
def test_layernorm_fwd_fp8_reference(residual):
    """ref.k_layernorm_fwd_fp8 (odd sizes): res, mean and rstd as the layer norm writes them;
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
