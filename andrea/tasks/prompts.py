"""Few-shot prompts of task items, and their tokens.

Every item becomes one (context, continuation) pair per option: per choice (multiple choice), per
context option (schema), or one (language modelling). The context opens with the tokenizer's
document token (`<|endoftext|>`, as every training document does), then the few-shot examples, each
written the way the item is but with its right answer, separated by a newline, then the item:

    multiple choice     <|endoftext|>{examples}{query}{delimiter}  |  {choice}
    schema              <|endoftext|>{examples}{option}{delimiter}  |  {continuation}
    language modelling  <|endoftext|>{examples}{context}{delimiter}  |  {continuation}

The few-shot examples of item i are drawn from the task's other items with a generator seeded with
(FEWSHOT_SEED, i): the same on every run and machine, never item i itself.

Tokens: whitespace that ends the context moves to the start of the continuation (so " Paris" is
the one token it would be in running text), then the context + continuation is encoded whole and
the continuation is what follows the context's own tokens: how lm-evaluation-harness splits a pair,
so the two score the same tokens. A sequence longer than the window keeps its last window + 1
tokens (cut from the left; the continuation is kept whole when it fits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from ..data.chat import DOC
from .suites import LM, MC, SCHEMA

FEWSHOT_SEED = 1234
EXAMPLE_DELIMITER = "\n"


@dataclass
class Request:
    """One option of one item: the tokens of context + continuation (cut to the window + 1) and
    how many of the last ones are the continuation the score reads."""
    item: int
    option: int
    tokens: List[int]
    n_cont: int
    cut: int  # tokens dropped from the left to fit the window


def fewshot_indices(i: int, n_items: int, k: int) -> List[int]:
    """k distinct indices of 0..n_items-1 other than i, drawn with a generator seeded (FEWSHOT_SEED, i)."""
    k = min(k, n_items - 1)
    if k <= 0:
        return []
    picks = np.random.default_rng([FEWSHOT_SEED, i]).choice(n_items - 1, size=k, replace=False)
    return [int(j) + (j >= i) for j in picks]  # skip i: 0..n-2 onto 0..n-1 without it


def example(item: dict, kind: str, delimiter: str) -> str:
    """An item written with its right answer, as a few-shot example."""
    if kind == MC:
        return item["query"] + delimiter + item["choices"][item["gold"]]
    if kind == SCHEMA:
        return item["context_options"][item["gold"]] + delimiter + item["continuation"]
    return item["context"] + delimiter + item["continuation"]


def pairs(items: Sequence[dict], i: int, kind: str, delimiter: str, fewshot: int) -> List[tuple]:
    """[(context, continuation)] of item i, one per option, with its few-shot examples."""
    shots = "".join(example(items[j], kind, delimiter) + EXAMPLE_DELIMITER
                    for j in fewshot_indices(i, len(items), fewshot))
    it = items[i]
    if kind == MC:
        return [(DOC + shots + it["query"] + delimiter, c) for c in it["choices"]]
    if kind == SCHEMA:
        return [(DOC + shots + o + delimiter, it["continuation"]) for o in it["context_options"]]
    if kind == LM:
        return [(DOC + shots + it["context"] + delimiter, it["continuation"])]
    raise ValueError(f"task kind {kind!r}: expected one of {MC}, {SCHEMA}, {LM}")


def split_space(context: str, continuation: str) -> tuple:
    """Whitespace that ends the context moved to the continuation's start."""
    stripped = context.rstrip()
    return stripped, context[len(stripped):] + continuation


def requests(tok, items: Sequence[dict], kind: str, delimiter: str, fewshot: int, window: int,
             indices: Sequence[int]) -> List[Request]:
    """The Requests of the items at indices (all options of each), tokenised in one batch."""
    meta, texts = [], []
    for i in indices:
        for o, (ctx, cont) in enumerate(pairs(items, i, kind, delimiter, fewshot)):
            ctx, cont = split_space(ctx, cont)
            meta.append((i, o))
            texts += [ctx + cont, ctx]
    enc = tok.encode_batch(texts)
    out = []
    for n, (i, o) in enumerate(meta):
        whole, ctx = enc[2 * n], enc[2 * n + 1]
        n_cont = max(1, len(whole) - len(ctx))  # a continuation merged into the context: its last token
        cut = max(0, len(whole) - (window + 1))
        out.append(Request(i, o, whole[cut:], min(n_cont, len(whole) - cut - 1), cut))
    return out
