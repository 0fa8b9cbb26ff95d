"""The Hopper kernels compile to sm_90a machine code, with the wgmma path in, and build without it for
plain sm_90 (CPU only): the package's attention_hopper.cu (forward version 8, backward versions 10 and 7),
dev/cuda's first forward variant (attention_v6.cu) and probes (wgmma_probe.cu).

    python -m pytest tests/test_hopper_compile.py -q

tests/test_kernels_compile.py compiles every dev/cuda file to PTX for sm_80 and sm_90, where the
wgmma code is compiled out; here ptxas assembles the sm_90a build (cubin), so an invalid wgmma,
descriptor or fence operand fails on a machine without a GPU, and no kernel of attention_hopper.cu
may spill at any head size (nor attention_v6.cu's forward at its two tile shapes), nor may ptxas
serialise their wgmma, but for the one measured exception (ACCEPTED below); the launch geometry of attention_v6.py, dev/cuda/attention_v7.py and
attention_v8.py and the backend's (geometry.hopper_geometry) is checked against the kernels' macros at
compile time. -DV6_SM90A is what dev/cuda/attention_v6.py passes to NVRTC with -arch=sm_90a.
Skipped where nvcc is absent.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
DEV = ROOT / "dev" / "cuda"
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")


def nvcc(src, arch, ct, hs, out, *extra):
    cmd = [NVCC, "-std=c++17", f"-arch={arch}", f"-I{KERNELS}", f"-DCT={ct}", f"-DHS={hs}", *extra,
           str(src), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{src.name} (CT={ct}, HS={hs}, {arch}) does not compile:\n{r.stderr}"
    return r.stderr


@pytest.mark.parametrize("hs", [64, 128])
@pytest.mark.parametrize("ct", ["f16", "bf16"])
def test_v6_forward_assembles_for_sm90a_without_spills(ct, hs, tmp_path):
    log = nvcc(DEV / "attention_v6.cu", "sm_90a", ct, hs, tmp_path / "v6.cubin", "--cubin", "-Xptxas", "-v",
               "-DV6_SM90A")
    m = re.search(r"Compiling entry function 'k_attn_flash_fwd'.*?(\d+) bytes spill stores, (\d+) bytes spill loads",
                  log, re.S)
    assert m, f"no ptxas figures for k_attn_flash_fwd:\n{log}"
    assert (int(m.group(1)), int(m.group(2))) == (0, 0), f"k_attn_flash_fwd spills (CT={ct}, HS={hs}):\n{log}"


@pytest.mark.parametrize("arch, wgmma", [("sm_90a", True), ("sm_90", False)])
def test_v6_forward_has_wgmma_only_for_sm90a(arch, wgmma, tmp_path):
    # sm_90a: __CUDA_ARCH_FEAT_SM90_ALL selects version 6; sm_90 (the backend's own NVRTC build) keeps version 4
    nvcc(DEV / "attention_v6.cu", arch, "f16", 64, tmp_path / "v6.ptx", "--ptx")
    ptx = (tmp_path / "v6.ptx").read_text()
    body = ptx[ptx.index(".entry k_attn_flash_fwd("):]  # not k_attn_flash_fwd_v4, version 4 renamed
    body = body[:body.index("\n}\n")]
    assert ("wgmma.mma_async" in body) == wgmma
    assert ("mma.sync" in body) != wgmma


@pytest.mark.parametrize("ct", ["f16", "bf16"])
def test_probes_assemble_for_sm90a(ct, tmp_path):
    nvcc(DEV / "wgmma_probe.cu", "sm_90a", ct, 80, tmp_path / "probe.cubin", "--cubin", "-DV6_SM90A")


@pytest.mark.parametrize("hs", [16, 64, 80, 128])
def test_sidecar_geometry_is_the_kernels(hs, tmp_path):
    # attention_v6.py launches what attention_v6.cu's macros say (the kernel traps otherwise)
    geo = load_dev("attention_v6").geometry(hs)
    check_geometry(tmp_path, DEV / "attention_v6.cu", hs, {"V6_BM": geo["rows"], "V6_BN": geo["keys"],
                                                           "V6_THREADS": geo["threads"], "V6_SMEM": geo["smem"]})


def load_dev(name):
    """A dev/cuda sidecar, imported as attention_bench.load_sidecar does (its folder on sys.path)."""
    import importlib
    import sys
    if str(DEV) not in sys.path:
        sys.path.insert(0, str(DEV))
    return importlib.import_module(name)


def check_geometry(tmp_path, kernel_file, hs, want, defines=None):
    """The compiler checks a launcher's figures against a kernel file's macros: kernel_file built
    for sm_90a at head size hs, after #defines {macro: value} and with a static_assert that each
    macro of want {macro: value} has its value. Returns the PTX."""
    src, ptx = tmp_path / "geometry.cu", tmp_path / "geometry.ptx"
    checks = "".join(f'static_assert({m} == {v}, "{m}");\n' for m, v in want.items())
    src.write_text("".join(f"#define {m} {v}\n" for m, v in (defines or {}).items()) +
                   f'#include "{kernel_file}"\n' + checks)
    nvcc(src, "sm_90a", "f16", hs, ptx, "--ptx", "-DV6_SM90A")
    return ptx.read_text()


def ptxas_figures(log, entry):
    """(registers, spill store bytes, spill load bytes) ptxas reported for entry."""
    m = re.search(rf"Compiling entry function '{entry}'.*?(\d+) bytes spill stores, (\d+) bytes spill loads"
                  rf".*?Used (\d+) registers", log, re.S)
    assert m, f"no ptxas figures for {entry}:\n{log}"
    return int(m.group(3)), int(m.group(1)), int(m.group(2))


# The one exception, chosen by measurement: the default dK/dV build at head size 64 (one warpgroup of
# 64 keys a block, three blocks a multiprocessor, so 168 registers) spills 32 bytes and ptxas
# serialises its wgmma, and it is still the fastest dK/dV measured (H200, 120M shape, 12 layers:
# 1.086 ms, against 1.177 with 48 queries a tile, which neither spills nor serialises, and 1.397 for
# two warpgroups a block; attention_hopper.cu's header). Any other spill or serialisation fails, and
# this one may not grow: {(entry, head size): spill bytes allowed}, for the default -D settings only.
ACCEPTED = {("k_attn_flash_bwd_dkv", 64): 32, ("k_attn_flash_bwd_dkv_fp8", 64): 32}  # and its FP8 form


# the wgmma kernels, and their forms that write FP8 operands (the FP8 epilogues)
ENTRIES = ("k_attn_flash_fwd", "k_attn_flash_bwd_dq", "k_attn_flash_bwd_dkv",
           "k_attn_flash_fwd_fp8", "k_attn_flash_bwd_dq_fp8", "k_attn_flash_bwd_dkv_fp8")


def accepted_spill(entry, hs, defs):
    return 0 if any(d.startswith("-DV7_") for d in defs) else ACCEPTED.get((entry, hs), 0)


# every head size in fp16, the two tile shapes in bf16, and the settings attention_bench.py times
@pytest.mark.parametrize("ct, hs, defs", [("f16", 16, ()), ("f16", 32, ()), ("f16", 48, ()), ("f16", 64, ()),
                                          ("f16", 80, ()), ("f16", 96, ()), ("f16", 112, ()), ("f16", 128, ()),
                                          ("bf16", 64, ()), ("bf16", 128, ()), ("bf16", 64, ("-DFP8_E5M2=1",)),
                                          ("f16", 64, ("-DV7_SWIZZLE=0", "-DV7_KWG=2", "-DV7_DKV_BLOCKS=1")),
                                          ("f16", 64, ("-DV7_KWG=1", "-DV7_BQ=48", "-DV7_DKV_BLOCKS=3")),
                                          ("f16", 64, ("-DV7_KWG=1", "-DV7_BQ=32", "-DV7_DKV_BLOCKS=3")),
                                          ("f16", 64, ("-DV7_KWG=2", "-DV7_DKV_BLOCKS=1", "-DV7_LOADS=0")),
                                          ("f16", 64, ("-DV7_KWG=3", "-DV7_BQ=32", "-DV7_DKV_BLOCKS=1")),
                                          ("f16", 64, ("-DV7_KWG=3", "-DV7_BQ=48", "-DV7_DKV_BLOCKS=1")),
                                          ("f16", 64, ("-DV8_OVERLAP=1", "-DV8_STAGES=4")),
                                          ("f16", 64, ("-DV8_WG=3", "-DV8_BN=128", "-DV8_BLOCKS=1", "-DV8_OVERLAP=1")),
                                          ("f16", 64, ("-DV8_WG=1", "-DV8_BLOCKS=4"))])
def test_hopper_kernels_assemble_for_sm90a_without_spills(ct, hs, defs, tmp_path):
    log = nvcc(KERNELS / "attention_hopper.cu", "sm_90a", ct, hs, tmp_path / "v7.cubin", "--cubin", "-Xptxas",
               "-v", *defs)
    for entry in ENTRIES:
        regs, st, ld = ptxas_figures(log, entry)
        allowed = accepted_spill(entry, hs, defs)
        assert st <= allowed and ld <= allowed, f"{entry} spills (CT={ct}, HS={hs}): {st} bytes stored, {ld} loaded"
        assert regs <= 255
    # the forward's default: 128 registers, so that two blocks of 256 threads share a multiprocessor
    if not any(d.startswith("-DV8_") for d in defs):
        assert ptxas_figures(log, "k_attn_flash_fwd")[0] <= 128
        assert ptxas_figures(log, "k_attn_flash_fwd_fp8")[0] <= 128
    # the dK/dV default at head size 64: 168 registers, three blocks of 128 threads a multiprocessor
    if hs == 64 and not any(d.startswith("-DV7_") for d in defs):
        assert ptxas_figures(log, "k_attn_flash_bwd_dkv")[0] <= 168
        assert ptxas_figures(log, "k_attn_flash_bwd_dkv_fp8")[0] <= 168
    # ptxas serialises the wgmma pipeline (C7510-C7520 "Potential Performance Loss") when it cannot
    # keep the accumulators of products in flight apart: the overlap would be lost silently
    serialised = set(re.findall(r"Potential Performance Loss: .*? for the function '(\w+)'", log))
    assert len(serialised) == log.count("Potential Performance Loss"), log
    assert all(accepted_spill(f, hs, defs) for f in serialised), log


@pytest.mark.parametrize("arch, wgmma", [("sm_90a", True), ("sm_90", False)])
def test_hopper_kernels_have_wgmma_only_for_sm90a(arch, wgmma, tmp_path):
    # sm_90a: versions 8 and 7 take version 4's names; sm_90 (CuPy's build) keeps version 4's kernels
    nvcc(KERNELS / "attention_hopper.cu", arch, "f16", 64, tmp_path / "v7.ptx", "--ptx")
    ptx = (tmp_path / "v7.ptx").read_text()
    for entry in ("k_attn_flash_fwd", "k_attn_flash_bwd_dq", "k_attn_flash_bwd_dkv"):
        body = ptx[ptx.index(f".entry {entry}("):]  # not the _v4 names, version 4 renamed
        body = body[:body.index("\n}\n")]
        assert ("wgmma.mma_async" in body) == wgmma, entry
        assert ("mma.sync" in body) != wgmma, entry
    assert ("k_attn_flash_bwd_dkv_v4" in ptx) == wgmma
    assert ("k_attn_flash_fwd_v4" in ptx) == wgmma


@pytest.mark.parametrize("hs, tune", [(16, {}), (64, {}), (80, {}), (128, {}), (64, {"wg": 3, "bn": 128, "stages": 4}),
                                      (64, {"wg": 1, "overlap": 1})])
def test_v8_sidecar_geometry_is_the_kernels(hs, tune, tmp_path):
    v8 = load_dev("attention_v8")
    geo = v8.geometry(hs, tune)
    check_geometry(tmp_path, KERNELS / "attention_hopper.cu", hs,
                   {"V8_BM": geo["rows"], "V8_BN": geo["keys"], "V8_THREADS": geo["threads"], "V8_SMEM": geo["smem"]},
                   {v8.TUNABLE[k]: v for k, v in tune.items()})


@pytest.mark.parametrize("hs, tune", [(16, {}), (64, {}), (80, {}), (128, {}), (64, {"kwg": 3, "bq": 32, "bn": 128}),
                                      (64, {"kwg": 2, "dqwg": 1, "dkv_blocks": 1})])
def test_v7_sidecar_geometry_is_the_kernels(hs, tune, tmp_path):
    v7 = load_dev("attention_v7")
    geo = v7.geometry(hs, tune)
    check_geometry(tmp_path, KERNELS / "attention_hopper.cu", hs,
                   {"V7_DKV_THREADS": geo["dkv_threads"], "V7_DQ_THREADS": geo["dq_threads"], "V7_BK": geo["keys"],
                    "V7_QM": geo["rows"], "V7_DKV_SMEM": geo["dkv_smem"], "V7_DQ_SMEM": geo["dq_smem"]},
                   {v7.TUNABLE[k]: v for k, v in tune.items()})


@pytest.mark.parametrize("hs", [16, 32, 64, 80, 128])
def test_backend_hopper_geometry_is_the_kernels(hs, tmp_path):
    # what CudaBackend launches on compute capability 9.0 (geometry.hopper_geometry) is what the package's
    # attention_hopper.cu defines with its default settings (the kernels trap otherwise)
    from andrea.backends.cuda.geometry import hopper_geometry
    geo = hopper_geometry(hs)
    check_geometry(tmp_path, KERNELS / "attention_hopper.cu", hs,
                   {"V7_DKV_THREADS": geo["dkv_threads"], "V7_DQ_THREADS": geo["threads"], "V7_BK": geo["keys"],
                    "V7_QM": geo["rows"], "V7_DKV_SMEM": geo["k_attn_flash_bwd_dkv"],
                    "V7_DQ_SMEM": geo["k_attn_flash_bwd_dq"], "V8_THREADS": geo["threads"],
                    "V8_BM": geo["fwd_rows"], "V8_SMEM": geo["k_attn_flash_fwd"]})


def test_hopper_geometry_tune_names_are_checked():
    """The one geometry takes the sidecars' settings by its own names and refuses others."""
    from andrea.backends.cuda.geometry import hopper_geometry
    assert hopper_geometry(64, {"fwd_wg": 3})["fwd_threads"] == 384 and hopper_geometry(64)["fwd_threads"] == 256
    with pytest.raises(ValueError, match="tune \\['wg'\\]"):
        hopper_geometry(64, {"wg": 3})
