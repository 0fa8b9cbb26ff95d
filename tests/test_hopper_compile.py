"""The Hopper kernels compile to sm_90a machine code, with the wgmma path in, and build without it for
plain sm_90 (CPU only): the package's attention_hopper.cu (forward version 8, backward version 7),
dev/cuda's first forward variant (attention_v6.cu) and probes (wgmma_probe.cu), and the one-pass
backward candidate (attention_v9.cu: no spills, no serialised wgmma, no atomics, its sidecar's geometry).

    python -m pytest tests/test_hopper_compile.py -q

tests/test_kernels_compile.py compiles every dev/cuda file to PTX for sm_80 and sm_90, where the
wgmma code is compiled out; here ptxas assembles the sm_90a build (cubin), so an invalid wgmma,
descriptor or fence operand fails on a machine without a GPU, and no kernel of attention_hopper.cu
may spill at any head size (nor attention_v6.cu's forward at its two tile shapes), nor may ptxas
serialise their wgmma; the launch geometry of attention_v6.py, dev/cuda/attention_v7.py and
attention_v8.py and the backend's (ops.hopper_geometry) is checked against the kernels' macros at
compile time. -DV6_SM90A is what dev/cuda/attention_v6.py passes to NVRTC with -arch=sm_90a.
Skipped where nvcc is absent.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "andrea" / "kernels"
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
    # attention_v6.py launches what attention_v6.cu's macros say (the kernel traps otherwise): the
    # compiler checks the launcher's figures against the macros
    import importlib.util
    spec = importlib.util.spec_from_file_location("dev_cuda_attention_v6", DEV / "attention_v6.py")
    v6 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(v6)
    geo = v6.geometry(hs)
    src = tmp_path / "geometry.cu"
    src.write_text(f'#include "{DEV / "attention_v6.cu"}"\n'
                   f'static_assert(V6_BM == {geo["rows"]}, "rows");\n'
                   f'static_assert(V6_BN == {geo["keys"]}, "keys");\n'
                   f'static_assert(V6_THREADS == {geo["threads"]}, "threads");\n'
                   f'static_assert(V6_SMEM == {geo["smem"]}, "smem");\n')
    nvcc(src, "sm_90a", "f16", hs, tmp_path / "geometry.ptx", "--ptx", "-DV6_SM90A")


def load_dev(name):
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location(f"dev_cuda_{name}", DEV / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def ptxas_figures(log, entry):
    """(registers, spill store bytes, spill load bytes) ptxas reported for entry."""
    m = re.search(rf"Compiling entry function '{entry}'.*?(\d+) bytes spill stores, (\d+) bytes spill loads"
                  rf".*?Used (\d+) registers", log, re.S)
    assert m, f"no ptxas figures for {entry}:\n{log}"
    return int(m.group(3)), int(m.group(1)), int(m.group(2))


# every head size in fp16, the two tile shapes in bf16, and the settings attention_bench.py times
@pytest.mark.parametrize("ct, hs, defs", [("f16", 16, ()), ("f16", 32, ()), ("f16", 48, ()), ("f16", 64, ()),
                                          ("f16", 80, ()), ("f16", 96, ()), ("f16", 112, ()), ("f16", 128, ()),
                                          ("bf16", 64, ()), ("bf16", 128, ()), ("f16", 64, ("-DV7_SWIZZLE=0",)),
                                          ("f16", 64, ("-DV7_KWG=3", "-DV7_BQ=32")),
                                          ("f16", 64, ("-DV7_KWG=3", "-DV7_BQ=48")),
                                          ("f16", 64, ("-DV8_OVERLAP=1", "-DV8_STAGES=4")),
                                          ("f16", 64, ("-DV8_WG=3", "-DV8_BN=128", "-DV8_BLOCKS=1", "-DV8_OVERLAP=1")),
                                          ("f16", 64, ("-DV8_WG=1", "-DV8_BLOCKS=4"))])
def test_hopper_kernels_assemble_for_sm90a_without_spills(ct, hs, defs, tmp_path):
    log = nvcc(KERNELS / "attention_hopper.cu", "sm_90a", ct, hs, tmp_path / "v7.cubin", "--cubin", "-Xptxas",
               "-v", *defs)
    for entry in ("k_attn_flash_fwd", "k_attn_flash_bwd_dq", "k_attn_flash_bwd_dkv"):
        regs, st, ld = ptxas_figures(log, entry)
        assert (st, ld) == (0, 0), f"{entry} spills (CT={ct}, HS={hs}): {st} bytes stored, {ld} loaded"
        assert regs <= 255
    # the forward's default: 128 registers, so that two blocks of 256 threads share a multiprocessor
    if not any(d.startswith("-DV8_") for d in defs):
        assert ptxas_figures(log, "k_attn_flash_fwd")[0] <= 128
    # ptxas serialises the wgmma pipeline (C7510-C7520 "Potential Performance Loss") when it cannot
    # keep the accumulators of products in flight apart: the overlap would be lost silently
    assert "Potential Performance Loss" not in log, log


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
    src = tmp_path / "geometry8.cu"
    src.write_text("".join(f"#define {v8.TUNABLE[k]} {v}\n" for k, v in tune.items()) +
                   f'#include "{KERNELS / "attention_hopper.cu"}"\n'
                   f'static_assert(V8_BM == {geo["rows"]}, "rows");\n'
                   f'static_assert(V8_BN == {geo["keys"]}, "keys");\n'
                   f'static_assert(V8_THREADS == {geo["threads"]}, "threads");\n'
                   f'static_assert(V8_SMEM == {geo["smem"]}, "smem");\n')
    nvcc(src, "sm_90a", "f16", hs, tmp_path / "geometry8.ptx", "--ptx", "-DV6_SM90A")


@pytest.mark.parametrize("hs, tune", [(16, {}), (64, {}), (80, {}), (128, {}), (64, {"kwg": 3, "bq": 32, "bn": 128})])
def test_v7_sidecar_geometry_is_the_kernels(hs, tune, tmp_path):
    v7 = load_dev("attention_v7")
    geo = v7.geometry(hs, tune)
    src = tmp_path / "geometry7.cu"
    src.write_text("".join(f"#define {v7.TUNABLE[k]} {v}\n" for k, v in tune.items()) +
                   f'#include "{KERNELS / "attention_hopper.cu"}"\n'
                   f'static_assert(V7_DKV_THREADS == {geo["dkv_threads"]}, "dkv threads");\n'
                   f'static_assert(V7_DQ_THREADS == {geo["dq_threads"]}, "dq threads");\n'
                   f'static_assert(V7_BK == {geo["keys"]}, "keys");\n'
                   f'static_assert(V7_QM == {geo["rows"]}, "rows");\n'
                   f'static_assert(V7_DKV_SMEM == {geo["dkv_smem"]}, "dkv smem");\n'
                   f'static_assert(V7_DQ_SMEM == {geo["dq_smem"]}, "dq smem");\n')
    nvcc(src, "sm_90a", "f16", hs, tmp_path / "geometry7.ptx", "--ptx", "-DV6_SM90A")


@pytest.mark.parametrize("hs", [16, 32, 64, 80, 128])
def test_backend_hopper_geometry_is_the_kernels(hs, tmp_path):
    # what CudaOps launches on compute capability 9.0 (ops.hopper_geometry) is what the package's
    # attention_hopper.cu defines with its default settings (the kernels trap otherwise)
    from andrea.backends.cuda.ops import hopper_geometry
    geo = hopper_geometry(hs)
    src = tmp_path / "geometry_ops.cu"
    src.write_text(f'#include "{KERNELS / "attention_hopper.cu"}"\n'
                   f'static_assert(V7_DKV_THREADS == {geo["threads"]} && V7_DQ_THREADS == {geo["threads"]}, "threads");\n'
                   f'static_assert(V7_BK == {geo["keys"]} && V7_QM == {geo["rows"]}, "rows a block");\n'
                   f'static_assert(V7_DKV_SMEM == {geo["k_attn_flash_bwd_dkv"]}, "dkv smem");\n'
                   f'static_assert(V7_DQ_SMEM == {geo["k_attn_flash_bwd_dq"]}, "dq smem");\n'
                   f'static_assert(V8_THREADS == {geo["threads"]} && V8_BM == {geo["fwd_rows"]}, "forward block");\n'
                   f'static_assert(V8_SMEM == {geo["k_attn_flash_fwd"]}, "forward smem");\n')
    nvcc(src, "sm_90a", "f16", hs, tmp_path / "geometry_ops.ptx", "--ptx")


# dev/cuda/attention_v9.cu (the one-pass backward, head size 64): every setting attention_bench.py
# times assembles without spills or serialised wgmma, and the consumers' setmaxnreg fits the block
@pytest.mark.parametrize("ct, defs", [("f16", ()), ("bf16", ()), ("f16", ("-DV9_BUFS=2",)), ("f16", ("-DV9_UNROLL=4",))])
def test_v9_assembles_for_sm90a_without_spills(ct, defs, tmp_path):
    log = nvcc(DEV / "attention_v9.cu", "sm_90a", ct, 64, tmp_path / "v9.cubin", "--cubin", "-Xptxas", "-v",
               "-DV6_SM90A", *defs)
    regs, st, ld = ptxas_figures(log, "k_attn_flash_bwd9")
    assert (st, ld) == (0, 0), f"k_attn_flash_bwd9 spills (CT={ct}, {defs}): {st} bytes stored, {ld} loaded"
    assert regs <= 168  # 384 threads: what setmaxnreg redistributes
    assert "Potential Performance Loss" not in log, log


def test_v9_is_only_built_at_head_size_64_for_sm90a(tmp_path):
    for arch, hs, present in (("sm_90a", 64, True), ("sm_90a", 80, False), ("sm_90", 64, False)):
        nvcc(DEV / "attention_v9.cu", arch, "f16", hs, tmp_path / "v9.ptx", "--ptx")
        ptx = (tmp_path / "v9.ptx").read_text()
        assert (".entry k_attn_flash_bwd9(" in ptx) == present, (arch, hs)
        if present:
            body = ptx[ptx.index(".entry k_attn_flash_bwd9("):]
            body = body[:body.index("\n}\n")]
            assert "setmaxnreg.inc" in body and "ld.acquire.gpu" in body and "st.release.gpu" in body
            # the dQ additions are ordered, not atomic: no atom.* / red.* instruction
            assert not re.search(r"^\s*(@%p\d+\s+)?(atom|red)\.", body, re.M)


@pytest.mark.parametrize("tune", [{}, {"bufs": 1}, {"bufs": 2}, {"bufs": 3}])
def test_v9_sidecar_geometry_is_the_kernels(tune, tmp_path):
    v9 = load_dev("attention_v9")
    geo = v9.geometry(64, tune)
    src = tmp_path / "geometry9.cu"
    src.write_text("".join(f"#define {v9.TUNABLE[k]} {v}\n" for k, v in tune.items()) +
                   f'#include "{DEV / "attention_v9.cu"}"\n'
                   "#ifdef __CUDA_ARCH__\n"  # the kernel's macros exist in the device pass only
                   f'static_assert(V9_THREADS == {geo["threads"]}, "threads");\n'
                   f'static_assert(V9_BK == {geo["keys"]}, "keys");\n'
                   f'static_assert(V9_BQ == {geo["rows"]}, "rows");\n'
                   f'static_assert(V9_SMEM == {geo["smem"]}, "smem");\n'
                   "#endif\n")
    nvcc(src, "sm_90a", "f16", 64, tmp_path / "geometry9.ptx", "--ptx", "-DV6_SM90A")
    assert ".entry k_attn_flash_bwd9(" in (tmp_path / "geometry9.ptx").read_text()
