"""Deterministic, resumable batches of (x, y) windows from token shards.

The shards matching a glob (sorted) are cut into non-overlapping windows of T+1 tokens; each epoch
visits every window once in an order drawn from (seed, epoch). The whole state is two integers
(epoch, cursor), saved in the checkpoint sidecar, so a resumed run sees exactly the same batches.

With data groups (docs/FIREHOSE-BANDIT.md), MixedLoader keeps one ShardLoader per group, each with
its own order, drawn from (seed, group index, epoch), and its own position; a mixer picks the group
of each optimizer step and learns from the step's loss. Its state (every group's position and the
mixer's) goes into the sidecar the same way.

Chat loss mask (train.phases[].loss_on=assistant, docs/ARCHITECTURE.md "The ignore index"): a
loader made with answers=True returns (x, y, keep) instead of (x, y), keep (B, T) bool marking the
targets inside an assistant's answer (andrea.data.chat.answer_mask), read from the role markers of
the token stream itself, the turn a window starts in from the last marker before it in its shard.
The shards' format is unchanged; the engine turns the other targets into IGNORE_INDEX in the
steps of such a phase. The batches and the loader's state are the same either way.
"""
from __future__ import annotations

import glob as globmod
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .chat import SPECIAL_TOKENS, answer_mask
from .mixer import Mixer
from .shards import read_shard


class ShardLoader:
    def __init__(self, pattern: str, B: int, T: int, seed: int = 0, vocab_size: int = 0,
                 stream: Optional[int] = None, answers: bool = False):
        self.stream = stream  # a group's index: its order differs from the other groups'
        self.files = sorted(globmod.glob(str(pattern)))
        if not self.files:
            raise FileNotFoundError(f"no token shards match {pattern!r}; run the workflow's tokenize "
                                    "step (snakemake) or set data.train_shards / data.val_shards")
        self.shards = [read_shard(f) for f in self.files]
        for f, s in zip(self.files, self.shards):
            # an id past the embedding table would index out of bounds (or, on the GPU, read garbage)
            if vocab_size and len(s) and int(s.max()) >= vocab_size:
                raise ValueError(f"shard {f}: token id {int(s.max())} >= model.vocab_size={vocab_size}; "
                                 "was it tokenized for another vocabulary?")
        counts = np.array([(len(s) - 1) // T if len(s) > 1 else 0 for s in self.shards], dtype=np.int64)
        self.n_windows = int(counts.sum())
        if self.n_windows < B:
            raise ValueError(f"token shards {pattern!r} hold {self.n_windows} windows of {T + 1} tokens, "
                             f"fewer than one batch of B={B}")
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.B, self.T, self.seed = B, T, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)
        # answers: each shard's special-token positions, whose last one before a window says whose
        # turn the window starts in
        self.specials = [np.flatnonzero(s < len(SPECIAL_TOKENS)) for s in self.shards] if answers else None

    def _permutation(self, epoch):
        key = [self.seed, epoch] if self.stream is None else [self.seed, self.stream, epoch]
        return np.random.default_rng(key).permutation(self.n_windows)

    def _where(self, k):
        s = int(np.searchsorted(self.starts, k, side="right") - 1)
        return s, (k - int(self.starts[s])) * self.T

    def _window(self, k):
        s, off = self._where(k)
        return self.shards[s][off:off + self.T + 1]

    def _answer_targets(self, k, window):
        """keep (T,): which targets of window k lie in an assistant's answer."""
        s, off = self._where(k)
        pos = self.specials[s]
        i = int(np.searchsorted(pos, off)) - 1  # the last special token before the window
        before = int(self.shards[s][pos[i]]) if i >= 0 else -1
        return answer_mask(window, before)[1:]

    def next_batch(self):
        """(x, y), each int32 (B, T); y is x shifted by one token. With answers: (x, y, keep)."""
        buf = np.empty((self.B, self.T + 1), dtype=np.int32)
        keep = np.empty((self.B, self.T), dtype=bool) if self.specials is not None else None
        for b in range(self.B):
            if self.cursor == self.n_windows:
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
            k = int(self._order[self.cursor])
            buf[b] = self._window(k)
            if keep is not None:
                keep[b] = self._answer_targets(k, buf[b])
            self.cursor += 1
        return (buf[:, :-1], buf[:, 1:]) if keep is None else (buf[:, :-1], buf[:, 1:], keep)

    def next_step(self, n_micro: int):
        """The n_micro microbatches of one optimizer step."""
        return [self.next_batch() for _ in range(n_micro)]

    def feedback(self, rec) -> dict:
        """After the step: nothing to learn from a single stream; no extra record fields."""
        return {}

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "n_windows": self.n_windows}

    def load_state(self, st: dict, source: str = "sidecar"):
        if st.get("n_windows") != self.n_windows or st.get("seed") != self.seed:
            raise ValueError(f"{source}: data state is for {st.get('n_windows')} windows / seed "
                             f"{st.get('seed')} but the shards give {self.n_windows} / seed {self.seed}; "
                             "were the shards rebuilt?")
        self.epoch, self.cursor = int(st["epoch"]), int(st["cursor"])
        self._order = self._permutation(self.epoch)

    def batches(self, n):
        """n fresh batches from the start (for validation; does not move this loader)."""
        other = ShardLoader.__new__(ShardLoader)
        other.__dict__.update(self.__dict__)
        other.epoch, other.cursor, other._order = 0, 0, self._permutation(0)
        other.specials = None  # validation counts every target
        return [other.next_batch() for _ in range(n)]


