"""The CUDA backend: kernels/*.cu launched through CuPy, matrix products on cuBLAS and cuBLASLt.

    from andrea.backends.cuda import CudaBackend
    be = CudaBackend(attention="fused")      # or get_backend("cuda"); one object per engine

Layers, each importing only those below it:
    runtime.py    NVRTC compile cache and kernel launching (Runtime), argument checks;
                  pdl.py programmatic dependent launch through cuLaunchKernelEx
    cublas.py     the cuBLAS binding (Cublas); cublaslt.py the cuBLASLt one (epilogues, FP8)
    graphs.py     capturing passes as CUDA graphs, and the per-engine GraphRunner
    graph_edit.py cuBLAS(Lt)'s counter memsets replaced by a kernel node in a captured graph
    workspace.py  the kernels' scratch buffers (Workspace), an object the engine holds
    geometry.py   the launch geometry, written once; tuning.py the frozen Tuning of its knobs
    colsum.py     the deferred final column sums; gradpass.py the parameter-gradient pass
    fp8/          the FP8 layer: plan rows, quantisation launchers, weight cache, scales, state
    ops/          the k_* launchers, one file an operation beside kernels/<op>.cu, each with its
                  16-bit launcher and its FP8 form side by side
    backend.py    CudaBackend: the interface of andrea/backends/interface.py, built from the above

    python -m pytest -m gpu tests/cuda/                # every kernel against the NumPy reference
"""
from .backend import CudaBackend

__all__ = ["CudaBackend"]
