"""ref/optim.py: the gradient norm and the step check (clip, loss, non-finite policy, loss scale),
AdamW against PyTorch, the state slots against kernels/optim.cu, the cast, the FP8 step's amax, and
global-norm clipping in its two forms (k_grad_norm_final, k_grad_scale against the fused step)."""
import math

import numpy as np
import pytest

from andrea.backends import interface
from andrea.backends import ref as K
from refkit import rnd


def _state(scale=1.0, lr=1e-2, step=1):
    st = np.zeros(K.STATE_LEN)
    st[K.S_SCALE], st[K.S_LR], st[K.S_STEP] = scale, lr, step
    return st


def _check_step(st, g, n_micro=1, max_norm=1.0, fp16=False, growth=2000, losses=None):
    """k_loss_accum of losses (default: ones), then the norm partials of g and k_step_check."""
    K.k_loss_accum(st, np.ones(10) if losses is None else losses)
    partials, dloss = np.zeros(K.GRAD_NORM_PARTIALS), np.zeros(1)
    K.k_grad_norm_partial(partials, g)
    K.k_step_check(st, dloss, partials, n_micro, 10, 0.9, 0.95, 0.1, max_norm, fp16, growth, 2.0 ** 24)
    return dloss


def test_step_check_norm_clip_and_loss(rng=np.random.default_rng(10)):
    g = rnd(rng, 1001)  # not a multiple of the partials count: the last chunk is short
    st = _state(scale=4.0)
    dloss = _check_step(st, g, n_micro=2, max_norm=1e9, losses=np.arange(10.0))
    pre = 1.0 / (2 * 4.0)  # averaged over 2 microbatches, unscaled
    assert st[K.S_NORM] == pytest.approx(pre * np.linalg.norm(g), rel=1e-12)
    assert st[K.S_LOSS] == pytest.approx(4.5 / 2)  # the sum of one microbatch's mean over 2
    assert st[K.S_LOSS_SUM] == 0 and st[K.S_SKIP] == 0 and st[K.S_REC_SCALE] == 4.0
    assert st[K.S_CLIP] == pre and dloss[0] == 4.0 / 10  # no clipping: only the pre-scale
    st = _state(scale=4.0)
    _check_step(st, g, n_micro=2, max_norm=0.5)
    assert np.linalg.norm(g * st[K.S_CLIP]) == pytest.approx(0.5, rel=1e-5)  # clipped to 0.5


def test_step_check_non_finite_policy():
    g = np.ones(100)
    st = _state(scale=8.0, step=3)
    st[K.S_GOOD] = 5
    _check_step(st, g * np.inf, fp16=True)  # fp16 overflow: skip, halve, not a bad step
    assert st[K.S_SKIP] == 1 and st[K.S_SKIPPED] == 1 and st[K.S_GOOD] == 0 and st[K.S_BAD] == 0
    assert st[K.S_SCALE] == 4.0 and st[K.S_REC_SCALE] == 8.0
    _check_step(st, g, fp16=True, losses=np.full(10, np.nan))  # non-finite loss: a bad step
    assert st[K.S_SKIPPED] == 2 and st[K.S_BAD] == 1 and st[K.S_SCALE] == 2.0
    st[K.S_SCALE] = 1.0
    _check_step(st, g * np.nan, fp16=True)  # at scale 1 an overflow is a bad step too
    assert st[K.S_BAD] == 2 and st[K.S_SCALE] == 1.0
    st2 = _state(scale=1.0)
    _check_step(st2, g * np.nan)  # fp32: the scale stays 1
    assert st2[K.S_SKIP] == 1 and st2[K.S_BAD] == 1 and st2[K.S_SCALE] == 1.0
    for i in range(3):  # good steps: the bad streak ends, the fp16 scale doubles every 3
        st[K.S_STEP] = 4 + i  # update number step - skipped = 1, 2, 3
        _check_step(st, g, fp16=True, growth=3)
        assert st[K.S_SKIP] == 0 and st[K.S_BAD] == 0
    assert st[K.S_SCALE] == 2.0 and st[K.S_GOOD] == 0


