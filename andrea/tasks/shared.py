"""Shared-context scoring: the options of an item that begin with the same tokens (its few-shot
context) have that prefix computed once, then only their own tokens.

    groups, rest = share(requests, window)       # [(request indices, prefix length)], the others
    SharedContext(scorer).score(groups, reqs, out)   # the groups' requests into a batching.Scored

An item's options are grouped by their first KEY_TOKENS tokens (options cut from the left to the
window by different amounts start at different tokens, so they fall into different groups); a
group's prefix p is the longest common prefix of its inputs (tokens[:-1]), cut so that every option
keeps all of its scored positions and at least one position after it. A group is shared when it has
two or more options and p >= SHARE_RATIO times its longest suffix; the rest take the unshared path.

Context pass: the prefixes of a batch of groups go through the training forward (model.forward,
loss=False) as a (B, T) batch whose every layer writes its qkv into its own planned buffer
(saved_qkv, (n_layer, batch_tokens, 3C)): the keys and values of every prefix position of every
layer. Option pass: the suffix tokens of the groups' options as compact rows (R, 1, C), each at its
own position (k_decode_embed_fwd), through the layer kernels of the batch decoder's
(andrea/use/batch.py) but the attention, k_attn_shared_fwd: each row attends to its group's prefix
keys and values where the context pass left them (saved_qkv), then to its own option's rows up to
itself. So the option pass costs its rows' products and their attention, nothing per prefix row.
The classifier runs on the scored rows only (Scorer._classify). The same kernels as the unshared
path on the same values but the attention's: the losses differ from its by float rounding only.

The row buffers are views of the Scorer's planned buffers (the context pass is over when the option
pass starts); nothing is allocated per batch.
"""
from __future__ import annotations

from itertools import chain
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..core import model
from .batching import batches, tails, view

