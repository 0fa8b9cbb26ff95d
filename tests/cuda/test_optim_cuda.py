"""CUDA: the step check, AdamW and the parameter cast against the NumPy reference, on the GPU (skipped without one); moved from tests/test_cuda_kernels.py.

    python -m pytest -m gpu tests/cuda/test_optim_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref
from cudakit import _adamw_inputs, _state, assert_close, dev, host, nan_buf, rnd

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


@pytest.mark.parametrize("max_norm,poison,fp16", [(0.0, None, False), (1e9, None, True),
                                                  (0.5, None, True), (0.5, np.inf, True),
                                                  (0.5, np.nan, False)])
def test_step_check(be, rng, max_norm, poison, fp16):
    """k_grad_norm_partial, k_loss_accum and k_step_check against the reference: off, not reached
    and active clipping, an fp16 overflow and a NaN gradient (the skip policy). k_step_check gets
    the same partials on both sides and works in float64 as Python does: the state must agree to
    the bit."""
    n = 100_003  # not a multiple of the partial count: the last chunk is short
    P = be.grad_norm_partials
    grads = rnd(rng, (n,), np.float32, 0.3)
    if poison is not None:
        grads[12_345] = poison
    partials = np.zeros(P)
    ref.k_grad_norm_partial(partials, grads)
    g_part = nan_buf((P,), np.float32)
    be.k_grad_norm_partial(g_part, dev(grads, np.float32))
    if poison is None:
        assert_close("k_grad_norm_partial", host(g_part), partials, 1e-5)
    losses = rnd(rng, (3, 77), np.float32, 1.0, 5.0).astype(np.float32)
    st = _state(1024.0 if fp16 else 1.0, 3e-4, 9, skipped=2, good=1999)
    g_st = dev(st, np.float64)
    ref.k_loss_accum(st, losses)
    be.k_loss_accum(g_st, dev(losses, np.float32))
    assert abs(host(g_st)[ref.S_LOSS_SUM] - st[ref.S_LOSS_SUM]) <= 1e-12 * abs(st[ref.S_LOSS_SUM])
    st = host(g_st)  # the same loss sum on both sides from here
    parts32 = host(g_part).astype(np.float32)
    dloss, g_dloss = np.zeros(1, np.float32), nan_buf((1,), np.float32)
    args = (2, losses.size, 0.9, 0.95, 0.1, max_norm, fp16, 2000, 2.0 ** 24)
    g_st = dev(st, np.float64)
    ref.k_step_check(st, dloss, parts32, *args)
    be.k_step_check(g_st, g_dloss, g_part, *args)
    got = host(g_st)
    for name, i in zip(ref.STATE_SLOTS, range(len(ref.STATE_SLOTS))):
        assert got[i] == st[i] or (np.isnan(got[i]) and np.isnan(st[i])), f"{name}: {got[i]!r} vs {st[i]!r}"
    assert host(g_dloss)[0] == dloss[0]
    assert bool(got[ref.S_SKIP]) == (poison is not None)


@pytest.mark.parametrize("P", [1, 1000, 4096, 5001])  # partials in shared memory (up to 4096), and past it
def test_step_check_partials(be, rng, P):
    """k_step_check sums any number of partials in order, in float64, to the reference's bits: the
    partials differ by orders of magnitude, so another order would round differently."""
    parts = (rng.random(P) * 10.0 ** rng.integers(-6, 6, P)).astype(np.float32)
    st = _state(1.0, 3e-4, 9, skipped=2, good=5)
    st[ref.S_LOSS_SUM] = 77.0 * 3.5
    g_st = dev(st, np.float64)
    dloss, g_dloss = np.zeros(1, np.float32), nan_buf((1,), np.float32)
    args = (1, 77, 0.9, 0.95, 0.1, 1.0, False, 2000, 2.0 ** 24)
    ref.k_step_check(st, dloss, parts, *args)
    be.k_step_check(g_st, g_dloss, dev(parts, np.float32), *args)
    got = host(g_st)
    for name, i in zip(ref.STATE_SLOTS, range(len(ref.STATE_SLOTS))):
        assert got[i] == st[i], f"{name}: {got[i]!r} vs {st[i]!r}"
    assert host(g_dloss)[0] == dloss[0]


@pytest.mark.parametrize("cdt", [np.float32, np.float16, "bfloat16"])
def test_adamw_step_vector_bits(be, rng, cdt):
    """k_adamw_step moves float4 vectors when every buffer is 16-byte aligned and one element at a
    time otherwise (and for the last n % 4): both paths give the same bits. The same update runs on
    aligned buffers and on views that start one element in (every vector misaligned), with the
    decay boundary inside a vector (n_decay % 4 == 1)."""
    import cupy as cp
    import ml_dtypes
    cdt = ml_dtypes.bfloat16 if cdt == "bfloat16" else cdt
    n, n_decay = 40_007, 20_001
    host32, st = _adamw_inputs(rng, n)
    runs = []
    for off in (0, 1):
        bufs = [cp.zeros(n + 1, np.float32) for _ in host32]
        for b, x in zip(bufs, host32):
            b[off:off + n] = cp.asarray(x)
        views = [b[off:off + n] for b in bufs]
        pcb = dev(np.zeros(n + 1), cdt) if cdt != np.float32 else None
        pc = pcb[off:off + n] if pcb is not None else None
        be.k_adamw_step(views[0], pc, views[1], views[2], views[3], dev(st, np.float64), 0.9, 0.95, 1e-8,
                        n_decay)
        runs.append([cp.asnumpy(x).view(np.uint32) for x in views]
                    + ([cp.asnumpy(pc).view(np.uint16)] if pc is not None else []))
    for name, a, b in zip(("params", "grads", "m", "v", "params_c"), *runs):
        assert np.array_equal(a, b), f"k_adamw_step {name}: aligned and misaligned paths differ"
    want = [x.copy() for x in host32]
    ref.k_adamw_step(want[0], None, want[1], want[2], want[3], st, 0.9, 0.95, 1e-8, n_decay)
    assert_close("k_adamw_step params", runs[0][0].view(np.float32), want[0].astype(np.float64), 1e-6)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("cdt", [np.float32, np.float16])
def test_adamw_step(be, rng, skip, cdt):
    """float32 on both sides: the kernel rounds each operation as NumPy does; the compute copy is
    the cast of the new weights; the gradient is zeroed; a skipped step changes nothing else."""
    n, n_decay = 50_001, 30_000
    p, g = rnd(rng, (n,), np.float32), rnd(rng, (n,), np.float32, 0.01)
    m, v = rnd(rng, (n,), np.float32, 0.001), np.abs(rnd(rng, (n,), np.float32, 1e-5))
    host32 = [x.astype(np.float32) for x in (p, g, m, v)]
    devs = [dev(x, np.float32) for x in host32]
    st = np.zeros(ref.STATE_LEN)
    st[ref.S_SKIP] = float(skip)
    st[ref.S_CLIP], st[ref.S_DECAY] = np.float32(0.37), np.float32(1 - 3e-3 * 0.1)
    st[ref.S_STEP_SIZE], st[ref.S_VHAT] = np.float32(3e-3 / (1 - 0.9 ** 7)), np.float32(1 / (1 - 0.95 ** 7))
    pc_in = rnd(rng, (n,), cdt)
    pc = pc_in.astype(cdt)
    g_pc = dev(pc_in, cdt) if cdt != np.float32 else None
    ref.k_adamw_step(host32[0], pc if cdt != np.float32 else None, host32[1], host32[2], host32[3],
                     st, 0.9, 0.95, 1e-8, n_decay)
    be.k_adamw_step(devs[0], g_pc, devs[1], devs[2], devs[3], dev(st, np.float64), 0.9, 0.95, 1e-8,
                    n_decay)
    for name, want, got in zip(("params", "grads", "m", "v"), host32, devs):
        assert_close(f"k_adamw_step {name}", host(got), want.astype(np.float64), 1e-6)
    assert not host(devs[1]).any()
    if g_pc is not None:
        want_pc = pc_in if skip else host(devs[0]).astype(cdt).astype(np.float64)
        assert np.array_equal(host(g_pc), want_pc)
    if skip:
        assert np.array_equal(host(devs[0]), p) and np.array_equal(host(devs[2]), m)


def test_cast_params(be, rng):
    src = rnd(rng, (10_007,), np.float32)
    got = nan_buf((10_007,), np.float16)
    be.k_cast_params(got, dev(src, np.float32))
    assert np.array_equal(host(got), src.astype(np.float16).astype(np.float64))


def test_adamw_step_keeps_grads(be, rng):
    """zero_grads=False: the same update (bits) as zeroing, and the gradient left as it was."""
    import cupy as cp
    n, n_decay = 10_003, 5_001
    host32, st = _adamw_inputs(rng, n)
    out = {}
    for zero in (True, False):
        devs = [dev(x, np.float32) for x in host32]
        be.k_adamw_step(devs[0], None, devs[1], devs[2], devs[3], dev(st, np.float64), 0.9, 0.95, 1e-8, n_decay,
                        zero_grads=zero)
        out[zero] = [cp.asnumpy(d).view(np.uint32) for d in devs]
    for name, a, b in zip(("params", "m", "v"), (out[True][0], out[True][2], out[True][3]),
                          (out[False][0], out[False][2], out[False][3])):
        assert np.array_equal(a, b), name
    assert not out[True][1].any()
    assert np.array_equal(out[False][1], host32[1].view(np.uint32))

