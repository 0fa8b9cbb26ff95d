"""Batched decoding with continuous batching: N slots, one planned KV arena, one step for all.

    bd = BatchDecoder(cfg.model, backend, slots=8, context=cfg.train.seq_len, dtype="float16")
    bd.load(params)                        # flat host weights, as Decoder.load
    slot = bd.admit(Request(prompt_ids, max_new=64, temperature=0.8, seed=1, stop_ids=frozenset({eot})))
    while bd.free() < bd.slots:            # some slot is active
        for slot, token, finished in bd.step():   # one token for EVERY active slot
            ...                            # a finished slot is released by itself

Contract (andrea serve and `andrea generate` both drive it):
- admit(req) prefills the prompt into the lowest free slot (the training forward kernels over the
  whole prompt, one pass) and samples the request's first token on the device; it returns the
  slot id. A bad request is a ValueError of one line (empty prompt, prompt longer than the
  context, a token id outside the vocabulary, max_new < 1, temperature < 0, top_k < 0, top_p
  outside (0, 1], seed outside 0..2^64-1); no free slot is a RuntimeError.
- step() returns (slot, token, finished) for every active slot, in slot order: the request's next
  token, so the first step() after admit returns the first token (the one admit sampled). A
  request finishes at max_new tokens, at a stop id (yielded, then finished), or when its window
  is full (prompt + tokens = context + 1: the last token has no row left to go to); a finished
  slot is free for the next admit at once. release(slot) ends one early (client gone).
- Determinism: a request's tokens depend on the weights, the request (seed included), the
  backend, the precision and the slot count of this BatchDecoder, never on which slot it got or
  what else is in the batch: every kernel computes a slot's row on its own, the product of a
  step always has `slots` rows, and the sampler's randomness is a hash of (seed, position)
  (ref.sample_row). `andrea generate` decodes through a BatchDecoder of one slot.

Memory is planned at start-up (`plan`): the weights, the KV cache of every slot ((L, slots,
context, C) keys and values), the one-row activations of the step, the prefill's activations for
a whole window, and the slots' sampling settings; nothing is allocated while decoding. On CUDA
a step is one replayed CUDA graph (captured in load()), the positions read from the device; up to
DECODE_GEMV_SLOTS slots of a model at most DECODE_GEMV_MAX_C wide its products are the few-row
kernels (k_decode_linear_fwd, k_decode_ln_linear_fwd), otherwise the training's layers (gemv=
True/False says which, for up to DECODE_GEMV_ROWS slots). The step's input tokens are read back
while the graph runs: step() queues the copy of the tokens, then the graph that samples the next
ones. A free slot's row is still computed (fixed shapes) but parked at token 0, row 0 (the
device's `live` flags, written at admit and release). docs/INFERENCE.md has the design.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Tuple

import numpy as np

from ..backends.interface import DECODE_GEMV_MAX_C, DECODE_GEMV_ROWS, DECODE_GEMV_SLOTS
from ..config import ModelConfig
from ..core import model
from ..core.plan import Arena, MemoryPlan
from .prefill import Prefill, prefill_rows

SEED_LIMIT = 1 << 64


@dataclass
class Request:
    """One generation."""
    prompt_ids: List[int]  # the prompt's token ids, at least one
    max_new: int  # most tokens to generate, at least 1
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus threshold in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    seed: int = 0  # 0..2^64-1: the draw of position p is a hash of (seed, p)
    stop_ids: FrozenSet[int] = frozenset()  # a stop id is yielded, then the slot finishes


def step_rows(m: ModelConfig, slots: int, dtype: str) -> list:
    """(name, shape, dtype) of the step's buffers, one row a slot; statistics and logits in
    float32 (float64 in the float64 checks)."""
    C, V, N = m.d_model, m.vocab_size, slots
    f32 = "float64" if dtype == "float64" else "float32"
    return [("tokens", (N,), "int32"), ("lengths", (N,), "int32"), ("temperature", (N,), "float32"),
            ("top_k", (N,), "int32"), ("top_p", (N,), "float32"), ("seeds", (N,), "uint64"),
            ("live", (N,), "int32"),
            ("x", (N, 1, C), dtype), ("xmid", (N, 1, C), dtype), ("ln", (N, 1, C), dtype),
            ("ln_mean", (N, 1), f32), ("ln_rstd", (N, 1), f32), ("qkv", (N, 1, 3 * C), dtype),
            ("atty", (N, 1, C), dtype), ("attproj", (N, 1, C), dtype), ("pre", (N, 1, 4 * C), dtype),
            ("act", (N, 1, 4 * C), dtype), ("mlpout", (N, 1, C), dtype), ("logits", (N, V), f32)]


def batch_plan(m: ModelConfig, slots: int, context: int, dtype: str) -> MemoryPlan:
    """Every buffer a BatchDecoder uses, from the model config, the slot count and the window."""
    C, L = m.d_model, m.n_layer
    plan = MemoryPlan()
    plan.add("params", (model.count_params(m),), dtype, "weights")
    plan.add("kcache", (L, slots, context, C), dtype, "kv cache")
    plan.add("vcache", (L, slots, context, C), dtype, "kv cache")
    for name, shape, dt in step_rows(m, slots, dtype):
        plan.add(name, shape, dt, "step")
    for name, shape, dt in prefill_rows(m, context, dtype):
        plan.add(name, shape, dt, "prefill")
    return plan


class BatchDecoder:
    """Decoding of up to `slots` requests at once on one backend (NumPy or CUDA); see the module
    docstring for the contract."""

    def __init__(self, m: ModelConfig, backend, slots: int, context: int = 0, dtype: str = "float32",
                 gemv: Optional[bool] = None):
        self.m, self.be, self.dtype, self.slots = m, backend, dtype, int(slots)
        self.context = context or m.context
        if not 1 < self.context <= m.context:
            raise ValueError(f"decoder context {self.context}: expected 2..model.context={m.context}")
        if self.slots < 1:
            raise ValueError(f"slots {slots}: expected at least 1")
        self.layout = model.ParamLayout.from_config(m)
        self.plan = batch_plan(m, self.slots, self.context, dtype)
        self.arena = Arena(backend, self.plan.total())
        self.b = {r.name: self.arena.take(r.shape, r.dtype) for r in self.plan.rows}
        self.arena.seal()
        self.p = self.layout.views(self.b["params"])
        self.prefill = Prefill(m, backend, self.p, self.b, self.context)
        # the kernels' scratch, for the larger of the prefill's rows and the step's
        rows = max(self.prefill.rows, self.slots)
        self.workspace = backend.reserve_workspace(1, rows, m.d_model, m.n_head, self.b["params"].dtype)
        # one slot: the step's products as k_decode_linear_fwd / k_decode_ln_linear_fwd (weights
        # read once at close to the copy bandwidth, the layer norms fused in); more: the training's
        # linear layers (cuBLAS); gemv given: that way (the few-row kernels for at most their rows)
        if gemv and self.slots > DECODE_GEMV_ROWS:
            raise ValueError(f"gemv=True with {self.slots} slots: the few-row products take at most {DECODE_GEMV_ROWS}")
        self.gemv = (self.slots <= DECODE_GEMV_SLOTS and m.d_model <= DECODE_GEMV_MAX_C) if gemv is None else gemv
        self.graph = None
        self.active: List[dict] = [None] * self.slots  # per slot: the request and its count, or None
        self.zero_slots()

    # ------------------------------------------------------------ set-up
    def load(self, params) -> None:
        """Copy flat host weights (float32 or float64, n_params) into the arena; every slot is
        freed; on CUDA the step's graph is captured now."""
        params = np.asarray(params)
        if params.shape != (self.layout.n_params,):
            raise ValueError(f"BatchDecoder.load: {params.shape} weights, the model has ({self.layout.n_params},)")
        self.be.write(self.b["params"], params)
        self.active = [None] * self.slots
        self.zero_slots()
        self._step_kernels()  # once eagerly: modules compiled, cuBLAS plans made, before the capture
        self.zero_slots()
        self.graph = self.be.capture(self._step_kernels)
        self.be.synchronize()

    def zero_slots(self) -> None:
        """Every slot at token 0, position 0, greedy: the rows of free slots stay in range."""
        n = self.slots
        for name, value in (("tokens", 0), ("lengths", 0), ("temperature", 0), ("top_k", 0), ("top_p", 1),
                            ("seeds", 0), ("live", 0)):
            self.be.write(self.b[name], np.full(n, value))

    # ------------------------------------------------------------ the contract
    def free(self) -> int:
        """Free slots now."""
        return sum(a is None for a in self.active)

    def admit(self, req: Request) -> int:
        """Prefill req into the lowest free slot and sample its first token; returns the slot."""
        ids = self.check(req)
        if self.graph is None:
            raise RuntimeError("BatchDecoder.admit before load(): no weights")
        slot = next((s for s, a in enumerate(self.active) if a is None), None)
        if slot is None:
            raise RuntimeError(f"BatchDecoder.admit: all {self.slots} slots are busy")
        settings = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "seeds": req.seed,
                    "live": 1}
        for name, value in settings.items():
            self.be.upload(self.b[name][slot:slot + 1], np.array([value], dtype=self.b[name].dtype))
        try:
            self.prefill.run(ids, slot)
        except BaseException:
            self.release(slot)  # the device's live flag back to 0: the slot stays free
            raise
        self.active[slot] = {"req": req, "made": 0, "limit": min(req.max_new, self.context - len(ids) + 1)}
        return slot

    def step(self) -> List[Tuple[int, int, bool]]:
        """One token for every active slot: [(slot, token, finished)] in slot order."""
        live = [s for s, a in enumerate(self.active) if a is not None]
        if not live:
            return []
        pending = self.be.download_async(self.b["tokens"])  # this step's tokens, sampled before
        self.graph.launch()  # on the current stream, after the copy
        tokens = pending.get()
        out = []
        for s in live:
            a = self.active[s]
            t = int(tokens[s])
            a["made"] += 1
            done = a["made"] >= a["limit"] or t in a["req"].stop_ids
            if done:
                self.release(s)
            out.append((s, t, done))
        return out

    def release(self, slot: int) -> None:
        """End a slot early (its request is dropped; the slot is free at once)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"release: slot {slot} outside 0..{self.slots - 1}")
        self.active[slot] = None
        self.be.upload(self.b["live"][slot:slot + 1], np.zeros(1, np.int32))  # from the next step on

    def check(self, req: Request) -> List[int]:
        """The prompt ids of a valid request, or a ValueError of one line naming the field."""
        ids = [int(i) for i in req.prompt_ids]
        V = self.m.vocab_size
        if not ids:
            raise ValueError("prompt_ids: empty; expected at least one token")
        if len(ids) > self.context:
            raise ValueError(f"prompt_ids: {len(ids)} tokens, the context holds {self.context}")
        bad = next((i for i in ids if not 0 <= i < V), None)
        if bad is not None:
            raise ValueError(f"prompt_ids: token id {bad} outside the vocabulary 0..{V - 1}")
        if req.max_new < 1:
            raise ValueError(f"max_new: {req.max_new}; expected at least 1")
        if not req.temperature >= 0:
            raise ValueError(f"temperature: {req.temperature}; expected 0 (greedy) or more")
        if req.top_k < 0:
            raise ValueError(f"top_k: {req.top_k}; expected 0 (off) or a positive number of tokens")
        if not 0 < req.top_p <= 1:
            raise ValueError(f"top_p: {req.top_p}; expected a probability in (0, 1]")
        if not 0 <= req.seed < SEED_LIMIT:
            raise ValueError(f"seed: {req.seed}; expected 0..2^64-1")
        return ids

    # ------------------------------------------------------------ the step
    def _step_kernels(self) -> None:
        """One position of every slot: the model's forward order on (slots, 1) rows, the cache at
        each slot's own length, then the logits and the sampler (which advances the lengths)."""
        be, b, p = self.be, self.b, self.p
        be.k_decode_embed_fwd(b["x"], b["tokens"], b["lengths"], p["wte"], p["wpe"])
        (self._layers_few if self.gemv else self._layers_many)()
        be.k_decode_logits_fwd(b["logits"], b["ln"], p["wte"])
        be.k_sample_fwd(b["tokens"], b["lengths"], b["logits"], b["temperature"], b["top_k"], b["top_p"],
                        b["seeds"], b["live"], self.context)

    def _layer(self, l: int) -> dict:
        return {n: self.p[f"h{l}.{n}"] for n in model.LAYER_MATRICES + model.LAYER_VECTORS}

    def _layers_many(self) -> None:
        """The layers on the training's kernels (cuBLAS products), x in, LNf(x) into ln."""
        be, b, p, L = self.be, self.b, self.p, self.m.n_layer
        be.k_layernorm_fwd(b["ln"], b["ln_mean"], b["ln_rstd"], b["x"], p["h0.ln1_w"], p["h0.ln1_b"])
        rows = dict(b, mean=b["ln_mean"], rstd=b["ln_rstd"])
        for l in range(L):
            w = self._layer(l)
            be.k_attn_qkv_fwd(b["qkv"], b["ln"], w["qkv_w"], w["qkv_b"])
            be.k_attn_decode_batch_fwd(b["atty"], b["kcache"][l], b["vcache"][l], b["qkv"], b["lengths"],
                                       self.m.n_head)
            model.rows_after_attention(be, p, l, L, rows)

    def _layers_few(self) -> None:
        """The same layers for a few rows: each layer norm fused into the product after it
        (k_decode_ln_linear_fwd, the residual add with it), the others k_decode_linear_fwd."""
        be, b, p, L = self.be, self.b, self.p, self.m.n_layer
        w = self._layer(0)
        be.k_decode_ln_linear_fwd(b["qkv"], None, b["x"], None, w["ln1_w"], w["ln1_b"], w["qkv_w"], w["qkv_b"],
                                  False)
        for l in range(L):
            be.k_attn_decode_batch_fwd(b["atty"], b["kcache"][l], b["vcache"][l], b["qkv"], b["lengths"],
                                       self.m.n_head)
            be.k_decode_linear_fwd(b["attproj"], b["atty"], w["attn_out_w"], w["attn_out_b"], False)
            be.k_decode_ln_linear_fwd(b["act"], b["xmid"], b["x"], b["attproj"], w["ln2_w"], w["ln2_b"],
                                      w["mlp_w1"], w["mlp_b1"], True)
            be.k_decode_linear_fwd(b["mlpout"], b["act"], w["mlp_w2"], w["mlp_b2"], False)
            if l + 1 == L:
                be.k_residual_layernorm_fwd(b["x"], b["ln"], b["ln_mean"], b["ln_rstd"], b["xmid"], b["mlpout"],
                                            p["lnf_w"], p["lnf_b"])
            else:
                w = self._layer(l + 1)
                be.k_decode_ln_linear_fwd(b["qkv"], b["x"], b["xmid"], b["mlpout"], w["ln1_w"], w["ln1_b"],
                                          w["qkv_w"], w["qkv_b"], False)

    def print_plan(self, file=sys.stderr) -> None:
        print(f"batch decoder memory plan: {self.m.name} slots={self.slots} context={self.context} "
              f"dtype={self.dtype} backend={self.be.name} params={self.layout.n_params:,}", file=file)
        print(self.plan.table(), file=file, flush=True)