KEY_TOKENS = 8  # options grouped by item and their first tokens
# a group is shared when its prefix is at least this many times its longest suffix: k options'
# products then go from k (p + s) rows to p + k s, at least 1.5x fewer (k = 2); a shorter prefix
# saves little
SHARE_RATIO = 2


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of token lists: that of the (lexicographic) least and
    greatest of them."""
    lo, hi = min(seqs), max(seqs)
    n = min(len(lo), len(hi))
    return next((i for i, (a, b) in enumerate(zip(lo[:n], hi[:n])) if a != b), n)


def share(reqs, window: int) -> Tuple[List[Tuple[List[int], int]], List[int]]:
    """([(request indices of a shared group, prefix length)], indices of the other requests)."""
    by: Dict[tuple, List[int]] = {}
    for r, q in enumerate(reqs):
        by.setdefault((q.item, tuple(q.tokens[:KEY_TOKENS])), []).append(r)
    groups, rest = [], []
    for members in by.values():
        qs = [reqs[r] for r in members]
        if len(qs) >= 2:
            p = min(len(q.tokens) - 1 - q.n_cont for q in qs)  # every scored position after the prefix
            if any(q.tokens[:p] != qs[0].tokens[:p] for q in qs[1:]):
                p = min(p, common_prefix([q.tokens[:-1] for q in qs]))
            longest = max(len(q.tokens) - 1 for q in qs) - p
            if 1 <= p <= window and p >= SHARE_RATIO * longest:
                groups.append((members, p))
                continue
        rest += members
    return groups, rest


def option_indices(opts, reqs, p_of, T_ctx: int):
    """Host arrays of one option batch: the rows' tokens and positions, for each row the first row
    of its group's prefix in the (B_ctx, T_ctx) context batch, that prefix's length and the row of
    its option's first row, then the scored rows (in request order, the last n_cont rows of each)
    and their targets."""
    qs = [reqs[r] for r, _ in opts]
    p = np.array([p_of[r] for r, _ in opts])
    ctx = np.array([c for _, c in opts])
    s = np.array([len(q.tokens) - 1 for q in qs]) - p  # suffix rows of each option
    k = np.array([q.n_cont for q in qs])
    starts = np.cumsum(s) - s
    of = np.repeat(np.arange(len(opts)), s)
    t = p[of] + np.arange(of.size) - starts[of]
    sel = tails(starts + s, k)
    tok = np.fromiter(chain.from_iterable(q.tokens[pi:-1] for q, pi in zip(qs, p.tolist())), np.int32, t.size)
    tgt = np.fromiter(chain.from_iterable(q.tokens[-q.n_cont:] for q in qs), np.int32, sel.size)
    return tok, t, ctx[of] * T_ctx, p[of], starts[of], sel, tgt


class SharedContext:
    """The context and option passes of shared groups on a Scorer's buffers and kernels."""

    def __init__(self, scorer):
        self.sc, self.be, self.m = scorer, scorer.be, scorer.m
        saved = scorer.b["saved_qkv"]
        self.saved = [saved[l] for l in range(self.m.n_layer)]

    def score(self, groups, reqs, out) -> None:
        """Every request of the groups into out (batching.Scored): the groups' prefixes in batches
        (by length), then their options, as many rows at a time as the buffers hold."""
        sc = self.sc
        p_of = {r: p for members, p in groups for r in members}
        for gidx, T_ctx in batches([p for _, p in groups], sc.window, sc.N):
            self._context([reqs[groups[g][0][0]].tokens[:groups[g][1]] for g in gidx], T_ctx)
            opts = [(r, c) for c, g in enumerate(gidx) for r in groups[g][0]]
            rows = np.cumsum([len(reqs[r].tokens) - 1 - p_of[r] for r, _ in opts])
            i = 0
            while i < len(opts):  # options whose rows fit in the buffers (one at least)
                j = max(i + 1, int(np.searchsorted(rows, (rows[i - 1] if i else 0) + sc.N, side="right")))
                batch = opts[i:j]
                idx = option_indices(batch, reqs, p_of, T_ctx)
                keys = max(len(reqs[r].tokens) - 1 for r, _ in batch)
                out.add(self._options(idx, keys, out.greedy is not None), idx[-1].size, [r for r, _ in batch])
                i = j

    def _context(self, prefixes: List[List[int]], T: int) -> None:
        """The prefixes through the forward pass, each layer's qkv kept in saved_qkv[l] as (B, T, 3C)."""
        B, C = len(prefixes), self.m.d_model
        x = np.zeros((B, T), dtype=np.int32)
        for b, s in enumerate(prefixes):
            x[b, :len(s)] = s
        a, g = self.sc._views(B, T)
        g["tokens"], = self.sc.send(x)
        layers = [dict(a, qkv=view(self.saved[l], (B, T, 3 * C))) for l in range(self.m.n_layer)]
        model.forward(self.be, self.sc.p, layers, g, self.m.n_head, loss=False)

    def _rows(self, R: int):
        """The option pass's buffers: compact rows (R, 1, width)."""
        b, C = self.sc.b, self.m.d_model
        rows = {"x": ("x0", C), "ln": ("layer.ln1", C), "qkv": ("layer.qkv", 3 * C), "atty": ("layer.atty", C),
                "attproj": ("attproj", C), "xmid": ("layer.xmid", C), "mlpout": ("mlpout", C),
                "pre": ("layer.pre", 4 * C), "act": ("act", 4 * C)}
        v = {k: view(b[name], (R, 1, w)) for k, (name, w) in rows.items()}
        v["mean"], v["rstd"] = view(b["layer.ln1_mean"], (R, 1)), view(b["layer.ln1_rstd"], (R, 1))
        return v

    def _options(self, idx, max_keys: int, argmax: bool):
        """A download of the scored values of one option batch's scored rows, in request order
        (Scorer._classify)."""
        be, p, L, C, NH = self.be, self.sc.p, self.m.n_layer, self.m.d_model, self.m.n_head
        R = idx[0].size
        v = self._rows(R)
        tokens, positions, pre, plen, first, sel, tgt = self.sc.send(*idx)
        be.k_decode_embed_fwd(v["x"], tokens, positions, p["wte"], p["wpe"])
        be.k_layernorm_fwd(v["ln"], v["mean"], v["rstd"], v["x"], p["h0.ln1_w"], p["h0.ln1_b"])
        for l in range(L):
            be.k_attn_qkv_fwd(v["qkv"], v["ln"], p[f"h{l}.qkv_w"], p[f"h{l}.qkv_b"])
            be.k_attn_shared_fwd(v["atty"], v["qkv"], self.saved[l].reshape(-1, 3 * C), pre, plen, first, NH,
                                 max_keys)
            model.rows_after_attention(be, p, l, L, v)
        return self.sc._classify(v["ln"].reshape(R, C), sel, tgt, argmax)
