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
tokens (cut from the left; the continuation is kept whole when it fits). The options of a
multiple-choice item are cut at one place: each keeps the same last context tokens, as many as its
longest continuation leaves room for (context_room), so that every option is scored after the same
context; lm-evaluation-harness cuts each pair on its own, which gives a shorter option a few more
context tokens at the far left of a full window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from ..data.chat import DOC
from .suites import LM, MC, SCHEMA

FEWSHOT_SEED = 1234
EXAMPLE_DELIMITER = "\n"
TAIL_CHARS = 8  # characters a window position in a text tail (byte-level BPE: 1.5 to 5 a token)
TAIL_MARGIN = 32  # tokens at a tail's start that may differ from the whole text's: never kept


@dataclass
class Request:
    """One option of one item: the tokens of context + continuation (cut to the window + 1) and
    how many of the last ones are the continuation the score reads."""
    item: int
    option: int
    tokens: List[int]
    n_cont: int
    cut: bool  # tokens dropped from the left to fit the window


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


def tail_limit(window: int) -> int:
    """The characters of text a window's tail keeps: TAIL_CHARS a position, TAIL_MARGIN positions over."""
    return TAIL_CHARS * (window + 1 + TAIL_MARGIN)


def tail(context: str, continuation: str, window: int) -> tuple:
    """(text, its context part, whether it is a tail) to encode for a pair: the whole text, or, when
    it is longer than TAIL_CHARS characters a window position, its last that many characters."""
    limit = tail_limit(window)
    if len(context) + len(continuation) <= limit or len(continuation) >= limit:
        return context + continuation, context, False
    return context[-(limit - len(continuation)):] + continuation, context[-(limit - len(continuation)):], True


def requests(tok, items: Sequence[dict], kind: str, delimiter: str, fewshot: int, window: int,
             indices: Sequence[int]) -> List[Request]:
    """The Requests of the items at indices (all options of each), tokenised in one batch. A long
    prompt (10-shot BoolQ: tens of thousands of characters, of which a 1,024-token window keeps a
    few thousand) is encoded from its tail: the last TAIL_CHARS characters a window position. A
    byte-level BPE splits text into words, numbers and runs of punctuation or space before merging,
    so past the first TAIL_MARGIN tokens (past the word the cut went through) the tail's tokens are
    the whole text's; a tail that yields too few tokens is encoded whole after all."""
    meta, texts = [], []  # per option: (item, option, is_tail, ctx, cont, pieces of whole, pieces of head)
    for i in indices:
        opts = [split_space(ctx, cont) for ctx, cont in pairs(items, i, kind, delimiter, fewshot)]
        split = shared_split(tok, opts, window) if kind == MC and len(opts) > 1 else None
        for o, (ctx, cont) in enumerate(opts):
            if split is None:
                text, part, is_tail = tail(ctx, cont, window)
                whole, head = (text,), (part,)
            else:  # the context's part before its last word once, then each option's boundary alone
                before, last, is_tail = split
                whole, head = (before, last + cont), (before, last)
            meta.append((i, o, is_tail, ctx, cont, whole, head))
            texts += [*whole, *head]
    unique = list(dict.fromkeys(texts))  # the options of an item share their context: encoded once
    enc = dict(zip(unique, tok.encode_batch(unique)))
    enc_all = []
    for i, o, is_tail, ctx, cont, whole_keys, head_keys in meta:
        whole = [t for k in whole_keys for t in enc[k]]
        head = [t for k in head_keys for t in enc[k]]
        if is_tail and len(whole) - TAIL_MARGIN < window + 1:  # few tokens for so much text: all of it
            whole, head = tok.encode_batch([ctx + cont, ctx])
            is_tail = False
        n_cont = max(1, len(whole) - len(head))  # a continuation merged into the context: its last token
        enc_all.append((i, o, is_tail, whole, n_cont))
    room = context_room(enc_all, window) if kind == MC else {}
    out = []
    for i, o, is_tail, whole, n_cont in enc_all:
        k = room.get(i)
        keep = whole[-(window + 1):] if k is None else whole[:len(whole) - n_cont][-k:] + whole[len(whole) - n_cont:]
        out.append(Request(i, o, keep, min(n_cont, len(keep) - 1), is_tail or len(keep) < len(whole)))
    return out


SPLIT_CHARS = 256  # the end of a context pre-tokenised to find where its last word starts
SPECIAL_CHARS = 32  # no special token may start this close before the split (the longest is 13 characters)


def shared_split(tok, opts, window: int):
    """(the context before its last word, its last word, whether from a tail) for the options
    [(ctx, cont)] of a multiple-choice item, so that an option's tokens are those of the first part
    (encoded once for the item) followed by those of last word + continuation: a byte-level BPE
    merges within pre-tokens only, and the pre-tokens before the context's last one do not depend
    on what follows it. A long context is cut to its tail as tail() cuts it, once for all options
    (the tail the longest continuation leaves). None where this cannot be said (the options' contexts
    differ, or only some of them are long, no pre-tokenizer, a single pre-token in the context's
    last SPLIT_CHARS characters, a special token at the split): then each option is encoded whole, as
    tail() says."""
    ctx = opts[0][0]
    if any(c != ctx for c, _ in opts):
        return None
    limit = tail_limit(window)
    longest = max(len(cont) for _, cont in opts)
    tails = {len(ctx) + len(cont) > limit and len(cont) < limit for _, cont in opts}
    if len(tails) > 1:
        return None
    is_tail = tails.pop()
    text = ctx[-(limit - longest):] if is_tail else ctx
    end = text[-SPLIT_CHARS:]
    pieces = tok.pre_tokenize(end)
    if not pieces or len(pieces) < 2:
        return None
    s = len(text) - len(end) + pieces[-1][1][0]
    if any(sp in text[max(0, s - SPECIAL_CHARS):] for sp in tok.special_ids):
        return None  # a special token (encoded apart, before pre-tokenizing) near the split
    return text[:s], text[s:], is_tail


def context_room(enc_all, window: int) -> dict:
    """{item: context tokens every option keeps} for the multiple-choice items that some option of
    overflows the window: as many as the longest continuation leaves room for, the same for every
    option, so the options keep the same context (and the shared-context scoring, shared.py, finds
    it once). Cut one option at a time, the shorter continuations would keep more of the context,
    from another token on, and the options would share nothing. An item whose continuation alone
    fills the window is cut one option at a time as before (absent here)."""
    longest, most = {}, {}
    for i, _, _, whole, n_cont in enc_all:
        longest[i] = max(longest.get(i, 0), len(whole))
        most[i] = max(most.get(i, 0), n_cont)
    return {i: window + 1 - most[i] for i in longest if longest[i] > window + 1 and window + 1 - most[i] >= 1}
