"""Deterministic synthetic chat tasks with one right answer each: the offline default data.

Four kinds of question, short enough that ANDREA-tiny (64-token context) sees whole conversations
and simple enough that it learns some of them in a few CPU minutes:

    add      "What is 12 + 7?"            -> "19"        (two numbers in [0, 49])
    sort     "Sort: 5 3 9 1"              -> "1 3 5 9"   (3 to 5 digits)
    count    "How many a in badcab?"      -> "2"         (4 to 8 letters from "abcd")
    reverse  "Reverse: k i t e m"         -> "m e t i k" (3 to 5 letters)

Digits and letters are spaced so that each is its own token (" 5", " k"): the answers are then
rearrangements of prompt tokens, which a two-layer model can learn to copy, instead of depending
on how the BPE happened to merge "kitem".

`generate(n, seed)` returns n distinct conversations in the Hermes 3 schema
(`[{"from": "human", ...}, {"from": "gpt", ...}]`), the same for the same seed on every machine
(Python's `random.Random` with an integer seed is specified to be portable). `answer(question)`
recomputes the right answer from the question text alone, so evaluation checks exact match
against a computed answer, not against a stored one.
"""
from __future__ import annotations

import math
import random
import re
from collections import Counter
from typing import List

KINDS = ("add", "sort", "count", "reverse")
ADD_MAX = 49  # operands in [0, ADD_MAX]: 2 500 pairs, sums in [0, 98]
COUNT_LETTERS = "abcd"  # a small alphabet so that letter counts vary (0..8), not mostly 0 or 1
LETTERS = "abcdefghijklmnopqrstuvwxyz"

_ADD = re.compile(r"^What is (\d+) \+ (\d+)\?$")
_SORT = re.compile(r"^Sort: (\d(?: \d)*)$")
_COUNT = re.compile(r"^How many ([a-z]) in ([a-z]+)\?$")
_REVERSE = re.compile(r"^Reverse: ([a-z](?: [a-z])*)$")


def make_task(kind: str, rng: random.Random) -> str:
    """One question of the given kind, drawn from rng."""
    if kind == "add":
        return f"What is {rng.randint(0, ADD_MAX)} + {rng.randint(0, ADD_MAX)}?"
    if kind == "sort":
        return "Sort: " + " ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 5)))
    if kind == "count":
        word = "".join(rng.choice(COUNT_LETTERS) for _ in range(rng.randint(4, 8)))
        return f"How many {rng.choice(COUNT_LETTERS)} in {word}?"
    if kind == "reverse":
        return "Reverse: " + " ".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
    raise ValueError(f"synthetic task kind {kind!r}: expected one of {KINDS}")


def kind_of(question: str) -> str:
    """The task kind of a question, or ValueError when it is not a synthetic task."""
    for kind, rx in (("add", _ADD), ("sort", _SORT), ("count", _COUNT), ("reverse", _REVERSE)):
        if rx.match(question.strip()):
            return kind
    raise ValueError(f"not a synthetic task question: {question!r}")


def answer(question: str) -> str:
    """The right answer to a synthetic question, computed from its text."""
    q = question.strip()
    kind = kind_of(q)
    if kind == "add":
        a, b = _ADD.match(q).groups()
        return str(int(a) + int(b))
    if kind == "sort":
        return " ".join(sorted(_SORT.match(q).group(1).split()))
    if kind == "count":
        letter, word = _COUNT.match(q).groups()
        return str(word.count(letter))
    return " ".join(reversed(_REVERSE.match(q).group(1).split()))


def _arrangements(items) -> int:
    """Distinct orderings of a multiset: n! / prod(k_i!)."""
    n = math.factorial(len(items))
    for k in Counter(items).values():
        n //= math.factorial(k)
    return n


def chance(question: str) -> float:
    """Probability that a uniform guess over the task's answer space is right.

    add: any sum in [0, 2*ADD_MAX]; count: any count in [0, len(word)]; sort and reverse: any
    distinct arrangement of the given symbols (a guesser that already knows which symbols to use).
    """
    q = question.strip()
    kind = kind_of(q)
    if kind == "add":
        return 1.0 / (2 * ADD_MAX + 1)
    if kind == "count":
        return 1.0 / (len(_COUNT.match(q).group(2)) + 1)
    if kind == "sort":
        return 1.0 / _arrangements(_SORT.match(q).group(1).split())
    return 1.0 / _arrangements(_REVERSE.match(q).group(1).split())


def is_correct(question: str, completion: str) -> bool:
    """Exact match of a completion (surrounding whitespace ignored) with the right answer."""
    return completion.strip() == answer(question)


def generate(n: int, seed: int) -> List[dict]:
    """n distinct synthetic conversations ({"conversations": [...], "task": kind}), kinds in turn.

    A kind whose questions run out (add has 2 500) is dropped from the rotation after
    EXHAUSTED_AFTER duplicate draws in a row, so large n fills up with the other kinds.
    """
    rng = random.Random(seed)
    seen, out = set(), []
    kinds, misses, turn = list(KINDS), {k: 0 for k in KINDS}, 0
    while len(out) < n:
        if not kinds:
            raise ValueError(f"synthetic: only {len(out)} distinct tasks exist, fewer than "
                             f"data.n_synthetic={n}")
        kind = kinds[turn % len(kinds)]
        q = make_task(kind, rng)
        if q in seen:
            misses[kind] += 1
            if misses[kind] >= EXHAUSTED_AFTER:
                kinds.remove(kind)
            continue
        misses[kind] = 0
        turn += 1
        seen.add(q)
        out.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": answer(q)}],
                    "task": kind})
    return out


EXHAUSTED_AFTER = 200  # duplicate draws in a row: the kind is (nearly) used up; n=40000 keeps 2461 of add's 2500
