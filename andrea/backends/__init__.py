"""Backends: the same kernel names on NumPy (the reference) and CUDA (kernels/*.cu via CuPy).

`get_backend("auto")` picks CUDA when CuPy sees a GPU, NumPy otherwise. A backend is a module with
`NAME`, `xp` (its array module), every `k_*` kernel of DESIGN.md's table, the optimizer kernels
(k_grad_norm_partial, k_loss_accum, k_step_check, k_adamw_step) and the host utilities (upload,
download_async, to_numpy, synchronize), with the signatures of numpy_ref.
"""
from __future__ import annotations

import importlib


def cuda_available() -> bool:
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


def get_backend(name: str = "auto"):
    if name == "auto":
        name = "cuda" if cuda_available() else "numpy"
    if name == "numpy":
        return importlib.import_module("andrea.backends.numpy_ref")
    if name == "cuda":
        if not cuda_available():
            raise RuntimeError("backend=cuda: no usable CUDA GPU (CuPy missing or cupy.cuda.is_available() "
                               "is False); install the cuda12/cuda13 extra on a GPU machine, or use "
                               "backend=numpy / backend=auto")
        return importlib.import_module("andrea.backends.cuda")
    raise ValueError(f"backend.name={name!r}: expected auto, numpy or cuda")
