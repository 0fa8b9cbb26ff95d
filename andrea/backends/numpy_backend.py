"""NumpyBackend: the backend interface (interface.py) on the CPU, with the reference kernels (ref/).

The kernels are ref's functions themselves; the rest is trivial: nothing is queued, the
kernels need no scratch beyond their arguments, and a "graph" is the function run again.
"""
from __future__ import annotations

import contextlib

import numpy as np

from . import ref


class NoWorkspace:
    """The NumPy kernels take no scratch beyond their arguments."""

    generation = 0

    def nbytes(self) -> int:
        return 0


class EagerRunner:
    """Runs each pass as it is: the CPU has no graphs to replay."""

    def run(self, key, fn):
        fn()

    def clear(self):
        pass


class EagerGraph:
    """What capture returns on the CPU: launch() runs the function again."""

    def __init__(self, fn):
        self.fn = fn

    def launch(self, stream=None):
        self.fn()


class Pending:
    """A copy of an array taken now; get() returns it (the CUDA backend's copy is asynchronous)."""

    def __init__(self, a):
        self.value = np.array(a, copy=True)

    def get(self):
        return self.value


class NumpyBackend:
    """The reference kernels of ref/; fp32 (or float64 in gradient checks) only."""

    name = "numpy"
    precisions = ("fp32",)
    grad_norm_partials = ref.GRAD_NORM_PARTIALS
    attention = "materialised"  # the reference has one attention path
    xp = np

    def attention_variant(self, dtype, head_size: int) -> str:
        return "materialised"

    def attention_kernels(self, dtype, head_size: int) -> str:
        return "materialised"

    def used_cublaslt(self) -> bool:
        return False

    # ------------------------------------------------------------ arrays and the device
    def empty(self, shape, dtype):
        return np.empty(shape, dtype=np.dtype(dtype))

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=np.dtype(dtype))

    def upload(self, dst, src):
        dst[...] = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)

    def write(self, dst, src):
        dst[...] = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)

    def download_async(self, a):
        return Pending(a)

    def to_numpy(self, a):
        return np.asarray(a)

    def synchronize(self):
        """Nothing is queued on the CPU."""

    # ------------------------------------------------------------ workspace and graphs
    def workspace_rows(self, B: int, T: int, C: int, n_head: int, act_dtype, fp8: bool = False, n_layer: int = 0,
                       vocab: int = 0, chunk_rows: int = 0):
        return []

    def reserve_workspace(self, B: int, T: int, C: int, n_head: int, act_dtype, fp8: bool = False,
                          n_layer: int = 0, vocab: int = 0, chunk_rows: int = 0):
        if fp8:
            raise ValueError("train.precision=fp8 needs backend=cuda on a GPU with FP8 tensor cores; the NumPy "
                             "backend runs fp32 (ref's k_fp8_* functions are the FP8 reference, for tests)")
        return NoWorkspace()

    def graph_runner(self):
        return EagerRunner()

    def capture(self, fn, stream=None):
        return EagerGraph(fn)

    def param_grad_pass(self, start=None):
        """Nothing is deferred on the CPU: every kernel finishes its gradients itself. start (a
        gradient buffer the pass starts) is zeroed here, so the pass's kernels add into zeros."""
        if start is not None:
            start.fill(0)
        return contextlib.nullcontext()

    # ------------------------------------------------------------ kernels, in the interface's order
    k_embed_fwd = staticmethod(ref.k_embed_fwd)
    k_embed_bwd = staticmethod(ref.k_embed_bwd)
    k_layernorm_fwd = staticmethod(ref.k_layernorm_fwd)
    k_residual_layernorm_fwd = staticmethod(ref.k_residual_layernorm_fwd)
    k_layernorm_bwd = staticmethod(ref.k_layernorm_bwd)
    k_attn_qkv_fwd = staticmethod(ref.k_attn_qkv_fwd)
    k_attn_qkv_bwd = staticmethod(ref.k_attn_qkv_bwd)
    k_attn_fwd = staticmethod(ref.k_attn_fwd)
    k_attn_bwd = staticmethod(ref.k_attn_bwd)
    k_attn_decode_fwd = staticmethod(ref.k_attn_decode_fwd)
    k_decode_embed_fwd = staticmethod(ref.k_decode_embed_fwd)
    k_attn_decode_batch_fwd = staticmethod(ref.k_attn_decode_batch_fwd)
    k_attn_shared_fwd = staticmethod(ref.k_attn_shared_fwd)
    k_decode_cache_fill = staticmethod(ref.k_decode_cache_fill)
    k_decode_linear_fwd = staticmethod(ref.k_decode_linear_fwd)
    k_decode_ln_linear_fwd = staticmethod(ref.k_decode_ln_linear_fwd)
    k_decode_logits_fwd = staticmethod(ref.k_decode_logits_fwd)
    k_sample_fwd = staticmethod(ref.k_sample_fwd)
    k_attn_out_fwd = staticmethod(ref.k_attn_out_fwd)
    k_attn_out_bwd = staticmethod(ref.k_attn_out_bwd)
    k_mlp_fwd = staticmethod(ref.k_mlp_fwd)
    k_mlp_bwd = staticmethod(ref.k_mlp_bwd)
    k_residual_add = staticmethod(ref.k_residual_add)
    k_residual_add_bwd = staticmethod(ref.k_residual_add_bwd)
    k_loss_fwd = staticmethod(ref.k_loss_fwd)
    k_loss_bwd = staticmethod(ref.k_loss_bwd)
    k_grad_norm_partial = staticmethod(ref.k_grad_norm_partial)
    k_grad_norm_final = staticmethod(ref.k_grad_norm_final)
    k_grad_scale = staticmethod(ref.k_grad_scale)
    k_loss_accum = staticmethod(ref.k_loss_accum)
    k_step_check = staticmethod(ref.k_step_check)
    k_adamw_step = staticmethod(ref.k_adamw_step)
    k_cast_params = staticmethod(ref.k_cast_params)
