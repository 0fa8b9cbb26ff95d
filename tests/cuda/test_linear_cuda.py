"""CUDA: the linear layers, the parameter-gradient pass and the bias column sums against the NumPy reference, on the GPU (skipped without one); moved from tests/test_cuda_kernels.py.

    python -m pytest -m gpu tests/cuda/test_linear_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref
from cudakit import B, C, Grad, PASS_CASES, PassCase, T, as_bytes, assert_close, assert_same_bits, dev, host, lt_used, nan_buf, rnd, zeros_like64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


# oc = C + 1: bias-gradient rows that are not whole 16-byte vectors
@pytest.mark.parametrize("op,oc", [("attn_qkv", 3 * C), ("attn_out", C), ("attn_out", C + 1)])
def test_linear(be, prec, rng, op, oc, lt, accumulate):
    dt, tol = prec
    fwd, bwd = f"k_{op}_fwd", f"k_{op}_bwd"
    inp, w, b = rnd(rng, (B, T, C), dt), rnd(rng, (oc, C), dt, 0.05), rnd(rng, (oc,), dt, 0.1)
    out = np.zeros((B, T, oc))
    getattr(ref, fwd)(out, inp, w, b)
    got = nan_buf((B, T, oc), dt)
    getattr(be, fwd)(got, dev(inp, dt), dev(w, dt), dev(b, dt))
    assert_close(f"{fwd} out", host(got), out, tol)
    assert lt_used(be, "bias") or not lt

    dout = rnd(rng, (B, T, oc), dt)
    dinp, dw, db = zeros_like64(inp, w, b)
    getattr(ref, bwd)(dinp, dw, db, dout, inp, w)
    gi, gw, gb = Grad(rng, dinp, dt, accumulate), Grad(rng, dw, np.float32), Grad(rng, db, np.float32)
    getattr(be, bwd)(gi.d, gw.d, gb.d, dev(dout, dt), dev(inp, dt), dev(w, dt), accumulate=accumulate)
    gi.check(f"{bwd} dinp", tol)
    gw.check(f"{bwd} dw", tol)
    gb.check(f"{bwd} db", tol)
    # again on the same buffers: db adds once more (no state left behind by the first launch);
    # dinp adds once more, or is written again to the same values
    getattr(be, bwd)(gi.d, gw.d, gb.d, dev(dout, dt), dev(inp, dt), dev(w, dt), accumulate=accumulate)
    assert_close(f"{bwd} db, second launch", host(gb.d) - gb.pre, 2 * db, tol)
    assert_close(f"{bwd} dinp, second launch", host(gi.d) - gi.pre, (2 if accumulate else 1) * dinp, tol)


@pytest.mark.parametrize("dt_name,c", PASS_CASES)
def test_param_grad_pass_same_bits(rng, dt_name, c):
    """Inside a param_grad_pass the column sums wait and run as ONE k_colsum_final_many at its end:
    every gradient (and activation gradient) has the bits of the sums run at once; a second sum into
    a gradient still waiting flushes the waiting ones first (same bits again)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    case = PassCase(rng, np.dtype(dt_name), c)
    now, launched_now = case.run(False)
    assert launched_now.count("k_colsum_final") == 8 and "k_colsum_final_many" not in launched_now
    later, launched = case.run(True)
    assert_same_bits(later, now, "deferring the column sums")
    assert launched.count("k_colsum_final_many") == 1 and "k_colsum_final" not in launched, launched
    assert launched[-1] == "k_colsum_final_many"  # at the close of the pass, after every other kernel
    assert case.be.colsums.depth == 0 and not case.be.colsums.waiting
    twice_now, _ = case.run(False, reps=2)
    twice, launched = case.run(True, reps=2)
    assert_same_bits(twice, twice_now, "deferring two sums into each gradient")
    assert launched.count("k_colsum_final_many") == 2 and "k_colsum_final" not in launched


@pytest.mark.parametrize("dt_name,c", [("float16", 200), ("float32", 201)])
def test_param_grad_pass_graphs(rng, dt_name, c):
    """The pass captured in a CUDA graph: after an eager run (its table of sums uploaded) the graph
    holds the one launch; captured first (no upload inside a capture) one k_colsum_final per sum.
    Both replay the bits of the sums run at once, twice in a row."""
    import cupy as cp
    case = PassCase(rng, np.dtype(dt_name), c)
    now, _ = case.run(False)
    for eager_first in (True, False):
        g = case.grads()
        if eager_first:
            case.passes(g)
        with case.recording() as launched:
            graph = case.be.capture(lambda: case.passes(g))
        if eager_first:
            assert launched.count("k_colsum_final_many") == 1 and "k_colsum_final" not in launched
        else:
            assert launched.count("k_colsum_final") == 8 and "k_colsum_final_many" not in launched
        for _ in range(2):
            for k, v in case.pre.items():
                g[k].set(v)
            graph.launch()
            case.be.synchronize()
            assert_same_bits(as_bytes(g), now,
                             f"a graph replay (captured {'after' if eager_first else 'before'} an eager run)")


