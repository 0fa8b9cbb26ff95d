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
"""
from __future__ import annotations

from typing import Iterable, List, Tuple

DOC = "<|endoftext|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
END = "<|end|>"
# Order matters: the tokenizer trainer gives them ids 0..5 in this order.
SPECIAL_TOKENS: Tuple[str, ...] = (DOC, SYSTEM, USER, ASSISTANT, TOOL, END)
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}

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
