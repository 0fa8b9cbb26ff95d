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
the one token it would be in running text); the continuation is what context + continuation
encoded whole holds after the context's own tokens: how lm-evaluation-harness splits a pair, so the
two score the same tokens. A sequence longer than the window keeps its last window + 1 tokens (cut
from the left; the continuation is kept whole when it fits). The options of a multiple-choice item
are cut at one place: each keeps the same last context tokens, as many as its longest continuation
leaves room for (context_room), so that every option is scored after the same context;
lm-evaluation-harness cuts each pair on its own, which gives a shorter option a few more context
tokens at the far left of a full window.

A prompt is not encoded whole but as pieces: each few-shot example with its newline, the item's
text up to its last safe cut, and per option the rest + its continuation. The text is cut only
where the tokenizer splits whatever the text around (safe_cut), so the pieces' tokens are the whole
text's, and each piece is encoded once however many prompts hold it (a 10-shot task's examples
recur in ten prompts, an item's context in each of its options). The test compares the tokens with
those of the whole texts on every real task file present.
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


def item_pairs(it: dict, kind: str, delimiter: str) -> List[tuple]:
    """[(the item's own context, continuation)], one per option: what follows the few-shot examples."""
    if kind == MC:
        return [(it["query"] + delimiter, c) for c in it["choices"]]
    if kind == SCHEMA:
        return [(o + delimiter, it["continuation"]) for o in it["context_options"]]
    if kind == LM:
        return [(it["context"] + delimiter, it["continuation"])]
    raise ValueError(f"task kind {kind!r}: expected one of {MC}, {SCHEMA}, {LM}")


def pairs(items: Sequence[dict], i: int, kind: str, delimiter: str, fewshot: int) -> List[tuple]:
    """[(context, continuation)] of item i, one per option, with its few-shot examples."""
    shots = "".join(example(items[j], kind, delimiter) + EXAMPLE_DELIMITER
                    for j in fewshot_indices(i, len(items), fewshot))
    return [(DOC + shots + ctx, cont) for ctx, cont in item_pairs(items[i], kind, delimiter)]


def split_space(context: str, continuation: str) -> tuple:
    """Whitespace that ends the context moved to the continuation's start."""
    stripped = context.rstrip()
    return stripped, context[len(stripped):] + continuation


# Unicode White_Space: what the byte-level pre-tokenizer's \s matches (Python's isspace() also
# takes \x1c-\x1f, which the pre-tokenizer reads as punctuation)
WHITESPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                       + "".join(chr(c) for c in range(0x2000, 0x200b)))


def safe_cut(text: str, k: int) -> bool:
    """Whether a byte-level BPE (GPT-2's pre-tokenizer regex, no prefix space, no normalizer)
    encodes text as text[:k]'s tokens followed by text[k:]'s, whatever the text holds around the cut.
    True where a non-space character is followed by whitespace (no pre-token runs from a character
    into whitespace), or where one whitespace character other than a space, after a non-space one,
    is followed by a non-space one (a lone newline before a word is a pre-token by itself, in the
    text and at the end of text[:k]; a space would join the word, and a run of whitespace splits
    differently at the end of text[:k]). Special tokens hold no whitespace: none spans such a cut."""
    if not 0 < k < len(text):
        return False
    a, b = text[k - 1], text[k]
    if a not in WHITESPACE:
        return b in WHITESPACE
    return a != " " and b not in WHITESPACE and (k < 2 or text[k - 2] not in WHITESPACE)


def safe_join(a: str, b: str) -> bool:
    """safe_cut of a + b between them (reads a's last two characters and b's first)."""
    return bool(a) and safe_cut(a[-2:] + b[:1], len(a[-2:]))


def last_cut(text: str, start: int = 0) -> int:
    """The last k > start at which text may be cut (safe_cut), start if none."""
    k = len(text) - 1
    while k > start and not safe_cut(text, k):
        k -= 1
    return max(k, start)