def test_adamw_step_skip_only_zeroes_grads(rng=np.random.default_rng(12)):
    p, gr, m, v = (rnd(rng, 20) for _ in range(4))
    before = [a.copy() for a in (p, m, v)]
    st = _state()
    st[K.S_SKIP] = 1.0
    pc = np.zeros(20, np.float16)
    K.k_adamw_step(p, pc, gr, m, v, st, 0.9, 0.95, 1e-8, 10)
    assert not gr.any() and not pc.any()
    for a, b in zip(before, (p, m, v)):
        assert np.array_equal(a, b)


def test_adamw_step_matches_torch(rng=np.random.default_rng(11)):
    """k_step_check + k_adamw_step = torch's clip_grad_norm_ then AdamW (decoupled decay on the
    matrices only), over steps with a skipped one in the middle."""
    torch = pytest.importorskip("torch")
    n, n_decay, lr, max_norm = 50, 30, 1e-2, 1.0
    p0 = rnd(rng, n)
    p, m, v = p0.copy(), np.zeros(n), np.zeros(n)
    pc = np.zeros(n, np.float32)
    tp = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.AdamW([{"params": [tp]}], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    st = _state(lr=lr)
    for step in range(1, 7):
        gr = rnd(rng, n, scale=0.3)
        st[K.S_STEP] = step
        grads = gr * np.nan if step == 3 else gr.copy()
        _check_step(st, grads, max_norm=max_norm)
        K.k_adamw_step(p, pc, grads, m, v, st, 0.9, 0.95, 1e-8, n_decay)
        assert not grads.any()
        if step == 3:
            assert st[K.S_SKIP] == 1
            continue
        # torch's step count is the number of updates made: step - skipped, as ours
        with torch.no_grad():
            tp[:n_decay] *= 1 - lr * 0.1
        tp.grad = torch.tensor(gr)
        torch.nn.utils.clip_grad_norm_([tp], max_norm)
        opt.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(pc, p.astype(np.float32))  # the compute copy follows


def test_state_slots_match_the_cuda_enum():
    """kernels/optim.cu names the optimizer-state slots in an enum: the same order as here."""
    import re

    from andrea.paths import KERNEL_DIR
    src = (KERNEL_DIR / "optim.cu").read_text()
    enum = re.search(r"enum \{(.*?)\};", src, re.S).group(1)
    names = re.findall(r"\b(S_[A-Z_]+|STATE_LEN)\b", re.sub(r"//[^\n]*", "", enum))
    assert tuple(names) == interface.STATE_SLOTS + ("STATE_LEN",)
    assert interface.STATE_LEN >= len(interface.STATE_SLOTS)


def test_cast_params_rounds_to_nearest_like_torch(rng=np.random.default_rng(12)):
    torch = pytest.importorskip("torch")
    src = (rng.standard_normal(1001) * 100).astype(np.float32)
    dst = np.full(1001, np.nan, dtype=np.float16)
    K.k_cast_params(dst, src)
    assert np.array_equal(dst, torch.tensor(src).to(torch.float16).numpy())


def test_adamw_step_can_keep_grads(rng=np.random.default_rng(13)):
    """zero_grads=False: the same update, the gradient untouched (the engine's next first pass
    writes it)."""
    n = 50
    st = np.zeros(K.STATE_LEN)
    st[K.S_CLIP] = st[K.S_DECAY] = st[K.S_VHAT] = 1.0
    st[K.S_STEP_SIZE] = 1e-3
    runs = []
    for zero in (True, False):
        p, g, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(4)) if not runs else \
            [a.copy() for a in start]
        if not runs:
            v = np.abs(v)
            start = [p.copy(), g.copy(), m.copy(), v.copy()]
        K.k_adamw_step(p, None, g, m, v, st, 0.9, 0.95, 1e-8, 20, zero_grads=zero)
        runs.append((p, g, m, v))
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][::2], runs[1][::2]))
    assert not runs[0][1].any() and np.array_equal(runs[1][1], start[1])


