"""upload(dst, src, free=mark) (CudaBackend(side_uploads=...)): the copy runs on the side stream once
the mark is reached, beside work queued after the mark, and the current stream waits for it; the
engine's steps with it keep the bits of every upload queued behind all work, with an evaluation
between steps and a step of two microbatches.

    python -m pytest -q -m gpu tests/cuda/test_side_uploads_cuda.py
"""
import numpy as np
import pytest

from cudakit import fp8_gpu
from fp8kit import assert_same_runs

from andrea.backends import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]

SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
}'''


def spin_ms(cp, ms):
    """A one-thread kernel that keeps the current stream busy for about ms milliseconds."""
    rate = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0)  # kHz
    cp.RawKernel(SPIN, "spin")((1,), (1,), (np.int64(ms * rate),))


@pytest.mark.parametrize("side", [True, False])
def test_upload_after_its_mark(side):
    """A reader queued before the mark sees the old contents and one queued after the upload the
    new ones; a reader queued after the mark but before the upload sees the new ones only on the
    side stream (the copy overtook it: it waited for the mark, not for the queue)."""
    import cupy as cp

    from andrea.bench.step import cuda_backend
    be = cuda_backend(None, side_uploads=side)
    old, new = np.arange(1, 4097, dtype=np.int32), np.arange(5001, 9097, dtype=np.int32)
    dst = cp.asarray(old)
    be.upload(dst, old)  # the pinned buffers made, the kernels compiled: nothing slow below
    spin_ms(cp, 0)
    before = dst * 2  # queued before the mark
    free = be.mark()
    spin_ms(cp, 200)
    overtaken = dst * 2  # after the mark, before the upload: 200 ms behind the spin
    be.upload(dst, new, free=free)
    after = dst * 3
    be.synchronize()
    assert np.array_equal(cp.asnumpy(before), 2 * old)
    assert np.array_equal(cp.asnumpy(after), 3 * new)
    assert np.array_equal(cp.asnumpy(overtaken), 2 * (new if side else old))


def run(precision, side, steps=6):
    from andrea.bench.step import bench_config, cuda_backend, random_batches
    from andrea.core.engine import Engine
    cfg = bench_config("ANDREA-12M", precision, 32, steps + 1)
    be = cuda_backend(None, side_uploads=side)
    eng = Engine(cfg, backend=be)
    batches = random_batches(cfg.model.vocab_size, 32, cfg.model.context)
    recs = []
    for s in range(1, steps + 1):
        micro = [batches[s % 4], batches[(s + 1) % 4]] if s == 5 else [batches[s % 4]]
        recs.append(dict(eng.train_step(s, micro)))
        if s == 3:
            recs.append(eng.val_loss([batches[0]]))
    eng.be.synchronize()
    return (recs, eng.host_state()), be


@pytest.mark.parametrize("precision", ["fp16", pytest.param("fp8", marks=pytest.mark.skipif(
    not fp8_gpu(), reason="needs FP8 tensor cores"))])
def test_side_uploads_same_bits(precision):
    on, be_on = run(precision, True)
    off, be_off = run(precision, False)
    assert_same_runs(on, off, what="the side stream's uploads changed the run")
    assert be_on._side is not None and be_off._side is None
