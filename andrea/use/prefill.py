"""The prompt of a request in one pass through the training forward kernels, into a slot's KV cache.

model.forward over (B=1, T) positions, T the prompt's length rounded up to PAD (the padding after
the prompt cannot change it: attention is causal), with loss=False: the layers' activations are
shared by every layer except each layer's qkv, which the cache is filled from
(k_decode_cache_fill, one launch for all layers). On CUDA the forward pass of a padded length is
replayed as a graph from its second prefill on (be.graph_runner()), so a prompt costs a handful of
launches from Python rather than one per kernel. The first token's logits are the last prompt
row's (k_decode_logits_fwd on that row of LNf's output) and the sampler draws it into the slot's
input token, as a step would (k_sample_fwd with the slot's length at the last prompt row).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np

from ..config import ModelConfig
from ..core import model

# prompts are padded to a multiple of this many positions: the fused attention's tile of query
# rows, so a padded prompt fills whole tiles, and few distinct shapes (cuBLAS plans) are made
PAD = 64


def padded(n: int, m: ModelConfig) -> int:
    """The rows the prefill of an n-token prompt runs: n rounded up to PAD, at most model.context
    (the rows of wpe)."""
    return min(-(-n // PAD) * PAD, m.context)


def prefill_rows(m: ModelConfig, context: int, dtype: str) -> list:
    """(name, shape, dtype) of the prefill's buffers, flat: views of the first B*T rows of each are
    taken per prompt length (prefill_views)."""
    T, C, NH, L = padded(context, m), m.d_model, m.n_head, m.n_layer
    f32 = "float64" if dtype == "float64" else "float32"
    rows = [("pf_tokens", (T,), "int32"), ("pf_qkv", (L * T * 3 * C,), dtype)]
    for name, (shape, kind) in {**model.activation_shapes(m, 1, T), **model.global_shapes(m, 1, T)}.items():
        if name in PREFILL_BUFFERS:
            rows.append(("pf_" + name, (int(np.prod(shape)),), f32 if kind == "f32" else dtype))
    return rows


# what model.forward(loss=False) touches beside the tokens and each layer's qkv
PREFILL_BUFFERS = ("ln1", "ln1_mean", "ln1_rstd", "atty", "att_lse", "xmid", "ln2", "ln2_mean", "ln2_rstd",
                   "pre", "res_out", "x0", "lnf", "lnf_mean", "lnf_rstd", "attproj", "mlpout", "act")


class Prefill:
    """The prefill of one prompt into one slot, on the BatchDecoder's buffers b and weights p."""

    def __init__(self, m: ModelConfig, backend, p: Dict, b: Dict, context: int):
        self.m, self.be, self.p, self.b, self.context = m, backend, p, b, context
        self.rows = padded(context, m)
        self.views: Dict[int, tuple] = {}
        # the forward pass of each padded length as a CUDA graph (the backend's GraphRunner: the
        # first prefill of a length runs eagerly, the second captures it, later ones replay it)
        self.runner = backend.graph_runner()

    def prefill_views(self, T: int) -> tuple:
        """(layers, g, qkv (L,1,T,3C)) for model.forward over T rows: views of the flat buffers."""
        if T not in self.views:
            m, b = self.m, self.b
            shapes = {**model.activation_shapes(m, 1, T), **model.global_shapes(m, 1, T)}
            shared = {n: b["pf_" + n][:int(np.prod(shapes[n][0]))].reshape(shapes[n][0]) for n in PREFILL_BUFFERS}
            L, C = m.n_layer, m.d_model
            qkv = b["pf_qkv"][:L * T * 3 * C].reshape(L, 1, T, 3 * C)
            layers = [dict(shared, qkv=qkv[l]) for l in range(L)]
            g = dict(shared, tokens=b["pf_tokens"][:T].reshape(1, T))
            self.views[T] = (layers, g, qkv)
        return self.views[T]

    def run(self, ids: List[int], slot: int) -> None:
        """Prefill ids (1..context tokens, checked by the caller) into slot: its cache rows
        0..len-1, its input token (the first sampled one) and its length (len)."""
        be, b, p, n = self.be, self.b, self.p, len(ids)
        T = padded(n, self.m)
        layers, g, qkv = self.prefill_views(T)
        be.upload(g["tokens"], np.pad(np.asarray(ids, dtype=np.int32), (0, T - n)).reshape(1, T))
        self.runner.run(("prefill", T), lambda: model.forward(be, p, layers, g, self.m.n_head, loss=False))
        be.k_decode_cache_fill(b["kcache"], b["vcache"], qkv, slot, n)
        s = slice(slot, slot + 1)
        be.k_decode_logits_fwd(b["logits"][s], g["lnf"][:, n - 1:n], p["wte"])
        be.upload(b["lengths"][s], np.array([n - 1], dtype=np.int32))  # the last prompt row
        be.k_sample_fwd(b["tokens"][s], b["lengths"][s], b["logits"][s], b["temperature"][s], b["top_k"][s],
                        b["top_p"][s], b["seeds"][s], b["live"][s], self.context)
