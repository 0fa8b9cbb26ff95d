"""ref/linear.py: the attention's projections (finite differences, accumulate=False) and the FP8
linear layer against the float64 one it approximates."""
import numpy as np
import pytest

from andrea.backends import ref as K
from refkit import B, C, FMTS, T, check_written, on_grid, rnd, run_pair


@pytest.mark.parametrize("fwd,bwd,oc", [(K.k_attn_qkv_fwd, K.k_attn_qkv_bwd, 3 * C),
                                        (K.k_attn_out_fwd, K.k_attn_out_bwd, C)])
def test_linear_pairs(fwd, bwd, oc, rng=np.random.default_rng(3)):
    inp = {"inp": rnd(rng, B, T, C), "w": rnd(rng, oc, C), "b": rnd(rng, oc)}
    run_pair(rng, fwd,
             lambda g, R: bwd(g["inp"], g["w"], g["b"], R, inp["inp"], inp["w"]),
             inp, (B, T, oc), ["inp", "w", "b"])


@pytest.mark.parametrize("kernel,oc,extra", [(K.k_attn_qkv_bwd, 3 * C, ()), (K.k_attn_out_bwd, C, ()),
                                             (K.k_fp8_linear_bwd, C, ("e4m3",))],
                         ids=["k_attn_qkv_bwd", "k_attn_out_bwd", "k_fp8_linear_bwd"])
def test_accumulate_false_writes_dinp(kernel, oc, extra):
    """accumulate=False writes dinp (refkit.check_written)."""
    rng = np.random.default_rng(14)
    x, w, z = rnd(rng, B, T, C), rnd(rng, oc, C), np.zeros
    check_written(kernel, [z((B, T, C)), z((oc, C)), z(oc), rnd(rng, B, T, oc), x, w, *extra], 0)


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
