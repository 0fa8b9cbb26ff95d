"""Programmatic dependent launch: a kernel launched through the driver's cuLaunchKernelEx with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so that its grid may start while the kernel
before it in the stream drains (Runtime.pdl; docs/ARCHITECTURE.md "Launch").

CuPy's kernel call does not take launch attributes, so this module packs the arguments the way
CuPy does (an array as its device pointer, a NumPy scalar as its bytes, a Python int as int64 and
a float as float64) and calls the driver through ctypes. Captured into a CUDA graph, such a launch
becomes a programmatic edge from the kernel before it; a memset or a library's kernel before it
keeps the ordinary edge. Correctness rests on the kernel: it must call common.cuh's pdl_wait()
before it touches memory (ready_kernels finds the kernels that do; the Runtime launches only
those this way).
"""
from __future__ import annotations

import ctypes
import re

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
WAIT = "pdl_wait();"  # common.cuh: the first statement of every kernel that may be launched so,
PREFETCH_WAIT = "pdl_prefetch_wait("  # or this one: L2 hints of memory no kernel before it writes, then the wait


class _AttrValue(ctypes.Union):
    """CUlaunchAttributeValue: 64 bytes, 8-aligned; programmaticStreamSerializationAllowed is an
    int at its start."""
    _fields_ = [("pad", ctypes.c_char * 64), ("as_int", ctypes.c_int), ("align", ctypes.c_uint64)]


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, the value."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_GLOBAL = re.compile(r"__global__")
_NAME = re.compile(r"(\w+)\s*\(")


def ready_kernels(text: str) -> frozenset:
    """The names of the __global__ functions in kernel source text whose body starts with
    pdl_wait() or pdl_prefetch_wait(...): the kernels that may be launched with the programmatic attribute. A kernel whose
    body starts with anything else (a dev/cuda variant written before the attribute) is left out
    and launched as before."""
    names = set()
    for m in _GLOBAL.finditer(text):
        brace = text.find("{", m.end())
        if brace < 0:
            break
        head = text[m.end():brace]
        name = next((n for n in _NAME.findall(head) if n != "__launch_bounds__"), None)
        body = text[brace + 1:brace + 1 + 4 * len(WAIT)].lstrip()
        if name is not None and body.startswith((WAIT, PREFETCH_WAIT)):
            names.add(name)
    return frozenset(names)


def _dims(d) -> tuple:
    d = tuple(d) if isinstance(d, tuple) else (d,)
    if not 1 <= len(d) <= 3:
        raise ValueError(f"launch dimensions {d}: expected 1 to 3 of them")
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


def pack_args(args, ndarray_type=None) -> tuple:
    """(void** array, kept) for cuLaunchKernelEx's kernelParams: each argument's bytes in a ctypes
    object (kept alive by the caller while the launch is made), as CuPy passes them. ndarray_type:
    the device array class (cupy.ndarray), whose data.ptr is passed."""
    kept = []
    for i, a in enumerate(args):
        if ndarray_type is not None and isinstance(a, ndarray_type):
            kept.append(ctypes.c_void_p(a.data.ptr))
            continue
        if isinstance(a, (bool, np.bool_)):
            a = np.bool_(a)
        elif isinstance(a, int):
            a = np.int64(a)
        elif isinstance(a, float):
            a = np.float64(a)
        if not isinstance(a, np.generic) or a.dtype.kind not in "biuf":
            raise TypeError(f"kernel argument {i}: {type(a).__name__} cannot be passed to a kernel "
                            "(expected a device array or a NumPy number)")
        raw = a.tobytes()
        kept.append((ctypes.c_char * len(raw)).from_buffer_copy(raw))
    params = (ctypes.c_void_p * max(1, len(kept)))(*[ctypes.addressof(k) for k in kept])
    return params, kept


class Driver:
    """cuLaunchKernelEx from libcuda, loaded once."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernelEx.restype = ctypes.c_int
        self.lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                              ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        self.attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value.as_int = 1

    def error(self, rc: int) -> str:
        s = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(s))
        return s.value.decode() if s.value else f"CUresult {rc}"

    def launch(self, kernel: str, func_ptr: int, grid, block, shared_mem: int, stream_ptr: int, args,
               ndarray_type=None) -> None:
        """Launch the kernel (its CUfunction func_ptr) on the stream with the programmatic
        attribute; an error names the kernel and the driver's error."""
        g, b = _dims(grid), _dims(block)
        cfg = LaunchConfig(*g, *b, int(shared_mem), ctypes.c_void_p(stream_ptr or None),
                           ctypes.pointer(self.attr), 1)
        params, kept = pack_args(args, ndarray_type)
        rc = self.lib.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(func_ptr), params, None)
        del kept
        if rc:
            raise RuntimeError(f"{kernel}: cuLaunchKernelEx with programmatic serialization failed: "
                               f"{self.error(rc)} (grid {g}, block {b}, {shared_mem} bytes of shared memory)")