def pieces(items: Sequence[dict], i: int, kind: str, delimiter: str, fewshot: int, cuts: bool = True):
    """([the pieces the options of item i share], [(last, continuation) per option]): each option's
    context + continuation, after split_space, is DOC + the shared pieces + last + continuation, cut
    only where safe_cut allows, so its tokens are the document token's, each shared piece's and
    last + continuation's. cuts=False (a tokenizer that cannot be cut so: its cuts_at_whitespace)
    gives each option's text as one piece."""
    own = item_pairs(items[i], kind, delimiter)
    if not cuts:
        return [], [split_space(ctx[len(DOC):], cont) for ctx, cont in pairs(items, i, kind, delimiter, fewshot)]
    shared: List[str] = []
    for j in fewshot_indices(i, len(items), fewshot):  # an example joins the piece before it where
        s = example(items[j], kind, delimiter) + EXAMPLE_DELIMITER  # the text may not be cut between them
        if shared and not safe_join(shared[-1], s):
            shared[-1] += s
        else:
            shared.append(s)
    if all(ctx.rstrip() for ctx, _ in own):  # split_space moves whitespace within the item's own text
        opts = [split_space(ctx, cont) for ctx, cont in own]
        rests = [ctx for ctx, _ in opts]
    else:  # an item's text that is empty or whitespace: split_space takes the examples' last newline
        opts = [split_space("".join(shared) + ctx, cont) for ctx, cont in own]
        n = sum(map(len, shared))
        while shared and any(len(ctx) < n for ctx, _ in opts):
            n -= len(shared.pop())
        rests = [ctx[n:] for ctx, _ in opts]
    while shared and not all(safe_join(shared[-1], r + c) for r, (_, c) in zip(rests, opts)):
        p = shared.pop()  # the last example runs into the item's text: one piece
        rests = [p + r for r in rests]
    if len(set(rests)) > 1:  # the options' contexts differ (schema): they share the examples
        return shared, [(r, c) for r, (_, c) in zip(rests, opts)]
    before = shared[-1][-2:] if shared else ""  # what safe_cut reads before the item's text
    k = last_cut(before + rests[0], len(before)) - len(before)
    if k:
        shared.append(rests[0][:k])
    return shared, [(rests[0][k:], c) for _, c in opts]


def requests(tok, items: Sequence[dict], kind: str, delimiter: str, fewshot: int, window: int,
             indices: Sequence[int]) -> List[Request]:
    """The Requests of the items at indices (all options of each): every distinct piece (pieces())
    encoded once, in one batch; an option's tokens are the document token's and its pieces'."""
    doc, cuts = tok.special_ids[DOC], tok.cuts_at_whitespace
    plan = [(i, *pieces(items, i, kind, delimiter, fewshot, cuts)) for i in indices]
    texts = dict.fromkeys(t for _, shared, opts in plan for t in [*shared, *(x for last, cont in opts for x in (last, last + cont))])
    unique = [t for t in texts if t]
    enc = dict(zip(unique, tok.encode_batch(unique)))
    enc[""] = []
    enc_all = []  # per option: (item, option, context tokens, last + continuation's tokens, continuation tokens)
    for i, shared, opts in plan:
        ctx = [doc]
        for s in shared:
            ctx += enc[s]
        for o, (last, cont) in enumerate(opts):
            head, whole = enc[last], enc[last + cont]
            n_cont = max(1, len(whole) - len(head))  # a continuation merged into the context: its last token
            enc_all.append((i, o, ctx, whole, n_cont))
    room = context_room([(i, len(ctx) + len(whole), n_cont) for i, _, ctx, whole, n_cont in enc_all], window) \
        if kind == MC else {}
    out = []
    for i, o, ctx, whole, n_cont in enc_all:
        k = room.get(i)
        if k is None:  # the last window + 1 tokens
            room_left = window + 1 - len(whole)
            keep = (ctx[max(0, len(ctx) - room_left):] if room_left > 0 else []) + whole[-(window + 1):]
        else:  # the last k context tokens (ctx + the head of whole), then the continuation
            m = len(whole) - n_cont
            keep = (ctx[len(ctx) - (k - m):] + whole if k > m else whole[m - k:])
        out.append(Request(i, o, keep, min(n_cont, len(keep) - 1), len(keep) < len(ctx) + len(whole)))
    return out


def context_room(sizes, window: int) -> dict:
    """{item: context tokens every option keeps} for the multiple-choice items that some option of
    overflows the window, from sizes [(item, tokens of context + continuation, continuation tokens)]
    one per option: as many as the longest continuation leaves room for, the same for every option,
    so the options keep the same context (and the shared-context scoring, shared.py, finds it once).
    Cut one option at a time, the shorter continuations would keep more of the context, from another
    token on, and the options would share nothing. An item whose continuation alone fills the window
    is cut one option at a time (absent here)."""
    longest, most = {}, {}
    for i, n, n_cont in sizes:
        longest[i] = max(longest.get(i, 0), n)
        most[i] = max(most.get(i, 0), n_cont)
    return {i: window + 1 - most[i] for i in longest if longest[i] > window + 1 and window + 1 - most[i] >= 1}
