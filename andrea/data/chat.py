"""The chat template: special tokens, role normalisation and rendering of conversations to text.

A conversation is a list of turns `{"from": role, "value": text}` (the ShareGPT schema of
Hermes 3). It renders to one string:

    <|endoftext|><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|>

`<|endoftext|>` opens every conversation, so the token shards (a plain concatenation of rendered
conversations) carry a document separator between them. The role markers and `<|end|>` are
reserved special tokens of the tokenizer (andrea/data/tokenizer.py), so each is a single id and
`<|end|>` is the end-of-turn id generation stops at. There are no newlines around the markers: the
tokens themselves delimit the turns, and ANDREA-tiny's 64-token context has none to spare.

    from andrea.data.chat import render_conversation, render_prompt
    render_prompt("What is 12 + 7?")   # ends where the assistant's answer starts

The loss mask of chat fine-tuning (train.phases[].loss_on=assistant) comes from the same roles:
`answer_mask` marks the tokens of the assistant's turns, each answer's text and the `<|end|>` that
closes it (so the model learns to stop), never the role markers, the system, user or tool turns or
`<|endoftext|>`. The loader turns the targets of every other token into IGNORE_INDEX, which the
classifier (k_loss_fwd / k_loss_bwd) skips.
"""
from __future__ import annotations

from typing import Iterable, List, Tuple

import numpy as np

DOC = "<|endoftext|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
END = "<|end|>"
# Order matters: the tokenizer trainer gives them ids 0..5 in this order.
SPECIAL_TOKENS: Tuple[str, ...] = (DOC, SYSTEM, USER, ASSISTANT, TOOL, END)
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}

# The special tokens' ids, as the tokenizer reserves them (andrea/data/tokenizer.py: ids 0..5 in the
# order of SPECIAL_TOKENS); token shards hold these ids.
SPECIAL_IDS = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
# The target of a token the loss skips (torch's cross_entropy(ignore_index=-1)): the classifier
# gives it no loss and no gradient (kernels/loss.cu, andrea/backends/ref/loss.py).
IGNORE_INDEX = -1

# Role names met in public chat sets (ShareGPT "human"/"gpt", OpenAI "user"/"assistant", tool
# outputs under several names), mapped to the four roles of the template.
ROLE_ALIASES = {
    "system": "system",
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "bot": "assistant",
    "tool": "tool", "function": "tool", "function_response": "tool", "ipython": "tool",
    "observation": "tool",
}


class ConversationError(ValueError):
    """A conversation that cannot be rendered; `reason` is a short key for reports."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def sanitize(text: str) -> str:
    """Text with every literal special-token string broken up ("<|end|>" -> "< |end|>").

    The tokenizer matches special tokens anywhere in its input, so a message that quotes one
    would otherwise end its turn early or forge a role marker.
    """
    if "<|" not in text:
        return text
    for tok in SPECIAL_TOKENS:
        text = text.replace(tok, "< |" + tok[2:])
    return text


def _turn(t) -> Tuple[str, str]:
    if not isinstance(t, dict):
        raise ConversationError("malformed", f"a turn is {type(t).__name__}, expected an object")
    role = t.get("from", t.get("role"))
    value = t.get("value", t.get("content"))
    if not isinstance(role, str) or not isinstance(value, str):
        raise ConversationError("malformed", "a turn lacks string 'from' and 'value' fields")
    norm = ROLE_ALIASES.get(role.strip().lower())
    if norm is None:
        raise ConversationError("unknown_role", f"role {role!r} is not one of {sorted(ROLE_ALIASES)}")
    return norm, value


def normalize(conv) -> List[dict]:
    """The conversation as [{"from": system|user|assistant|tool, "value": str}], or ConversationError.

    Empty system turns are dropped (many sets carry a blank system prompt); an empty user or
    assistant turn, or a conversation without a user and an assistant turn, is "empty".
    """
    if not isinstance(conv, (list, tuple)):
        raise ConversationError("malformed", f"conversations is {type(conv).__name__}, expected a list")
    out = []
    for t in conv:
        role, value = _turn(t)
        if not value.strip():
            if role == "system":
                continue
            raise ConversationError("empty", f"an empty {role} turn")
        out.append({"from": role, "value": value})
    roles = {t["from"] for t in out}
    if "user" not in roles or "assistant" not in roles:
        raise ConversationError("empty", "no user turn or no assistant turn")
    return out


def render_conversation(conv) -> str:
    """The template text of a conversation (raw or normalised turns); ConversationError if unusable."""
    turns = normalize(conv)
    return DOC + "".join(ROLE_TOKENS[t["from"]] + sanitize(t["value"]) + END for t in turns)


def render_prompt(user_text: str, system: str = "") -> str:
    """A one-question prompt that ends where the assistant's answer starts."""
    sys_part = SYSTEM + sanitize(system) + END if system.strip() else ""
    return DOC + sys_part + USER + sanitize(user_text) + END + ASSISTANT


def first_exchange(conv) -> Tuple[str, str]:
    """(first user text, the assistant reply that follows it) of a normalised conversation."""
    turns = normalize(conv)
    for i, t in enumerate(turns[:-1]):
        if t["from"] == "user" and turns[i + 1]["from"] == "assistant":
            return t["value"], turns[i + 1]["value"]
    raise ConversationError("empty", "no user turn followed by an assistant turn")


def render_many(convs: Iterable) -> List[str]:
    return [render_conversation(c) for c in convs]


def answer_mask(tokens, before: int = -1) -> np.ndarray:
    """Which of tokens (a slice of a token stream) belong to an assistant's answer: its text and the
    <|end|> closing it (bool, same length). before: the id of the last special token ahead of the
    slice (-1: none, the stream's start), which says whose turn the slice starts in."""
    toks = np.asarray(tokens)
    n = toks.size
    special = toks < len(SPECIAL_TOKENS)
    last = np.maximum.accumulate(np.where(special, np.arange(n), -1)) if n else np.zeros(0, np.int64)
    kind = np.where(last >= 0, toks[np.maximum(last, 0)], before)  # the last special at or before each
    prev = np.concatenate([[before], kind[:-1]]) if n else kind  # ... and the one before the token
    assistant = SPECIAL_IDS[ASSISTANT]
    return ((kind == assistant) & ~special) | ((toks == SPECIAL_IDS[END]) & (prev == assistant))
