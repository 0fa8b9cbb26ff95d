"""Decoding with a KV cache: one position at a time through the model's forward kernels.

    dec = Decoder(cfg.model, backend, context=cfg.train.seq_len)   # plans and allocates everything
    dec.load(params)                  # flat host weights (a checkpoint's first block)
    logits = dec.feed(prompt_ids)     # host float64 logits after the last prompt token
    logits = dec.step(next_id)        # one more position

Memory is known up front, as in the engine: one arena holds the weights (compute dtype), the key
and value cache of every layer for `context` positions (2 * L * context * C elements) and the
one-position activations; `plan` lists it all and nothing is allocated while decoding.

Each position runs the training forward pass's kernels under the same names (k_embed_fwd on the
position's row of wpe, k_layernorm_fwd, k_attn_qkv_fwd, k_attn_out_fwd, k_residual_add, k_mlp_fwd,
and k_loss_fwd for the tied logits, its loss output unused) with one inference kernel in the
place of k_attn_fwd: k_attn_decode_fwd appends the position's k and v to the cache and attends
over the cached rows. When the cache is full the window slides: the last context - 1 tokens are
fed again into an emptied cache, exactly what a full forward pass over the last `context`
tokens computes.
"""
from __future__ import annotations

import sys
from typing import Iterable, List

import numpy as np

from ..core import model
from ..config import ModelConfig
from ..core.plan import Arena, MemoryPlan


def decode_plan(m: ModelConfig, context: int, dtype: str = "float32") -> MemoryPlan:
    """Every buffer a Decoder uses, from the model config and the cache length alone."""
    C, V, L = m.d_model, m.vocab_size, m.n_layer
    f32 = "float32" if dtype in ("float32", "float16", "bfloat16") else dtype  # float64 in checks
    plan = MemoryPlan()
    plan.add("params", (model.count_params(m),), dtype, "weights")
    plan.add("kcache", (L, 1, context, C), dtype, "kv cache")
    plan.add("vcache", (L, 1, context, C), dtype, "kv cache")
    for name, shape, dt in (("tokens", (1, 1), "int32"), ("targets", (1, 1), "int32"),
                            ("x", (1, 1, C), dtype), ("xmid", (1, 1, C), dtype),
                            ("ln", (1, 1, C), dtype), ("ln_mean", (1, 1), f32), ("ln_rstd", (1, 1), f32),
                            ("qkv", (1, 1, 3 * C), dtype), ("atty", (1, 1, C), dtype),
                            ("attproj", (1, 1, C), dtype), ("pre", (1, 1, 4 * C), dtype),
                            ("act", (1, 1, 4 * C), dtype), ("mlpout", (1, 1, C), dtype),
                            ("logits", (1, 1, V), dtype), ("losses", (1, 1), f32), ("lse", (1, 1), f32)):
        plan.add(name, shape, dt, "one position")
    return plan


