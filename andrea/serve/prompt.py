"""From a request to the model's tokens and back: the chat template the model was trained on
(andrea/data/chat.py), and the answer's text with its stop strings.

A chat request renders as `andrea generate` renders one question (render_prompt), turn after turn:

    <|endoftext|>[<|system|>S<|end|>]<|user|>Q1<|end|><|assistant|>A1<|end|>...<|user|>Qn<|end|><|assistant|>

When the conversation does not leave `reserve` tokens of the window for the answer, its oldest
turns are left out (the system turns and the last turn are always kept), as `andrea chat` does.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..data.chat import ASSISTANT, DOC, END, ROLE_TOKENS, SYSTEM, sanitize


def chat_ids(tok, messages: Sequence[Tuple[str, str]], window: int, reserve: int) -> Tuple[List[int], int]:
    """(prompt ids, number of turns left out) of (role, text) messages."""
    prefix = DOC + "".join(SYSTEM + sanitize(text) + END for role, text in messages
                           if role == "system" and text.strip())
    turns = [ROLE_TOKENS[role] + sanitize(text) + END for role, text in messages if role != "system"]
    start = 0
    while True:
        ids = tok.encode(prefix + "".join(turns[start:]) + ASSISTANT)
        if len(ids) + reserve <= window or start >= len(turns) - 1:
            return ids, start
        start += 1


def text_ids(tok, prompt, vocab_size: int) -> List[int]:
    """A completion's prompt as ids: text as it is (no template, like `andrea generate --raw`), or ids."""
    if isinstance(prompt, str):
        return tok.encode(prompt)
    bad = [i for i in prompt if not 0 <= i < vocab_size]
    if bad:
        from .schemas import bad as refuse
        raise refuse("prompt", f"token ids from 0 to {vocab_size - 1}", bad[0])
    return list(prompt)


class AnswerText:
    """The answer's text as tokens arrive: special tokens dropped, a character split over several
    tokens held until whole, and the text held back while it could be the start of a stop string;
    at a stop string the answer ends before it.

    The same text as generate.TextStream's, which decodes every id so far at each token: here only
    the ids since the last whole character are decoded (the tokenizer is byte-level, so the text
    of ids is the text of their bytes), which keeps a long answer's cost per token flat."""

    def __init__(self, tok, stops: Sequence[str] = ()):
        self.tok = tok
        self.special = set(tok.special_ids.values())
        self.ids: List[int] = []  # since the last whole character
        self.stops = tuple(stops)
        self.text = ""      # everything shown so far or held
        self.sent = 0       # how much of text has been given out
        self.stopped = False

    def push(self, token: int) -> str:
        """The new text that can be given out after token ("" when none); sets stopped at a stop string."""
        if self.stopped:
            return ""
        self.text += self._decode(token)
        if not self.stops:
            return self._give(len(self.text))
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            return self._give(cut)
        return self._give(len(self.text) - self._held())

    def rest(self) -> str:
        """What is still held at the end of the answer."""
        return self._give(len(self.text))

    def _decode(self, token: int) -> str:
        if token in self.special:
            return ""
        self.ids.append(token)
        piece = self.tok.decode(self.ids)
        if piece.endswith("\ufffd"):  # a character's bytes not all here yet
            return ""
        self.ids = []
        return piece

    def _give(self, upto: int) -> str:
        new, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return new

    def _first_stop(self) -> Optional[int]:
        start = max(0, self.sent - max(map(len, self.stops)))
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Length of the longest end of text that begins some stop string."""
        for n in range(min(len(self.text), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
