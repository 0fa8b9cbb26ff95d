"""NumPy reference kernels: the judge of every CUDA kernel, and the CPU engine.

One module per operation, named as the kernel files (ref/<op>.py beside kernels/<op>.cu: embed,
layernorm, linear, attention, decode, mlp, residual, loss, optim, fp8; gelu and common as the
headers gelu.cuh and common.cuh). Each function here has a CUDA twin of the same name
(andrea/backends/cuda/ launching kernels/<op>.cu), with the same arguments; NumpyBackend
(numpy_backend.py) serves them through the backend interface (interface.py), whose shared
constants (the optimizer state's slots, the FP8 formats and defaults) this package re-exports.
The FP8 form of an op lives beside its 16-bit form; ref/fp8.py holds the number formats and the
quantisation kernels they all use. Conventions shared by both backends:
- Shapes: B batch, T sequence, C d_model, NH heads, hs = C // NH, V vocab. Linear weights are
  (out_features, in_features) and a linear layer computes `inp @ w.T + b`, as torch.nn.Linear does.
- Forward kernels WRITE their outputs. Backward kernels ADD (`+=`) into every gradient buffer they
  are given, parameter and activation gradients alike, except that a backward kernel with an
  `accumulate` keyword (k_layernorm_bwd, k_attn_qkv_bwd, k_attn_bwd, k_attn_out_bwd, k_mlp_bwd,
  k_loss_bwd and their FP8 forms) WRITES its activation gradient, the first gradient argument
  (dinp or dqkv), when called with accumulate=False: whatever the buffer held (NaN included) is
  not read. model.backward passes it to the first writer of each activation-gradient buffer, so
  no buffer is zeroed in the backward pass; parameter gradients always add (microbatches).
- Dtype follows the arrays: float32 in training, float64 in the gradient checks.
NumPy creates temporaries inside these functions; the engine's own buffers are all preallocated
(see core.plan.Arena). Every reduction runs in a fixed order, so results are bit-reproducible.

    from andrea.backends import ref
    ref.k_embed_fwd(out, tokens, wte, wpe)
"""
from __future__ import annotations

# the constants of the interface the kernels take (optimizer state slots, FP8 formats)
from ..interface import (FP8_DLOGITS, FP8_DLOGITS_ROUNDING, FP8_FORMATS, FP8_FWD, FP8_GRAD, FP8_HIST,
                         FP8_ROUNDINGS, S_BAD, S_CLIP, S_DECAY, S_GOOD, S_LOSS, S_LOSS_SUM, S_LR, S_NORM,
                         S_REC_SCALE, S_SCALE, S_SKIP, S_SKIPPED, S_STEP, S_STEP_SIZE, S_VHAT, STATE_LEN,
                         STATE_SLOTS, fp8_rounding)
# the kernels, in the kernel files' order
from .embed import k_embed_bwd, k_embed_fwd
from .layernorm import LN_EPS, k_layernorm_bwd, k_layernorm_fwd, k_layernorm_fwd_fp8, k_residual_layernorm_fwd
from .linear import (k_attn_out_bwd, k_attn_out_fwd, k_attn_qkv_bwd, k_attn_qkv_fwd, k_fp8_linear_bwd,
                     k_fp8_linear_fwd)
from .attention import k_attn_bwd, k_attn_bwd_fp8, k_attn_fwd, k_attn_fwd_fp8
from .decode import (k_attn_decode_batch_fwd, k_attn_decode_fwd, k_attn_shared_fwd, k_decode_cache_fill, k_decode_embed_fwd,
                     k_decode_linear_fwd, k_decode_ln_linear_fwd, k_decode_logits_fwd, k_sample_fwd, sample_row, sample_uniforms)
from .mlp import k_fp8_mlp_bwd, k_fp8_mlp_fwd, k_mlp_bwd, k_mlp_fwd
from .residual import k_residual_add, k_residual_add_bwd
from .loss import (fp8_bound_scale, fp8_sr_bits, k_fp8_loss_bwd, k_fp8_loss_fwd, k_loss_bwd, k_loss_fwd,
                   loss_bwd_fp8)
from .optim import (GRAD_NORM_PARTIALS, k_adamw_step, k_adamw_step_amax, k_cast_params, k_grad_norm_final,
                    k_grad_norm_partial, k_grad_scale, k_loss_accum, k_step_check)
from .fp8 import (FP8_MAX_SHIFT, fp8_decode, fp8_encode, fp8_fake, fp8_round, fp8_round_stochastic, fp8_scale,
                  fp8_tile_colsum, k_fp8_amax, k_fp8_amax_many, k_fp8_cast, k_fp8_cast_transpose,
                  k_fp8_cast_transpose_amax, k_fp8_cast_transpose_colsum, k_fp8_cast_transpose_colsum_amax,
                  k_fp8_cast_transpose_many, k_fp8_delayed_roll, k_fp8_dgelu_cast_transpose_colsum_amax,
                  k_fp8_dgelu_colsum_amax, k_fp8_gelu_amax, k_fp8_gelu_cast_transpose,
                  k_fp8_gelu_cast_transpose_amax, k_fp8_transpose)
from .gelu import GELU_K
# the math the kernel tests compare with: the linear layer's, and the GELU's at a dtype
from .gelu import _act, _dgelu, _gelu, _gelu_grad
from .linear import _linear_bwd, _linear_fwd