@pytest.mark.parametrize("skip", [False, True])
def test_adamw_step_amax_is_the_update_then_the_amax_of_each_weight(skip):
    """ref.k_adamw_step_amax: the update of k_adamw_step, bit for bit, then for each
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


# ---------------------------------------------------------------- global-norm clipping, unfused
def _in_order_norm(partials):
    """sqrt of the partials added one after another in float64, rounded to partials' dtype."""
    ss = 0.0
    for x in partials:
        ss = ss + float(x)
    return float(partials.dtype.type(math.sqrt(ss)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("P", [1, 7, 63, 101, 1001])
def test_grad_norm_final_is_the_norm_step_check_writes(P, dtype):
    """k_grad_norm_final on random partials of odd lengths: state[S_NORM] is the norm k_step_check
    records from the same partials, bit for bit (n_micro * loss scale = 1; at 2 * 4 = 8 the step
    check's norm is it times 1/8, exactly), the partials added in order in float64 and rounded to
    their dtype; close to numpy's norm of the gradients; no other slot written."""
    rng = np.random.default_rng(P)
    g = (rng.standard_normal(3 * P + 2) * np.exp2(rng.integers(-10, 10, 3 * P + 2))).astype(dtype)
    partials = np.zeros(P, dtype)
    K.k_grad_norm_partial(partials, g)
    st = _state(lr=1e-3, step=2)
    before = st.copy()
    K.k_grad_norm_final(st, partials)
    assert st[K.S_NORM] == _in_order_norm(partials)
    changed = np.flatnonzero(st != before)
    assert list(changed) == [K.S_NORM]
    for scale, n_micro, pre in ((1.0, 1, 1.0), (4.0, 2, 0.125)):
        st2 = _state(scale=scale, lr=1e-3, step=2)
        K.k_loss_accum(st2, np.ones(10))
        K.k_step_check(st2, np.zeros(1), partials, n_micro, 10, 0.9, 0.95, 0.1, 1.0, False, 2000, 2.0 ** 24)
        assert np.float64(st2[K.S_NORM]).tobytes() == np.float64(st[K.S_NORM] * pre).tobytes(), (scale, n_micro)
    want = np.linalg.norm(g.astype(np.float64))
    assert st[K.S_NORM] == pytest.approx(want, rel=1e-6 if dtype == np.float32 else 1e-12)


def test_grad_norm_final_adds_the_partials_in_order():
    """Partials where the order of the float64 sum shows: 2^53 then ones. Added in order each 1 is
    lost (2^53 + 1 rounds back to 2^53, ties to even); numpy's pairwise sum keeps them. The norm
    is the in-order one, as k_step_check's."""
    partials = np.ones(101)
    partials[0] = 2.0 ** 53
    assert float(np.sum(partials)) != 2.0 ** 53  # the other order gives another value
    st = np.zeros(K.STATE_LEN)
    K.k_grad_norm_final(st, partials)
    assert st[K.S_NORM] == math.sqrt(2.0 ** 53) == _in_order_norm(partials)
    st2 = _state()
    K.k_step_check(st2, np.zeros(1), partials, 1, 10, 0.9, 0.95, 0.1, 1.0, False, 2000, 2.0 ** 24)
    assert st2[K.S_NORM] == st[K.S_NORM]
    nan = partials.copy()
    nan[50] = np.nan
    K.k_grad_norm_final(st, nan)
    assert np.isnan(st[K.S_NORM])


@pytest.mark.parametrize("max_norm", [0.05, 0.2, 1e9, 0.0], ids=["clipped", "clipped-less", "unclipped", "off"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grad_scale_then_the_unclipped_step_is_the_fused_step(max_norm, dtype):
    """k_grad_norm_partial, k_grad_norm_final, k_grad_scale, then k_step_check with clipping off
    and k_adamw_step (a clip factor of 1) leave params, their compute copy, m and v with the bits of
    the fused step (k_step_check clipping at max_norm, k_adamw_step applying it): the gradients
    k_adamw_step works on are the same numbers, grads times the same clip factor in their dtype."""
    rng = np.random.default_rng(21)
    n, n_decay = 1001, 600
    p0, g0 = rng.normal(0, 0.1, n).astype(dtype), rng.normal(0, 0.01, n).astype(dtype)
    m0, v0 = rng.normal(0, 1e-3, n).astype(dtype), np.abs(rng.normal(0, 1e-5, n)).astype(dtype)
    runs = []
    for fused in (True, False):
        p, g, m, v = p0.copy(), g0.copy(), m0.copy(), v0.copy()
        pc = np.zeros(n, np.float16)
        st, partials = _state(lr=3e-3, step=5), np.zeros(K.GRAD_NORM_PARTIALS, dtype)
        K.k_loss_accum(st, np.ones(10))
        K.k_grad_norm_partial(partials, g)
        if not fused:
            K.k_grad_norm_final(st, partials)
            K.k_grad_scale(g, st, max_norm)
            scaled = g.copy()
        K.k_step_check(st, np.zeros(1), partials, 1, 10, 0.9, 0.95, 0.1, max_norm if fused else 0.0, False,
                       2000, 2.0 ** 24)
        assert st[K.S_SKIP] == 0
        if fused:
            clip = st[K.S_CLIP]
        else:
            assert st[K.S_CLIP] == 1.0
        K.k_adamw_step(p, pc, g, m, v, st, 0.9, 0.95, 1e-8, n_decay)
        runs.append((p, pc, m, v))
    np.testing.assert_array_equal(scaled, g0 * dtype(clip))
    assert (clip < 1) == (max_norm in (0.05, 0.2)) and (max_norm > 0 or clip == 1.0)
    for name, a, b in zip(("params", "params_c", "m", "v"), *runs):
        assert a.tobytes() == b.tobytes(), name


def test_grad_scale_clips_to_max_norm_and_leaves_smaller_gradients():
    """Against a plain numpy norm: k_grad_scale brings a gradient of norm above max_norm to
    max_norm (the 1e-6 in the divisor aside), grads * max_norm / (norm + 1e-6) in float32; one of
    norm under max_norm keeps its bits, as with max_norm <= 0 or a non-finite norm."""
    rng = np.random.default_rng(22)
    g = rng.normal(0, 1, 777).astype(np.float32)
    norm = np.linalg.norm(g.astype(np.float64))
    partials = np.zeros(K.GRAD_NORM_PARTIALS, np.float32)
    K.k_grad_norm_partial(partials, g)
    st = np.zeros(K.STATE_LEN)
    K.k_grad_norm_final(st, partials)
    assert st[K.S_NORM] == pytest.approx(norm, rel=1e-6)
    for max_norm in (2 * norm, norm + 1e-3, 0.0, -1.0):
        kept = g.copy()
        K.k_grad_scale(kept, st, max_norm)
        assert kept.tobytes() == g.tobytes(), max_norm
    clipped = g.copy()
    K.k_grad_scale(clipped, st, 0.25 * norm)
    np.testing.assert_array_equal(clipped, g * np.float32(0.25 * norm / (st[K.S_NORM] + 1e-6)))
    assert np.linalg.norm(clipped.astype(np.float64)) == pytest.approx(0.25 * norm, rel=1e-5)
    for bad in (np.nan, np.inf):
        st[K.S_NORM] = bad
        kept = g.copy()
        K.k_grad_scale(kept, st, 1.0)
        assert kept.tobytes() == g.tobytes(), bad
