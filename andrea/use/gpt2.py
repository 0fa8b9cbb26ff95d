"""ANDREA's parameters under GPT-2's names (the Hugging Face `GPT2LMHeadModel` layout), both ways.

ANDREA's block is GPT-2's: pre-norm, tanh GELU, biases everywhere, the unembedding tied to wte,
q | k | v in one projection with the heads side by side. Two things differ in storage only:
- names: `h3.qkv_w` is `transformer.h.3.attn.c_attn.weight`, and so on (GPT2_NAMES);
- GPT-2's linear layers are `Conv1D` modules that store the weight as (in, out), the transpose of
  ANDREA's (out, in) (torch.nn.Linear's order): every linear weight is transposed on the way.
The tied output projection has no tensor of its own (`tie_word_embeddings`).
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from ..core.model import LAYER_MATRICES, LAYER_VECTORS

PREFIX = "transformer."
LAYER_NAMES = {
    "ln1_w": "ln_1.weight", "ln1_b": "ln_1.bias",
    "qkv_w": "attn.c_attn.weight", "qkv_b": "attn.c_attn.bias",
    "attn_out_w": "attn.c_proj.weight", "attn_out_b": "attn.c_proj.bias",
    "ln2_w": "ln_2.weight", "ln2_b": "ln_2.bias",
    "mlp_w1": "mlp.c_fc.weight", "mlp_b1": "mlp.c_fc.bias",
    "mlp_w2": "mlp.c_proj.weight", "mlp_b2": "mlp.c_proj.bias",
}
GLOBAL_NAMES = {"wte": "wte.weight", "wpe": "wpe.weight", "lnf_w": "ln_f.weight", "lnf_b": "ln_f.bias"}
TRANSPOSED = set(LAYER_MATRICES)  # Conv1D weights: (in, out) in GPT-2
assert set(LAYER_NAMES) == set(LAYER_MATRICES + LAYER_VECTORS)


def gpt2_name(name: str) -> str:
    """`h3.qkv_w` -> `transformer.h.3.attn.c_attn.weight`; `wte` -> `transformer.wte.weight`."""
    if name in GLOBAL_NAMES:
        return PREFIX + GLOBAL_NAMES[name]
    layer, part = name.split(".", 1)
    return f"{PREFIX}h.{int(layer[1:])}.{LAYER_NAMES[part]}"


def is_transposed(name: str) -> bool:
    return name.split(".")[-1] in TRANSPOSED


def to_gpt2(views: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """GPT-2-named float32 tensors (contiguous) from ANDREA's named views."""
    return {gpt2_name(n): np.ascontiguousarray(v.T if is_transposed(n) else v, dtype=np.float32)
            for n, v in views.items()}
