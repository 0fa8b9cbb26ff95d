"""ref/mlp.py: the MLP pair (finite differences, accumulate=False) and the FP8 MLP against the
float64 one."""
import numpy as np
import pytest

from andrea.backends import ref as K
from refkit import B, C, T, check_written, rel, rnd, run_pair


def test_mlp(rng=np.random.default_rng(6)):
    inp = {"inp": rnd(rng, B, T, C), "w1": rnd(rng, 4 * C, C, scale=0.5), "b1": rnd(rng, 4 * C),
           "w2": rnd(rng, C, 4 * C, scale=0.5), "b2": rnd(rng, C)}
    pre, act, dact = (np.zeros((B, T, 4 * C)) for _ in range(3))

    def fwd(out, **kw):
        K.k_mlp_fwd(out, pre, act, **kw)

    fwd.__name__ = "k_mlp_fwd"
    run_pair(rng, fwd,
             lambda g, R: K.k_mlp_bwd(g["inp"], g["w1"], g["b1"], g["w2"], g["b2"], R, inp["inp"],
                                      pre, inp["w1"], inp["w2"], act, dact),
             inp, (B, T, C), ["inp", "w1", "b1", "w2", "b2"])


@pytest.mark.parametrize("kernel,extra", [(K.k_mlp_bwd, ()), (K.k_fp8_mlp_bwd, ("e5m2",))],
                         ids=["k_mlp_bwd", "k_fp8_mlp_bwd"])
def test_accumulate_false_writes_dinp(kernel, extra):
    """accumulate=False writes dinp (refkit.check_written)."""
    rng = np.random.default_rng(14)
    H4, z = 4 * C, np.zeros
    x = rnd(rng, B, T, C)
    w_up, w_down, pre = rnd(rng, H4, C, scale=0.5), rnd(rng, C, H4, scale=0.5), rnd(rng, B, T, H4)
    check_written(kernel, [z((B, T, C)), z((H4, C)), z(H4), z((C, H4)), z(C), rnd(rng, B, T, C), x, pre, w_up,
                           w_down, z((B, T, H4)), z((B, T, H4)), *extra], 0)


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