def test_param_grad_pass_runs_out_of_room(rng):
    """Room reserved for one layer and three layers' calls in the pass: the sets of partials that no
    longer fit run at once in the workspace slots; the bits are those of every sum run at once."""
    case = PassCase(rng, np.dtype(np.float16), 200, n_layer=1)
    now, _ = case.run(False, reps=3)
    later, launched = case.run(True, reps=3)
    assert_same_bits(later, now, "running out of deferred room")
    assert "k_colsum_final_many" in launched and "k_colsum_final" in launched


def test_param_grad_pass_drops_sums_on_error(rng):
    """An exception inside the pass leaves nothing waiting, and the next pass starts clean."""
    case = PassCase(rng, np.dtype(np.float16), 200)
    now, _ = case.run(False)
    with pytest.raises(RuntimeError, match="boom"):
        with case.be.param_grad_pass():
            case.calls(case.grads())
            raise RuntimeError("boom")
    assert case.be.colsums.depth == 0 and not case.be.colsums.waiting and case.be.colsums.buf is None
    later, _ = case.run(True)
    assert_same_bits(later, now, "a pass after a failed one")


@pytest.mark.parametrize("dt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("N,Cc,rpc", [(1000, 776, 16), (77, 2304, 13), (8192, 3072, 128)])
def test_colsum_partial_vec_bits(be, rng, dt, N, Cc, rpc):
    """k_colsum_partial_vec (a vector of CT_VEC columns a thread) adds the same rows in the same
    order as k_colsum_partial (a column a thread): the partials agree to the bit, and with the
    float64 column sums of the reference."""
    import cupy as cp
    import ml_dtypes
    from andrea.backends.cuda.runtime import i32, i64
    cdt = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[dt]
    vec = 16 // np.dtype(cdt).itemsize
    Cc -= Cc % vec
    x = rnd(rng, (N, Cc), cdt)
    gx = dev(x, cdt)
    chunks = -(-N // rpc)
    outs = []
    for kernel, cols_per_block in (("k_colsum_partial", 32), ("k_colsum_partial_vec", 32 * vec)):
        part = nan_buf((chunks, Cc), np.float32)
        be.rt.launch("linear.cu", kernel, gx.dtype, (-(-Cc // cols_per_block), chunks), (32, 8),
                     (part, gx, i64(N), i32(Cc), i32(rpc)))
        outs.append(cp.asnumpy(part))
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    assert_close("k_colsum_partial_vec", outs[1].astype(np.float64).sum(0), x.astype(np.float64).sum(0), 1e-5)


def test_colsum_final_many_bits(be, rng):
    """k_colsum_final_many (a thread per column, the warp's shuffle tree replayed in registers) gives
    k_colsum_final's bits (a warp per column) for chunk counts below, at and past 32 and not
    multiples of it, and for widths that leave a block part-filled."""
    import cupy as cp
    from andrea.backends.cuda.colsum import DeferredColsums
    sizes = [(5, 300), (32, 17), (33, 513), (77, 256), (256, 768), (64, 2304)]
    parts = [dev(rnd(rng, (n, c), np.float32, 10.0 ** rng.integers(-3, 3)), np.float32) for n, c in sizes]
    base = [rnd(rng, (c,), np.float32) for _, c in sizes]
    now = [dev(b, np.float32) for b in base]
    for out, part, (n, c) in zip(now, parts, sizes):
        DeferredColsums(be.rt)._final(out, part, n, c)
    q = DeferredColsums(be.rt)
    buf = cp.zeros(sum(-(-n * c // 32) * 32 for n, c in sizes), np.float32)
    q.open(buf)
    later = [dev(b, np.float32) for b in base]
    for out, part, (n, c) in zip(later, parts, sizes):
        p = q.take(n * c)
        p[...] = part.reshape(-1)
        q.finish(out, p, n, c)
    q.close()
    for (n, c), a, b in zip(sizes, now, later):
        assert np.array_equal(cp.asnumpy(a).view(np.uint32), cp.asnumpy(b).view(np.uint32)), (n, c)

