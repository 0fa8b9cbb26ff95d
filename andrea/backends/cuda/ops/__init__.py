"""The launchers, one file an operation beside kernels/<op>.cu, in the reference's order: each holds
the op's 16-bit launcher and its FP8 form side by side (backend.py composes them into CudaBackend).

Same names, arguments and meaning as the NumPy reference (andrea/backends/ref/): forward kernels
write, backward kernels ADD into every gradient buffer, except an activation gradient given with
accumulate=False, which they write (the matrix products with beta = 0, the custom kernels with an
int flag, or a -D option, that skips the read of the old value). Each launcher checks shapes,
dtypes and contiguity first and raises naming the argument, then launches kernels (self.rt, a
Runtime) and matrix products (self.blas, self.lt). Scratch beyond the arguments comes from
self.workspace, parameter gradients' first writes and column sums from self.grads (gradpass.py),
launch geometry from geometry.py and self.tuning, the FP8 state from self.fp8 (fp8/).
Nothing below ops/ imports it.

    embed.py      k_embed_fwd, k_embed_bwd
    layernorm.py  k_layernorm_fwd, k_residual_layernorm_fwd, k_layernorm_bwd; k_layernorm_fwd_fp8
    linear.py     k_attn_qkv_fwd/_bwd, k_attn_out_fwd/_bwd; k_fp8_linear_fwd/_bwd
    attention.py  k_attn_fwd, k_attn_bwd; k_attn_fwd_fp8, k_attn_bwd_fp8
    mlp.py        k_mlp_fwd, k_mlp_bwd; k_fp8_mlp_fwd, k_fp8_mlp_bwd
    residual.py   k_residual_add, k_residual_add_bwd
    loss.py       k_loss_fwd, k_loss_bwd; k_fp8_loss_fwd, k_fp8_loss_bwd
    optim.py      k_grad_norm_partial, k_grad_norm_final, k_grad_scale, k_loss_accum, k_step_check,
                  k_adamw_step, k_cast_params; k_adamw_step_amax
    decode.py     k_attn_decode_fwd
"""
from .attention import AttentionOps
from .decode import DecodeOps
from .embed import EmbedOps
from .layernorm import LayerNormOps
from .linear import LinearOps
from .loss import LossOps
from .mlp import MlpOps
from .optim import OptimOps
from .residual import ResidualOps

__all__ = ["AttentionOps", "DecodeOps", "EmbedOps", "LayerNormOps", "LinearOps", "LossOps", "MlpOps", "OptimOps",
           "ResidualOps"]
