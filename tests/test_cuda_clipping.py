"""Global-norm clipping under the seed's names on the GPU: k_grad_norm_final and k_grad_scale against
the NumPy reference (bit for bit: both work in float64 as Python does, then round to float32), and
against the fused step's own values (k_step_check's norm and clip factor) on the same partials."""
import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref
from andrea.backends.interface import S_CLIP, S_LOSS_SUM, S_NORM, S_SCALE, S_STEP, STATE_LEN

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


@pytest.fixture(scope="module")
def be():
    from andrea.backends import get_backend
    return get_backend("cuda")


def dev(a, dtype):
    import cupy as cp
    return cp.asarray(np.asarray(a, dtype=dtype))


@pytest.mark.parametrize("P", [1, 7, 1023, 5001])
def test_grad_norm_final_matches_the_reference(be, P):
    """Partials over twelve orders of magnitude: another order or precision of the sum would round
    differently."""
    rng = np.random.default_rng(P)
    parts = (rng.random(P) * 10.0 ** rng.integers(-6, 6, P)).astype(np.float32)
    st = np.zeros(STATE_LEN)
    st[S_NORM] = -1.0
    want = st.copy()
    ref.k_grad_norm_final(want, parts)
    g_st = dev(st, np.float64)
    be.k_grad_norm_final(g_st, dev(parts, np.float32))
    got = g_st.get()
    assert got[S_NORM] == want[S_NORM], (got[S_NORM], want[S_NORM])
    assert np.array_equal(np.delete(got, S_NORM), np.delete(st, S_NORM)), "only state[S_NORM] is written"
    assert np.isclose(want[S_NORM], np.sqrt(np.sum(parts.astype(np.float64))), rtol=1e-6, atol=0)


@pytest.mark.parametrize("max_norm,norm", [(0.5, 3.7), (1e9, 3.7), (0.0, 3.7), (0.5, np.inf), (0.5, np.nan)])
def test_grad_scale_matches_the_reference(be, max_norm, norm):
    """Active clipping, a norm under the bound (grads keep their bits), no clipping, and a
    non-finite norm (grads unchanged); odd length, so the grid's last block is partial."""
    rng = np.random.default_rng(7)
    grads = rng.normal(0, 0.3, 100_003).astype(np.float32)
    st = np.zeros(STATE_LEN)
    st[S_NORM] = norm
    want = grads.copy()
    ref.k_grad_scale(want, st, max_norm)
    g = dev(grads, np.float32)
    be.k_grad_scale(g, dev(st, np.float64), max_norm)
    got = g.get()
    assert np.array_equal(got, want), f"{np.count_nonzero(got != want)} of {got.size} values differ"
    if max_norm == 0.0 or max_norm > norm or not np.isfinite(norm):
        assert np.array_equal(got, grads)
    else:
        assert not np.array_equal(got, grads)


def test_separate_kernels_give_the_fused_steps_norm_and_clip(be):
    """k_grad_norm_partial, k_grad_norm_final on the same gradients give the norm k_step_check
    records (n_micro 1, loss scale 1), and k_grad_scale multiplies by the clip factor it writes."""
    rng = np.random.default_rng(3)
    grads = rng.normal(0, 0.3, 200_001).astype(np.float32)
    P = be.grad_norm_partials
    g_part = dev(np.zeros(P), np.float32)
    g_grads = dev(grads, np.float32)
    be.k_grad_norm_partial(g_part, g_grads)
    st = np.zeros(STATE_LEN)
    st[S_SCALE], st[S_STEP], st[S_LOSS_SUM] = 1.0, 3.0, 5.0
    g_fused, g_sep = dev(st, np.float64), dev(st, np.float64)
    max_norm = 0.25
    be.k_step_check(g_fused, dev([0.0], np.float32), g_part, 1, 10, 0.9, 0.95, 0.1, max_norm, False, 2000, 2.0 ** 24)
    be.k_grad_norm_final(g_sep, g_part)
    fused, sep = g_fused.get(), g_sep.get()
    assert sep[S_NORM] == fused[S_NORM]
    be.k_grad_scale(g_grads, g_sep, max_norm)
    assert fused[S_CLIP] < 1.0  # the bound is active
    assert np.array_equal(g_grads.get(), grads * np.float32(fused[S_CLIP]))
