"""How much data an experiment needs, and whether its token shards hold it.

A run cuts each split's shards into windows of T+1 tokens (andrea/data/loader.py). It needs:

    train  B x grad_accum windows: one optimizer step without reading a window twice (the loader
           then cycles epochs, each in a fresh order, for as many steps as train.steps asks)
    val    B x train.eval_batches windows: every validation loss averages distinct windows
           (B when train.eval_every is 0: the final evaluation's one batch at least)

`need(cfg)` gives both counts. `synthetic_conversations(cfg)` sizes the synthetic source from
them: the number of tasks whose train and val splits hold enough tokens even at the fewest tokens
a task can take on average (MEAN_TASK_TOKENS), with a margin for the hash split. The
workflow's pull step generates max(data.n_synthetic, that) tasks, so data.n_synthetic is a floor.
`check_shards(cfg)` counts the windows of the built shards and raises DataSizeError naming the
setting to change when a split cannot fill one batch (a small local mirror, a capped pull), and
warns, naming the same settings, when it holds fewer windows than need(cfg).
"""
from __future__ import annotations

import glob as globmod
import math
from dataclasses import dataclass
from .shards import read_shard

# Fewest tokens a synthetic task takes on average, whatever the tokenizer's vocabulary: five chat
# markers (<|endoftext|><|user|>...<|end|><|assistant|>...<|end|>) plus byte-level BPE's
# pre-tokens, which no merge crosses. add and count take 7 ("What", " is", " 1", " +", " 2", "?" /
# "3"), sort and reverse of k symbols 2 + 2k ("Sort", ":", k digits / k digits), k = 3..5 evenly:
# (12 + 12 + 15 + 15) / 4 with the kinds in turn; once add runs out the mix only gets longer.
MEAN_TASK_TOKENS = 13.5
SPLIT_MARGIN = 1.25  # the hash split puts val_fraction of the tasks in val only on average


class DataSizeError(ValueError):
    """Token shards too small for the experiment; the message names the setting to change."""


@dataclass(frozen=True)
class Need:
    train_windows: int
    val_windows: int
    window: int  # tokens per window, T + 1

    def tokens(self, windows: int) -> int:
        """Fewest tokens of one concatenated split that give `windows` windows."""
        return windows * (self.window - 1) + 1


def need(cfg) -> Need:
    t = cfg.train
    val_batches = max(1, t.eval_batches) if t.eval_every else 1
    return Need(t.batch_size * t.grad_accum, t.batch_size * val_batches, t.seq_len + 1)


def synthetic_conversations(cfg) -> int:
    """Synthetic tasks to generate for cfg: data.n_synthetic, or more when its splits need more."""
    n, vf = need(cfg), cfg.data.val_fraction
    if not 0.0 < vf < 1.0:
        raise DataSizeError(f"data.val_fraction={vf}: expected a fraction in (0, 1)")
    per_task = MEAN_TASK_TOKENS
    train = math.ceil(n.tokens(n.train_windows) / per_task / (1.0 - vf) * SPLIT_MARGIN)
    val = math.ceil(n.tokens(n.val_windows) / per_task / vf * SPLIT_MARGIN)
    return max(int(cfg.data.n_synthetic), train, val)


def count_windows(pattern: str, T: int):
    """Windows of T+1 tokens in the shards matching pattern, as ShardLoader cuts them (None: no shards)."""
    files = sorted(globmod.glob(str(pattern)))
    if not files:
        return None
    total = 0
    for f in files:
        n = len(read_shard(f))
        total += (n - 1) // T if n > 1 else 0
    return total


def _raise_hint(cfg, split: str) -> str:
    d, t = cfg.data, cfg.train
    less = (f"or lower train.batch_size={t.batch_size}" if split == "train" else
            f"or lower train.eval_batches={t.eval_batches} / train.batch_size={t.batch_size}")
    if d.source == "synthetic":
        return f"raise data.n_synthetic={d.n_synthetic} (the workflow sizes it itself; was the pull capped by " \
               f"data.max_conversations={d.max_conversations}?) {less}"
    if d.source == "local":
        where = f"the local mirror data.local_path={d.local_path!r} is too small"
        if d.max_conversations:
            return f"raise data.max_conversations={d.max_conversations} (0 = all), use a larger mirror {less}"
        if split == "val":
            return f"{where}: raise data.val_fraction={d.val_fraction}, use a larger mirror {less}"
        return f"{where}: use a larger mirror {less}"
    if d.max_conversations:
        return f"raise data.max_conversations={d.max_conversations} (0 = all) {less}"
    return f"raise data.val_fraction={d.val_fraction} {less}" if split == "val" else less


def check_shards(cfg, warn=None) -> dict:
    """Windows of cfg's train and val shards against need(cfg).

    Fewer than one batch (train.batch_size windows) in a split: DataSizeError naming the setting
    to change (the loader could not make a single batch). At least one batch but fewer than
    need(cfg): the run works, re-reading windows within a step or a validation; warn(message) is
    called and the shortfall listed under "short". A split without any shard is left to the
    loader, whose error says to run the tokenize step."""
    n, T, B = need(cfg), cfg.train.seq_len, cfg.train.batch_size
    wanted = {"train": n.train_windows, "val": n.val_windows}
    what = {"train": f"one optimizer step (train.batch_size={B} x train.grad_accum={cfg.train.grad_accum})",
            "val": f"train.eval_batches={cfg.train.eval_batches} batches of train.batch_size={B}"}
    info, short = {}, []
    for split, pattern in (("train", cfg.data.train_shards), ("val", cfg.data.val_shards)):
        found = count_windows(pattern, T)
        info[f"{split}_windows"], info[f"need_{split}"] = found, wanted[split]
        if found is None or found >= wanted[split]:
            continue
        head = f"experiment {cfg.exp}: {split} shards {pattern!r} hold {found} windows of {T + 1} tokens"
        if found < B:
            raise DataSizeError(f"{head}, fewer than one batch of train.batch_size={B}: {_raise_hint(cfg, split)}")
        short.append(split)
        if warn is not None:
            warn(f"{head}; {what[split]} needs {wanted[split]}, so windows repeat within it: "
                 f"{_raise_hint(cfg, split)}")
    found_train = info["train_windows"]
    info["short"] = short
    info["epochs"] = round(cfg.train.steps * n.train_windows / found_train, 3) if found_train else None
    return info
