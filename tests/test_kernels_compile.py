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

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
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


def test_kernel_source_pastes_each_include_once(tmp_path):
    """kernel_source (what NVRTC compiles: it has no include path): a name is found beside the
    including file first, then in the package's folder; a file pasted once is not pasted again;
    an include found nowhere names the file and the include."""
    from andrea.backends.cuda.runtime import kernel_source
    pkg, dev = tmp_path / "pkg", tmp_path / "dev"
    pkg.mkdir(), dev.mkdir()
    (pkg / "common.cuh").write_text("COMMON\n")
    (pkg / "op.cu").write_text('#include "common.cuh"\nOP\n')
    (dev / "part.cu").write_text("PART\n")
    (dev / "op_v2.cu").write_text('#include "common.cuh"\n#include "op.cu"\n#include "part.cu"\nNEW\n')
    text = kernel_source(dev / "op_v2.cu", (pkg,))
    assert text.split("\n").count("COMMON") == 1 and "OP" in text and "PART" in text and "NEW" in text
    assert "#include" not in text
    (dev / "bad_v3.cu").write_text('#include "nowhere.cu"\n')
    with pytest.raises(FileNotFoundError, match="bad_v3.cu.*nowhere.cu"):
        kernel_source(dev / "bad_v3.cu", (pkg,))


PASTED = [p for p in VARIANTS if any(f'#include "{k.name}"' in p.read_text() for k in SOURCES)]


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("src", PASTED, ids=[p.name for p in PASTED])
def test_variant_text_compiles_without_include_path(src, tmp_path):
    """A dev/cuda variant that includes the package file it varies compiles as the Runtime hands
    it to NVRTC: includes pasted in, no -I."""
    from andrea.backends.cuda.runtime import kernel_source
    text = tmp_path / src.name
    text.write_text(kernel_source(src))
    out = tmp_path / "x.ptx"
    r = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "--ptx", "-DCT=f16", str(text), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"{src} as pasted does not compile:\n{r.stderr}"


# compile-time variants of package kernels that a backend switch selects (-D), each also built here
DEFINES = [("fp8.cu", "-DFP8_E5M2=1")]


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("name,define", DEFINES, ids=[f"{n}{d}" for n, d in DEFINES])
def test_switch_variants_compile(name, define, tmp_path):
    out = tmp_path / "x.ptx"
    r = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", f"-I{KERNELS}", "--ptx", "-DCT=bf16", define,
                        str(KERNELS / name), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, f"{name} with {define} does not compile:\n{r.stderr}"
    assert out.stat().st_size > 0