class Decoder:
    """A KV-cache decoder of one sequence on one backend (NumPy or CUDA)."""

    def __init__(self, m: ModelConfig, backend, context: int = 0, dtype: str = "float32"):
        self.m, self.be, self.dtype = m, backend, dtype
        self.context = context or m.context
        if not 1 < self.context <= m.context:
            raise ValueError(f"decoder context {self.context}: expected 2..model.context={m.context}")
        self.layout = model.ParamLayout.from_config(m)
        self.plan = decode_plan(m, self.context, dtype)
        self.arena = Arena(backend, self.plan.total())
        self.b = {r.name: self.arena.take(r.shape, r.dtype) for r in self.plan.rows}
        self.arena.seal()
        self.p = self.layout.views(self.b["params"])
        self.w = [{n: self.p[f"h{l}.{n}"] for n in model.LAYER_MATRICES + model.LAYER_VECTORS}
                  for l in range(m.n_layer)]
        self.tokens: List[int] = []  # what the cache holds, oldest first
        # the kernels' own scratch (CUDA: cuBLAS workspace, ...) for one position, taken now
        self.workspace = backend.reserve_workspace(1, 1, m.d_model, m.n_head, self.b["params"].dtype)

    def load(self, params) -> None:
        """Copy flat host weights (float32 or float64, n_params) into the arena."""
        params = np.asarray(params)
        if params.shape != (self.layout.n_params,):
            raise ValueError(f"Decoder.load: {params.shape} weights, the model has ({self.layout.n_params},)")
        self.be.write(self.b["params"], params)
        self.reset()

    def reset(self) -> None:
        """Empty the cache (its rows are overwritten before they are read again)."""
        self.tokens = []

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def feed(self, ids: Iterable[int]):
        """Feed tokens; returns the host float64 logits after the last one."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("Decoder.feed: no tokens")
        for i in ids[:-1]:
            self._advance(i, logits=False)
        return self._advance(ids[-1], logits=True)

    def step(self, token: int):
        """Feed one token; returns the host float64 logits of the next position."""
        return self._advance(int(token), logits=True)

    def _advance(self, token: int, logits: bool):
        if not 0 <= token < self.m.vocab_size:
            raise ValueError(f"token id {token} outside the vocabulary 0..{self.m.vocab_size - 1}")
        if self.pos == self.context:  # slide: the last context - 1 tokens, then this one
            keep = self.tokens[1:]
            self.tokens = []
            for t in keep:
                self._position(t, logits=False)
        return self._position(token, logits)

    def _position(self, token: int, logits: bool):
        be, b, p, pos = self.be, self.b, self.p, self.pos
        b["tokens"].fill(token)
        be.k_embed_fwd(b["x"], b["tokens"], p["wte"], p["wpe"][pos:pos + 1])
        for l, w in enumerate(self.w):
            be.k_layernorm_fwd(b["ln"], b["ln_mean"], b["ln_rstd"], b["x"], w["ln1_w"], w["ln1_b"])
            be.k_attn_qkv_fwd(b["qkv"], b["ln"], w["qkv_w"], w["qkv_b"])
            be.k_attn_decode_fwd(b["atty"], b["kcache"][l], b["vcache"][l], b["qkv"], pos, self.m.n_head)
            be.k_attn_out_fwd(b["attproj"], b["atty"], w["attn_out_w"], w["attn_out_b"])
            be.k_residual_add(b["xmid"], b["x"], b["attproj"])
            be.k_layernorm_fwd(b["ln"], b["ln_mean"], b["ln_rstd"], b["xmid"], w["ln2_w"], w["ln2_b"])
            be.k_mlp_fwd(b["mlpout"], b["pre"], b["act"], b["ln"], w["mlp_w1"], w["mlp_b1"],
                         w["mlp_w2"], w["mlp_b2"])
            be.k_residual_add(b["x"], b["xmid"], b["mlpout"])
        self.tokens.append(token)
        if not logits:
            return None
        be.k_layernorm_fwd(b["ln"], b["ln_mean"], b["ln_rstd"], b["x"], p["lnf_w"], p["lnf_b"])
        be.k_loss_fwd(b["losses"], b["lse"], b["logits"], b["ln"], p["wte"], b["targets"])
        return np.array(be.to_numpy(b["logits"][0, 0]), dtype=np.float64)  # a copy: the buffer is reused

    def print_plan(self, file=sys.stderr) -> None:
        print(f"decoder memory plan: {self.m.name} context={self.context} dtype={self.dtype} "
              f"backend={self.be.name} params={self.layout.n_params:,}", file=file)
        print(self.plan.table(), file=file, flush=True)
        ws = self.workspace.nbytes()
        if ws:
            print(f"{'kernel workspace':<22}{ws:>16,}{ws / 2**20:>12.1f}"
                  "  (backend scratch, outside the arena)", file=file, flush=True)

