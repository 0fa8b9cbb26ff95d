"""The CUDA backend: kernels/*.cu launched through CuPy, matrix products on cuBLAS.

    from andrea.backends.cuda import CudaBackend
    be = CudaBackend(attention="fused")      # or get_backend("cuda"); one object per engine

Modules, one job each:
    runtime.py    NVRTC compile cache and kernel launching (Runtime), argument checks
    cublas.py     the cuBLAS ctypes binding (Cublas) and library loading shared with siblings
    workspace.py  the kernels' scratch buffers (Workspace), an object the engine holds
    colsum.py     the final column sums of bias / layer-norm weight gradients, at once or at the
                  close of a param_grad_pass in one launch (DeferredColsums)
    graphs.py     capturing passes as CUDA graphs, and the per-engine GraphRunner
    ops.py        the k_* launchers, in numpy_ref's order (CudaOps)
    backend.py    CudaBackend: the interface of andrea/backends/interface.py, built from the above

    python -m pytest -m gpu tests/test_cuda_kernels.py     # every kernel against numpy_ref
"""
from .backend import CudaBackend

__all__ = ["CudaBackend"]
