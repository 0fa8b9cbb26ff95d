"""The launch plan of the classifier's row pass (kernels/loss.cu, version 2: the row held in
registers) and what ptxas makes of it (CPU only).

    python -m pytest tests/test_loss_plan.py -q

geometry.loss_row_plan picks, from V and the element size, the vectors a thread holds (-DLOSS_NV) and
the block size (-DLOSS_THREADS); the kernel is then compiled with __launch_bounds__ of that block,
so ptxas has 65536 / threads registers a thread. Here: every plan covers the row with whole
warps and no idle warp, stays within the register file and shared memory, and refuses exactly the
rows version 1 must take; and at the vocabulary sizes of the experiments (and a few others) the
planned kernels assemble for sm_90 with no stack frame (the row would otherwise sit in local
memory). The ptxas part is skipped where nvcc is absent.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from andrea.backends.cuda.geometry import LOSS_ROW_REGS, loss_row_plan

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
NVCC = shutil.which("nvcc")
SMEM_MAX = 232448  # an H100/H200's opt-in shared memory per block


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("vectors", [4, 8, 16])
def test_plan_covers_the_row(itemsize, vectors):
    vec = 16 // itemsize
    taken = 0
    for V in list(range(vec, 4096, vec * 7)) + [8192, 8200, 32000, 50304, 65536, 100000, 128256, 256000, 1001, 50303]:
        plan = loss_row_plan(V, itemsize, vectors, True, SMEM_MAX)
        if V % vec:
            assert plan is None, (V, plan)  # no whole 16-byte vectors: version 1
            continue
        n = V // vec
        if plan is None:  # too long for one block's registers at 1024 threads
            assert 4 * -(-n // 1024) + LOSS_ROW_REGS > 64, (V, itemsize)
            continue
        taken += 1
        nv, threads, smem = plan
        assert threads % 32 == 0 and 32 <= threads <= 1024, (V, plan)
        assert nv * threads >= n > (nv - 1) * threads, (V, plan)  # covered, by the fewest vectors a thread
        assert n > threads - 32, (V, plan)  # every warp holds vectors
        assert 4 * nv + LOSS_ROW_REGS <= 65536 // threads, (V, plan)
        assert smem in (0, 2 * nv * threads * 16) and smem <= SMEM_MAX, (V, plan)
        assert loss_row_plan(V, itemsize, vectors, False, SMEM_MAX)[2] == 0
    assert taken > 50
    assert loss_row_plan(50304, 2) == (8, 800, 2 * 8 * 800 * 16)  # ANDREA-120M in 16 bits
    assert loss_row_plan(50304, 4) is None  # float32 at 50304: version 1


PLANNED = [(V, ct, vectors) for V, vs in ((50304, (4, 8, 16)), (8192, (4, 8, 16)), (1000, (8,)), (8200, (8,)),
                                          (65536, (8,))) for ct in ("f16", "bf16", "float")
           for vectors in vs if loss_row_plan(V, 4 if ct == "float" else 2, vectors)]


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("V,ct,vectors", PLANNED)
def test_planned_kernels_do_not_spill(V, ct, vectors, tmp_path):
    nv, threads, smem = loss_row_plan(V, 4 if ct == "float" else 2, vectors)
    cmd = [NVCC, "-std=c++17", "-arch=sm_90", f"-I{KERNELS}", "--cubin", "-Xptxas", "-v", f"-DCT={ct}",
           f"-DLOSS_NV={nv}", f"-DLOSS_THREADS={threads}", f"-DLOSS_PREFETCH={int(smem > 0)}",
           "-DFP8_SR=1",  # the FP8 row pass with stochastic rounding, the heavier of its two builds
           str(KERNELS / "loss.cu"), "-o", str(tmp_path / "loss.cubin")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = dict(re.findall(r"Function properties for (loss_\w+_regs)\n\s*(\d+) bytes stack frame", r.stderr))
    assert set(report) == {"loss_fwd_regs", "loss_bwd_regs", "loss_bwd_fp8_regs"}, r.stderr
    assert all(v == "0" for v in report.values()), f"V={V} CT={ct} NV={nv} threads={threads}:\n{r.stderr}"


def test_no_vectors_means_version_1():
    """Tuning.loss_vectors = 0 sends every row to version 1 (how version 1 is timed against version 2)."""
    assert loss_row_plan(50304, 2, vectors=0) is None and loss_row_plan(8192, 2, vectors=0) is None
    assert loss_row_plan(50304, 2, vectors=8) is not None
