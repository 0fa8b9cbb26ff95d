"""attention_v6.cu's forward launch: k_attn_flash_fwd through wgmma, compiled for sm_90a.

The backend's Runtime (andrea/backends/cuda/runtime.py) compiles a kernel file with
cupy.RawModule(code=..., options=("-std=c++17", "-DCT=..", ...)) and passes no architecture;
CuPy then appends -arch=sm_<the device's compute capability>, i.e. sm_90 on an H200. wgmma.mma_async
(and setmaxnreg) exist only for the architecture-specific target sm_90a, and CuPy builds that flag
from an integer, so it cannot be asked for "90a". Here the file is compiled by NVRTC directly
(cupy_backends.cuda.libs.nvrtc) with -arch=sm_90a and loaded as a cubin; the kernels the backend's
own launchers run (version 4's backward, k_attn_flash_D, version 1) still come from the Runtime,
built for sm_90, where attention_v6.cu compiles version 4's forward instead (V6_WGMMA is 0).
Where the device is not compute capability 9.0, or version 4's fused path does not apply, the
backend's own launcher runs (version 4's forward from this file).

The package has since taken the same road for kernels/attention_hopper.cu (Runtime.function with
arch="sm_90a", andrea/backends/cuda/runtime.py), and version 8 superseded this forward. The file
stays for its sm_90a build and load pieces (compile_sm90a, Sm90aModule, tuned_module, is_hopper),
which attention_v7.py, attention_v8.py and attention_bench.py's parallel prebuild use, and as the
launcher of attention_v6.cu, on which wgmma_probe.cu builds.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from andrea.backends.cuda.runtime import check, ct_name, i32, kernel_source

HERE = Path(__file__).resolve().parent
V6_WG = 2  # warpgroups per block (V6_WG in attention_v6.cu)
# -ftz=true as CuPy compiles the Runtime's kernels; -DV6_SM90A selects the wgmma forward (attention_v6.cu)
NVRTC_OPTIONS = ("-std=c++17", "-arch=sm_90a", "-ftz=true", "-DV6_SM90A")
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def geometry(hs: int) -> dict:
    """Version 6's forward launch for head size hs, as attention_v6.cu defines it (V6_BM, V6_BN,
    V6_THREADS, V6_SMEM; the kernel traps on a different block size or less shared memory)."""
    rows, keys = 64 * V6_WG, (128 if hs <= 64 else 64)
    return {"rows": rows, "keys": keys, "threads": 128 * V6_WG, "smem": (rows + 4 * keys) * hs * 2}


def source(path: Path) -> str:
    """The text NVRTC compiles: path with its includes pasted in, as the Runtime does (NVRTC is
    given no include path): dev/cuda files beside it, common.cuh from kernels."""
    return kernel_source(path)


def compile_sm90a(text: str, name: str, ct: str, defs=()) -> bytes:
    """The cubin of text compiled by NVRTC for sm_90a with -DCT=ct and defs (e.g. "-DHS=64")."""
    from cupy_backends.cuda.libs import nvrtc
    opts = NVRTC_OPTIONS + (f"-DCT={ct}",) + tuple(defs)
    prog = nvrtc.createProgram(text, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{name}: NVRTC {' '.join(opts)} failed:\n{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


class Sm90aModule:
    """One cubin loaded with the driver; launch() as Runtime.launch, without the compiling."""

    def __init__(self, cubin: bytes):
        from cupy.cuda import function
        self.mod = function.Module()
        self.mod.load(cubin)
        self.funcs, self.smem = {}, {}

    def launch(self, kernel, grid, block, args, shared_mem=0):
        from cupy_backends.cuda.api import driver
        f = self.funcs.get(kernel)
        if f is None:
            f = self.funcs[kernel] = self.mod.get_function(kernel)
        if shared_mem > 48 * 1024 and self.smem.get(kernel, 0) < shared_mem:  # the opt-in, once per size
            attr = getattr(driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", _MAX_DYNAMIC_SHARED)
            driver.funcSetAttribute(f.ptr, attr, shared_mem)
            self.smem[kernel] = shared_mem
        f(grid if isinstance(grid, tuple) else (grid,), block if isinstance(block, tuple) else (block,), args,
          shared_mem=shared_mem)


def tuned_build(path: Path, tunable: dict, ct: str, hs: int, tune=None):
    """(cache key, -D options) of path's sm_90a build for compute dtype name ct, head size hs and
    tune ({key of tunable: int}, each key's macro overriding the file's default): the key names
    the options, so that one build serves every sidecar that asks for the same."""
    tune = tune or {}
    unknown = set(tune) - set(tunable)
    if unknown:
        raise ValueError(f"{path.stem} tune: unknown {sorted(unknown)}; expected some of {sorted(tunable)}")
    defs = (f"-DHS={hs}",) + tuple(f"-D{tunable[k]}={v}" for k, v in sorted(tune.items()))
    return (str(path), ct) + defs, defs


def tuned_module(cache: dict, path: Path, tunable: dict, what: str, ct: str, hs: int, tune=None) -> "Sm90aModule":
    """path built for sm_90a (tuned_build's options), once per cache and settings; what: the words
    of the line printed when it compiles."""
    key, defs = tuned_build(path, tunable, ct, hs, tune)
    if key not in cache:
        cache[key] = Sm90aModule(compile_sm90a(source(path), path.name, ct, defs))
        print(f"{path.name}: compiled for sm_90a ({what}), CT={ct} {' '.join(defs)}", file=sys.stderr)
    return cache[key]


def is_hopper() -> bool:
    import cupy as cp
    return int(cp.cuda.Device().compute_capability) == 90


def module(cache: dict, ct: str, hs: int, path: Path = HERE / "attention_v6.cu") -> Sm90aModule:
    """attention_v6.cu built for sm_90a, compute dtype name ct ("f16", "bf16") and head size hs,
    once per cache (a dict the caller keeps)."""
    key = (str(path), ct, hs)
    if key not in cache:
        cache[key] = Sm90aModule(compile_sm90a(source(path), path.name, ct, (f"-DHS={hs}",)))
        print(f"{path.name}: compiled for sm_90a (wgmma forward), CT={ct} HS={hs}", file=sys.stderr)
    return cache[key]


def launch_fwd(cache: dict, ct: str, out, lse, qkv, B: int, T: int, NH: int, hs: int):
    """Version 6's k_attn_flash_fwd: out (B,T,C), lse (B*NH, T) from qkv (B,T,3C); the arrays as
    version 4's launcher gives them (16-bit, 16-byte aligned)."""
    geo = geometry(hs)
    module(cache, ct, hs).launch("k_attn_flash_fwd", (B * NH, -(-T // geo["rows"])), geo["threads"],
                                 (out, lse, qkv, i32(B), i32(T), i32(NH), np.float32(1.0 / math.sqrt(hs))),
                                 shared_mem=geo["smem"])


def k_attn_fwd(be, out, lse, qkv, n_head):
    """The backend's k_attn_fwd with version 6's forward on compute capability 9.0."""
    check("k_attn_fwd", "qkv", qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    if C3 % 3 or C % n_head:
        raise ValueError(f"k_attn_fwd: qkv last axis {C3} must be 3*C with C divisible by n_head={n_head}")
    hs, ct = C // n_head, qkv.dtype
    if not (is_hopper() and be._fused(ct, hs, qkv, out)):
        return type(be).k_attn_fwd(be, out, lse, qkv, n_head)  # version 4's forward, from attention_v6.cu
    check("k_attn_fwd", "out", out, (B, T, C), ct)
    check("k_attn_fwd", "lse", lse, (B, n_head, T), np.float32)
    launch_fwd(be.__dict__.setdefault("_sm90a_modules", {}), ct_name(ct), out, lse, qkv, B, T, n_head, hs)
