"""Backends: the same kernel names on NumPy (the reference) and CUDA (kernels/*.cu via CuPy).

The interface both implement is written down in interface.py (Backend). `get_backend("auto")`
picks CUDA when CuPy sees a GPU, NumPy otherwise, and returns a new backend object: each engine
has its own. Options are the backend's constructor arguments (CUDA: attention, cublaslt,
sources).
"""
from __future__ import annotations


def cuda_available() -> bool:
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


def backend_class(name: str):
    """The class of backend `name` ("numpy" or "cuda"), imported but not made: what its class-level
    members (interface.Fp8Backend's plan rows and size checks) answer needs no device."""
    if name == "numpy":
        from .numpy_backend import NumpyBackend
        return NumpyBackend
    if name == "cuda":
        from .cuda import CudaBackend
        return CudaBackend
    raise ValueError(f"backend {name!r}: expected numpy or cuda")


def get_backend(name: str = "auto", **options):
    if name == "auto":
        name = "cuda" if cuda_available() else "numpy"
    if name == "numpy":
        from .numpy_backend import NumpyBackend
        if options:
            raise ValueError(f"backend numpy takes no options, got {sorted(options)}")
        return NumpyBackend()
    if name == "cuda":
        if not cuda_available():
            raise RuntimeError("backend=cuda: no usable CUDA GPU (CuPy missing or cupy.cuda.is_available() "
                               "is False); install the cuda12/cuda13 extra on a GPU machine, or use "
                               "backend=numpy / backend=auto")
        from .cuda import CudaBackend
        return CudaBackend(**options)
    raise ValueError(f"backend.name={name!r}: expected auto, numpy or cuda")
