"""Batched scoring of Requests on the engine's own forward kernels (NumPy or CUDA).

    sc = Scorer(cfg.model, backend, params, window, dtype, batch_tokens=16384)
    loss_sum, n_tokens, greedy = sc.score(requests, argmax=True)   # one value per request

Memory is planned once, for batch_tokens positions, as the engine plans its own: the weights (the
compute dtype), one layer's activations (inference keeps none for a backward pass, so every layer
reuses the same buffers: model.forward reads a layer's input before it writes its output), the
classifier's buffers and a logits workspace of model.loss_chunk_rows rows (at least one window).
Each batch is a (B, T) view of those buffers, B * T <= batch_tokens: the requests sorted by length,
longest first, T their longest rounded up to a multiple of T_MULTIPLE (at most the window), B as
many as fit. Sequences are right-padded: attention is causal, so padding after a sequence changes
none of its positions, and the host reads only the positions it asked for.

The classifier (k_loss_fwd) runs only on the positions whose loss is asked for: the continuations'.
Their final layer-norm rows and targets are gathered on the device into planned buffers of the
logits workspace's rows, and k_loss_fwd runs on a chunk of them at a time, so that after each call
the workspace holds that chunk's logits; with argmax=True the target's logit is compared with the
row's maximum there, on the device: a continuation is a greedy match when every one of its tokens
is the argmax (a tie counts as a match). A few-shot prompt of a thousand tokens before a
continuation of a few: the vocabulary product of the context's positions was a third of the
forward pass's work (ANDREA-120M, 50,304 classes), for losses nobody read.

With shared=True (the default) the options of an item that begin with the same context have that
prefix computed once and only their own tokens after it (andrea/tasks/shared.py); the others (one
option, language modelling, short prefixes) take the path above. The same numbers to float rounding.
"""
from __future__ import annotations

from itertools import chain
from typing import List, Tuple

import numpy as np

from ..config import ModelConfig
from ..core import model
from ..core.plan import Arena, MemoryPlan
from .batching import Scored, batches, tails, view
from .shared import SharedContext, share

# positions of one forward pass by backend: on the GPU enough rows for the products to fill it
# (120M: ~30 KB of activations a position, 2 GB at 65,536), on the CPU less memory in flight
BATCH_TOKENS = {"cuda": 65536, "numpy": 8192}
# the forward pass's buffers outside its layers, but the tokens (a view of the uploads, send()) and
# the training classifier's (the classifier runs on the gathered rows, _classify)
FORWARD_GLOBALS = ("x0", "lnf", "lnf_mean", "lnf_rstd", "attproj", "mlpout", "act")


def score_plan(m: ModelConfig, window: int, batch_tokens: int, dtype: str,
               shared: bool = False) -> Tuple[MemoryPlan, int]:
    """Every buffer a Scorer uses, and the logits workspace's rows; shared: with the keys and values
    of every layer of a batch of shared contexts (andrea/tasks/shared.py)."""
    N, V = batch_tokens, m.vocab_size
    rows = max(window, model.loss_chunk_rows(N, V))
    kinds = {"act": dtype, "f32": "float32", "i32": "int32"}
    plan = MemoryPlan()
    plan.add("params", (model.count_params(m),), dtype, "weights")
    for name, (shape, kind) in model.activation_shapes(m, 1, N).items():
        plan.add("layer." + name, shape, kinds[kind], "activations (one layer)")
    g = model.global_shapes(m, 1, N)
    for name in FORWARD_GLOBALS:
        plan.add(name, g[name][0], kinds[g[name][1]], "activations (other)")
    plan.add("logits", (rows, V), dtype, "workspace")
    # the classifier's input: the gathered rows of the continuations (a chunk of them at a time)
    C = m.d_model
    for name, shape, dt in (("sel_lnf", (1, rows, C), dtype), ("sel_losses", (1, rows), "float32"),
                            ("sel_lse", (1, rows), "float32")):
        plan.add(name, shape, dt, "workspace")
    plan.add("uploads", (UPLOAD_SLOTS * N,), "int32", "workspace")  # a batch's host arrays, one copy
    plan.add("scored", (2, N), "float32", "workspace")  # a batch's scored losses and greedy flags
    if shared:
        plan.add("saved_qkv", (m.n_layer, N, 3 * C), dtype, "shared context")
    return plan, rows