class MixedLoader:
    """Each optimizer step drawn whole from the group a mixer picks (docs/FIREHOSE-BANDIT.md)."""

    def __init__(self, groups: Sequence, B: int, T: int, seed: int, vocab_size: int, mixer: Mixer,
                 answers: bool = False):
        """groups: (name, shard glob) pairs, in the mix's order."""
        self.names = [name for name, _ in groups]
        if len(self.names) != mixer.K:
            raise ValueError(f"data groups {self.names}: the mixer has {mixer.K} groups")
        self.loaders = []
        for i, (name, pattern) in enumerate(groups):
            try:
                # one group reads in the order of the ungrouped stream: a mix of one is today's data
                stream = i if len(groups) > 1 else None
                self.loaders.append(ShardLoader(pattern, B, T, seed, vocab_size, stream=stream, answers=answers))
            except (OSError, ValueError) as e:
                raise type(e)(f"data.groups[{i}] ({name}): {e}") from e
        self.seed, self.mixer = seed, mixer
        self.group = None

    def next_step(self, n_micro: int):
        self.group = self.mixer.pick()
        return self.loaders[self.group].next_step(n_micro)

    def feedback(self, rec) -> dict:
        """Feed the step's loss to the mixer (a skipped step's counts as not finite); the record
        fields of the step: its group, the probabilities it was drawn with, the smoothed losses."""
        g = self.group
        loss = float("nan") if rec["skipped"] or rec["loss"] is None else float(rec["loss"])
        self.mixer.update(g, loss)
        return {"group": self.names[g], "mix": dict(zip(self.names, self.mixer.last_p.tolist())),
                "group_loss": dict(zip(self.names, self.mixer.group_losses()))}

    def state(self) -> dict:
        # a list, not a mapping: the sidecar is written with sorted keys, the order is the mix's
        return {"groups": [{"name": n, **ld.state()} for n, ld in zip(self.names, self.loaders)],
                "mixer": self.mixer.state(), "seed": self.seed}

    def load_state(self, st: dict, source: str = "sidecar"):
        have = [g.get("name") for g in st.get("groups", [])]
        if have != self.names:
            raise ValueError(f"{source}: data.groups is {have} but this run's config gives {self.names}; "
                             "the checkpoint belongs to another data mix")
        for g, ld in zip(st["groups"], self.loaders):
            ld.load_state(g, f"{source} (group {g['name']})")
        self.mixer.load_state(st["mixer"], source)


def train_loader(cfg, vocab_size: int = 0):
    """The training data of a run config: one ShardLoader over data.train_shards, or, with
    data.groups, a MixedLoader driven by data.mixer. With a phase of loss_on=assistant its batches
    carry the answer mask (answers=True)."""
    from .mixer import make_mixer

    d, t = cfg.data, cfg.train
    V = vocab_size or cfg.model.vocab_size
    answers = any(ph.loss_on == "assistant" for ph in t.phases)
    if not d.groups:
        return ShardLoader(d.train_shards, t.batch_size, t.seq_len, t.seed, V, answers=answers)
    mx = d.mixer
    names = [g.name for g in d.groups]
    mixer = make_mixer(mx.kind, len(names), t.seed, mx.weights, mx.reward, mx.alpha, mx.beta,
                       mx.reward_scale, names)
    return MixedLoader([(g.name, g.train_shards) for g in d.groups], t.batch_size, t.seq_len, t.seed,
                       V, mixer, answers=answers)


def shard_paths(pattern: str):
    return [Path(p) for p in sorted(globmod.glob(str(pattern)))]


def val_windows(pattern: str, B: int, T: int, n_batches: int, vocab_size: int = 0) -> list:
    """The validation batches: the val shards (sorted) cut into consecutive windows of T+1 tokens
    from the start of each shard, B windows a batch, the first n_batches batches (fewer when the
    shards hold fewer). No sampling, no seed: training's validation (train.eval_batches batches)
    and the report's (eval.batches) read the same windows, so the same checkpoint gives the same
    loss on both. Returns [(x, y)] of int32 (B, T) arrays, y being x shifted by one token."""
    files = shard_paths(pattern)
    if not files:
        raise FileNotFoundError(f"data.val_shards={pattern!r}: no shard matches; run the tokenize step")
    windows = []
    for f in files:
        toks = read_shard(f)
        if vocab_size and len(toks) and int(toks.max()) >= vocab_size:
            raise ValueError(f"shard {f}: token id {int(toks.max())} >= model.vocab_size={vocab_size}; "
                             "was it tokenized for another vocabulary?")
        for k in range((len(toks) - 1) // T):
            windows.append(np.asarray(toks[k * T:k * T + T + 1], dtype=np.int32))
            if len(windows) == B * n_batches:
                break
        if len(windows) == B * n_batches:
            break
    n = len(windows) // B
    if n == 0:
        raise ValueError(f"data.val_shards={pattern!r}: {len(windows)} windows of {T + 1} tokens, "
                         f"fewer than one batch of B={B}")
    arr = np.stack(windows[:n * B]).reshape(n, B, T + 1)
    return [(a[:, :-1], a[:, 1:]) for a in arr]
