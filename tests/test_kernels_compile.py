"""Every kernels/*.cu and dev/cuda/*.cu variant compiles with nvcc for sm_80 and sm_90, in each
compute dtype (CPU only).

    python -m pytest tests/test_kernels_compile.py -q

The CUDA backend compiles the same sources at run time with NVRTC (-DCT=float|f16|bf16); this
catches a kernel that does not compile on a machine without a GPU. Skipped only where nvcc is
absent. PTX only (--ptx): no GPU, no linking, about a third of a second per file.
"""
import shutil
import subprocess
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "andrea" / "kernels"
SOURCES = sorted(KERNELS.glob("*.cu"))
VARIANTS = sorted((Path(__file__).resolve().parent.parent / "dev" / "cuda").glob("*.cu"))  # dev/cuda
NVCC = shutil.which("nvcc")


def test_every_operation_has_a_source():
    names = {p.name for p in SOURCES}
    for need in ("embed.cu", "layernorm.cu", "linear.cu", "attention.cu", "mlp.cu", "residual.cu",
                 "loss.cu", "optim.cu"):
        assert need in names, f"kernels/{need} is missing"


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("src", SOURCES + VARIANTS, ids=[p.name for p in SOURCES + VARIANTS])
def test_compiles(src, arch, tmp_path):
    # sm_80 in the default dtype, sm_90 in both 16-bit dtypes: every dtype and arch is covered
    # without compiling each file six times
    for ct in (["float"] if arch == "sm_80" else ["f16", "bf16"]):
        out = tmp_path / f"{src.stem}.{ct}.ptx"
        cmd = [NVCC, "-std=c++17", f"-arch={arch}", f"-I{KERNELS}", "--ptx", f"-DCT={ct}",
               str(src), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{src} (CT={ct}, {arch}) does not compile:\n{r.stderr}"
        assert out.stat().st_size > 0