UPLOAD_SLOTS = 7  # host arrays of at most batch_tokens elements a batch sends (the option pass's seven)
UPLOAD_MIN = 4096  # uploads are rounded up to a power of two, at least this: the backend keeps
# page-locked buffers per shape, so few shapes
GREEDY_ROWS = 256  # logits rows widened to float32 at a time for the argmax (50 MB at V = 50,304)


def as_float32(xp, z):
    """z as float32: bfloat16 is the top half of a float32, so its bits shifted up are the same
    number (CuPy has no bfloat16 arithmetic); float16 and float32 as they are (compared as is)."""
    return widen_bf16(xp, z.view(xp.uint16)) if z.dtype.name == "bfloat16" else z


def widen_bf16(xp, bits):
    """float32 values of bfloat16 bit patterns (uint16)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


class Scorer:
    """The model's forward pass over batches of token sequences, on one backend."""

    def __init__(self, m: ModelConfig, backend, params, window: int, dtype: str = "float32",
                 batch_tokens: int = 0, shared: bool = True):
        if not 1 <= window <= m.context:
            raise ValueError(f"scoring window {window}: expected 1..model.context={m.context}")
        self.m, self.be, self.window, self.shared = m, backend, window, shared
        self.N = max(batch_tokens or BATCH_TOKENS.get(backend.name, 8192), window)
        self.plan, self.rows = score_plan(m, window, self.N, dtype, shared)
        self.last = {"shared": 0, "unshared": 0}  # requests of the last score() by path
        self.arena = Arena(backend, self.plan.total())
        self.b = {r.name: self.arena.take(r.shape, r.dtype) for r in self.plan.rows}
        self.arena.seal()
        self.stage = np.empty(self.b["uploads"].size, np.int32)  # send()'s host side
        layout = model.ParamLayout.from_config(m)
        params = np.asarray(params)
        if params.shape != (layout.n_params,):
            raise ValueError(f"Scorer: {params.shape} weights, the model has ({layout.n_params},)")
        backend.write(self.b["params"], params)
        self.p = layout.views(self.b["params"])
        self.workspace = backend.reserve_workspace(self.N // window, window, m.d_model, m.n_head,
                                                   self.b["params"].dtype, vocab=m.vocab_size,
                                                   chunk_rows=self.rows)

    def _views(self, B: int, T: int):
        """The buffers as one (B, T) batch: views of their first B * T positions."""
        layer, glob = model.activation_shapes(self.m, B, T), model.global_shapes(self.m, B, T)
        a = {k: view(self.b["layer." + k], s) for k, (s, _) in layer.items()}
        g = {k: view(self.b[k], glob[k][0]) for k in FORWARD_GLOBALS}
        g["logits"] = self.b["logits"]
        return a, g

    def send(self, *arrays):
        """Device int32 views of host arrays (each at most batch_tokens elements), in one
        asynchronous copy into the planned uploads buffer: the host does not wait for the device."""
        sizes = [int(np.size(a)) for a in arrays]
        n = max(UPLOAD_MIN, 1 << max(0, sum(sizes) - 1).bit_length())
        stage = self.stage[:min(n, self.stage.size)]
        dev = self.b["uploads"][:stage.size]
        ends = np.cumsum(sizes)
        for a, e, k in zip(arrays, ends, sizes):
            stage[e - k:e] = np.ravel(a)
        self.be.upload(dev, stage)
        return [dev[e - k:e].reshape(np.shape(a)) for a, e, k in zip(arrays, ends, sizes)]

    def _batch(self, seqs: List[List[int]], T: int, n_cont: List[int], argmax: bool):
        """(a download of the scored values, their count) of the last n_cont[r] positions of each
        right-padded sequence r, in sequence order: one value a position asked for (scored())."""
        B = len(seqs)
        x = np.zeros((B, T), dtype=np.int32)
        for r, s in enumerate(seqs):
            x[r, :len(s) - 1] = s[:-1]
        # the positions asked for, flat (row * T + t), in sequence order, and their targets
        sel = tails(np.arange(B) * T + [len(s) - 1 for s in seqs], n_cont)
        tgt = np.fromiter(chain.from_iterable(s[len(s) - k:] for s, k in zip(seqs, n_cont)), np.int32, sel.size)
        a, g = self._views(B, T)
        g["tokens"], sel_d, tgt_d = self.send(x, sel.astype(np.int32), tgt)
        model.forward(self.be, self.p, [a] * self.m.n_layer, g, self.m.n_head, loss=False)
        return self._classify(g["lnf"].reshape(B * T, self.m.d_model), sel_d, tgt_d, argmax), sel.size

    def _classify(self, lnf, sel, tgt, argmax: bool):
        """A download of the scored values (scored()) of the rows sel (device int32) of lnf (rows, C)
        on the device, whose targets are tgt (device int32, one per row of sel), a logits workspace
        at a time: row 0 their losses, row 1 whether each target is the argmax (argmax=True)."""
        xp, R = self.be.xp, self.rows
        bits = np.dtype(f"u{lnf.dtype.itemsize}")  # the rows moved as bits: CuPy has no bfloat16 arithmetic
        out = self.b["scored"]
        for i0 in range(0, sel.size, R):
            n = min(R, sel.size - i0)
            inp, t = self.b["sel_lnf"][:, :n], tgt[i0:i0 + n].reshape(1, n)
            xp.take(lnf.view(bits), sel[i0:i0 + n], axis=0, out=inp[0].view(bits))
            self.be.k_loss_fwd(self.b["sel_losses"][:, :n], self.b["sel_lse"][:, :n], self.b["logits"], inp,
                               self.p["wte"], t)
            out[0, i0:i0 + n] = self.b["sel_losses"][0, :n]
            if argmax:
                out[1, i0:i0 + n] = self._greedy(self.b["logits"], t)
        return self.be.download_async(out)

    def _greedy(self, logits, targets):
        """Per row of the chunk: is the target's logit the row's largest (on the device, GREEDY_ROWS
        rows at a time, in float32: bfloat16 rows widened by their bits, which CuPy can do)."""
        xp, n = self.be.xp, targets.size
        t = targets.reshape(n)
        out = []
        for r0 in range(0, n, GREEDY_ROWS):
            z = as_float32(xp, logits[r0:min(n, r0 + GREEDY_ROWS)])
            out.append(z[xp.arange(z.shape[0]), t[r0:r0 + z.shape[0]]] >= z.max(axis=1))
        return xp.concatenate(out)

    def score(self, reqs, argmax: bool = False):
        """Per request: the continuation's summed loss (nats), its token count, and whether every
        one of its tokens is the argmax (argmax=True; else None)."""
        n = len(reqs)
        count = np.array([r.n_cont for r in reqs])
        out = Scored(n, count, argmax)
        groups, rest = share(reqs, self.window) if self.shared else ([], list(range(n)))
        if groups:
            SharedContext(self).score(groups, reqs, out)
        self.last = {"shared": n - len(rest), "unshared": len(rest)}
        lengths = [len(reqs[r].tokens) - 1 for r in rest]
        for part, T in batches(lengths, self.window, self.N):
            idx = [rest[i] for i in part]
            out.add(*self._batch([reqs[r].tokens for r in idx], T, list(count[idx]), argmax), idx)
        return out.result()
