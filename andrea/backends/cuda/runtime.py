"""Compiling and launching the kernels of kernels/*.cu: one Runtime per backend object.

Each kernels/<op>.cu (andrea.paths.KERNEL_DIR) is compiled at run time by NVRTC (cupy.RawModule),
once per compute dtype (-DCT=float|f16|bf16, picked from the arrays) and set of extra -D options,
and cached on the Runtime. Every `#include "name"` (common.cuh; in a dev/cuda variant, also the
package file it varies) is pasted in before compiling (kernel_source), so that CuPy's on-disk
cache key covers it. `sources` maps a file name to another source (a dev/cuda variant) for this
Runtime only.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ...paths import KERNEL_DIR

try:  # the package imports without CuPy (interface checks on CPU machines); Runtime() needs it
    import cupy as cp
except ImportError:
    cp = None

try:  # registers numpy's "bfloat16" dtype where ml_dtypes is installed (bf16 precision)
    import ml_dtypes  # noqa: F401
except ImportError:
    pass

INCLUDE = re.compile(r'^[ \t]*#include "([^"]+)"[ \t]*$', re.M)


def kernel_source(path: Path, dirs=(KERNEL_DIR,)) -> str:
    """The text NVRTC compiles (it is given no include path): path with every `#include "name"`
    pasted in, recursively, each file once (later includes of it become a comment). A name is
    looked up beside the including file first, then in dirs, so a dev/cuda variant can include
    the package file it varies ("attention.cu") and common.cuh."""
    seen = set()

    def expand(p: Path) -> str:
        def paste(m):
            name = m.group(1)
            found = next((d / name for d in (p.parent, *map(Path, dirs)) if (d / name).is_file()), None)
            if found is None:
                raise FileNotFoundError(f"{p}: #include \"{name}\" is neither beside it nor in "
                                        f"{', '.join(str(d) for d in dirs)}")
            key = found.resolve()
            if key in seen:
                return f"// {name}: pasted above"
            seen.add(key)
            return expand(found)
        return INCLUDE.sub(paste, p.read_text())
    seen.add(Path(path).resolve())
    return expand(Path(path))


def arch_module(text: str, name: str, options, arch: str):
    """text compiled by NVRTC for arch (e.g. "sm_90a") and loaded as a cubin. CuPy's RawModule
    appends its own -arch, built from the device's compute capability as an integer, so it cannot
    ask for an architecture-specific target: Hopper's wgmma.mma_async exists only for sm_90a.
    -ftz=true as RawModule compiles every other kernel. Not cached on disk (compiled once per
    process and module)."""
    from cupy.cuda import function
    from cupy_backends.cuda.libs import nvrtc
    opts = tuple(options) + (f"-arch={arch}", "-ftz=true")
    prog = nvrtc.createProgram(text, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{name}: NVRTC {' '.join(opts)} failed:\n{nvrtc.getProgramLog(prog)}") from e
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    mod = function.Module()
    mod.load(cubin)
    return mod


def _allow_shared(f, nbytes: int, granted: dict):
    """Let kernel f take nbytes of dynamic shared memory: a RawKernel has the attribute as a
    property; an arch_module Function (cupy.cuda.function) goes through the driver, once per
    size (granted: id(f) -> bytes, kept by the Runtime with the kernels)."""
    if hasattr(f, "max_dynamic_shared_size_bytes"):
        if f.max_dynamic_shared_size_bytes < nbytes:
            f.max_dynamic_shared_size_bytes = nbytes
        return
    if granted.get(id(f), 0) < nbytes:
        from cupy_backends.cuda.api import driver
        attr = getattr(driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
        driver.funcSetAttribute(f.ptr, attr, nbytes)
        granted[id(f)] = nbytes


THREADS = 256
MAX_BLOCKS = 8192  # grid-stride kernels: enough blocks to fill 132 SMs, few enough to stay cheap


def require_cupy():
    if cp is None:
        raise RuntimeError("the CUDA backend needs CuPy: install the cuda12 or cuda13 extra on a GPU machine")
    return cp


def ct_name(dtype) -> str:
    """The -DCT name of a compute dtype."""
    dt = np.dtype(dtype)
    if dt == np.float32:
        return "float"
    if dt == np.float16:
        return "f16"
    if dt.name == "bfloat16":
        return "bf16"
    raise TypeError(f"compute dtype {dt}: expected float32, float16 or bfloat16")


class Runtime:
    """The compiled modules and kernel handles of one backend object."""

    def __init__(self, sources=None, directory=None):
        require_cupy()
        self.dir = Path(directory) if directory is not None else KERNEL_DIR
        self.sources = {name: Path(p) for name, p in (sources or {}).items()}
        self.modules: dict = {}
        self.funcs: dict = {}
        self.smem_granted: dict = {}  # id(kernel) -> dynamic shared memory allowed (arch_module kernels)
        # programmatic dependent launch (cuda/pdl.py, CudaBackend(pdl=...)): kernels whose body starts with
        # pdl_wait() launched through cuLaunchKernelEx with the programmatic attribute, on sm_90
        # and newer. On by default: ANDREA-120M fp8 on an H200, the step's graphs replayed 0.19 ms
        # faster (12.44 against 12.62 ms, 15 rounds), the same bits (docs/ARCHITECTURE.md "Launch")
        self.pdl = True
        self._pdl_ready: dict = {}  # fname -> the names of its kernels that call pdl_wait() first
        self._pdl_driver = None
        self._pdl_arch_ok = None
        self.pdl_launches = 0  # launches made with the attribute (the tests' check that it was used)

    def source(self, fname: str) -> str:
        path = self.sources.get(fname, self.dir / fname)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: kernel source missing (the CUDA backend reads the package's "
                                    "kernels/; reinstall the package)")
        return kernel_source(path, (self.dir,))

    def function(self, fname: str, kernel: str, dtype, defs=(), arch=None):
        """The compiled kernel; defs are extra -D options (compile-time sizes, e.g. attention's HS).
        arch: None builds for the device's own architecture (CuPy's RawModule, cached on disk);
        an architecture-specific target such as "sm_90a" (wgmma) goes through arch_module."""
        key = (fname, kernel, ct_name(dtype), defs, arch)
        f = self.funcs.get(key)
        if f is None:
            mkey = (fname, key[2], defs, arch)
            mod = self.modules.get(mkey)
            if mod is None:
                opts = ("-std=c++17", f"-DCT={key[2]}") + tuple(defs)
                mod = self.modules[mkey] = (cp.RawModule(code=self.source(fname), options=opts) if arch is None
                                            else arch_module(self.source(fname), fname, opts, arch))
            f = self.funcs[key] = mod.get_function(kernel)
        return f

    def launch(self, fname, kernel, dtype, grid, block, args, shared_mem=0, hs=None, defs=(), arch=None):
        """Launch kernel of kernels/<fname> compiled for dtype (and arch, see function), on the
        current stream."""
        defs = tuple(defs) + ((f"-DHS={hs}",) if hs else ())
        f = self.function(fname, kernel, dtype, defs, arch)
        if shared_mem > 48 * 1024:
            _allow_shared(f, shared_mem, self.smem_granted)  # the opt-in above the default 48 KB, once per kernel and size
        if self.pdl and self._pdl_launchable(fname, kernel):
            ptr = f.kernel.ptr if hasattr(f, "kernel") else f.ptr  # a RawKernel's Function, or an arch_module's
            self._pdl_driver.launch(kernel, ptr, grid, block, shared_mem, cp.cuda.get_current_stream().ptr, args,
                                    cp.ndarray)
            self.pdl_launches += 1
            return
        f(grid if isinstance(grid, tuple) else (grid,), block if isinstance(block, tuple) else (block,), args,
          shared_mem=shared_mem)

    def _pdl_launchable(self, fname: str, kernel: str) -> bool:
        """Whether kernel of fname may take the programmatic attribute: its source calls pdl_wait()
        first (pdl.ready_kernels, once per file) and the device is sm_90 or newer."""
        if self._pdl_arch_ok is None:
            from .pdl import Driver
            self._pdl_arch_ok = int(cp.cuda.Device().compute_capability) >= 90
            self._pdl_driver = Driver() if self._pdl_arch_ok else None
        if not self._pdl_arch_ok:
            return False
        ready = self._pdl_ready.get(fname)
        if ready is None:
            from .pdl import ready_kernels
            ready = self._pdl_ready[fname] = ready_kernels(self.source(fname))
        return kernel in ready


def blocks(n: int, per_block: int = THREADS) -> int:
    return max(1, min(MAX_BLOCKS, -(-n // per_block)))


def i32(x):
    return np.int32(x)


def i64(x):
    return np.int64(x)


def check(kernel: str, name: str, a, shape=None, dtype=None):
    """Raise a clear error unless a is a C-contiguous CuPy array of this shape and dtype."""
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{kernel}: {name} must be a CuPy array, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{kernel}: {name} must be C-contiguous (strides {a.strides})")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise TypeError(f"{kernel}: {name} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{kernel}: {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
