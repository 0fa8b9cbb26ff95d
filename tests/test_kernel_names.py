"""Every kernel the CUDA backend launches by name exists in the file it names (CPU only).

    python -m pytest tests/test_kernel_names.py -q

The launchers (andrea/backends/cuda/**/*.py) name kernels as strings, `rt.launch("mlp.cu",
"k_mlp_bwd_gelu", ...)`; a renamed kernel would otherwise only fail on a GPU, and only on the path
that launches it (a fallback may run rarely).
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = re.compile(r'launch\(\s*"(\w+\.cu)",\s*"(\w+)"')


def launched():
    out = set()
    cuda = ROOT / "andrea" / "backends" / "cuda"
    for py in sorted(cuda.rglob("*.py")):
        out |= {(f, k, str(py.relative_to(cuda))) for f, k in LAUNCH.findall(py.read_text())}
    return out


def test_launched_kernels_exist():
    found = launched()
    assert len(found) > 20  # the pattern still matches the launchers
    assert ("fp8.cu", "k_fp8_cast_transpose", "fp8/quant.py") in found
    assert ("optim.cu", "k_grad_norm_final", "ops/optim.py") in found
    missing = []
    for f, k, py in sorted(found):
        src = (ROOT / "kernels" / f).read_text()
        if not re.search(rf"__global__\s+void\s+(__launch_bounds__\([^)]*\)\s+)?{k}\s*\(", src):
            missing.append(f"{py} launches {k} from {f}, which has no such kernel")
    assert missing == []
