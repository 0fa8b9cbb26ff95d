"""The OpenAI wire format: request bodies checked field by field, and the response objects.

    ask = parse_chat(body, model_id)          # ApiError(400, "... expected ...", param="temperature")
    ask = parse_completion(body, model_id)
    completion(ask, text, finish, usage(prompt_tokens, completion_tokens))   # the whole answer
    chunk(ask, text=..., finish=..., role=..., use=...)   # one server-sent event of a stream

An error is OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, where param
names the field and the message says what was expected there. Fields the API defines and ANDREA
cannot honour (several choices, log-probabilities, tools, penalties) are refused when set to
anything but their neutral value; fields it does not know are ignored, as OpenAI's clients send
some that change nothing here (user, metadata, store).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

CHAT, TEXT = "chat.completion", "text_completion"
MAX_STOPS = 4  # OpenAI's limit on stop sequences
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# fields with no effect here unless set to something other than these
NEUTRAL = {"n": (1, None), "best_of": (1, None), "logprobs": (False, None, 0), "top_logprobs": (0, None),
           "echo": (False, None), "suffix": (None, ""), "frequency_penalty": (0, None),
           "presence_penalty": (0, None), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
           "tool_choice": (None, "none", "auto"), "response_format": (None, {"type": "text"})}


class ApiError(Exception):
    """A request that cannot be served: the HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, expected: str, value: Any = ...) -> ApiError:
    got = "" if value is ... else f" (got {_show(value)})"
    return ApiError(400, f"{param}: expected {expected}{got}", param=param)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Ask:
    """One request, checked: what the worker needs and what the answer echoes."""
    kind: str                      # CHAT or TEXT
    model: str
    messages: List[Tuple[str, str]] = field(default_factory=list)  # chat: (system|user|assistant, text)
    prompt: Any = None             # text: a string or a list of token ids
    max_tokens: Optional[int] = None  # None: as many as the window leaves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None     # None: a fresh one
    stop: Tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = 0


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad(name, f"a number from {lo:g} to {hi:g}", v)
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise bad(name, f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""), v)
    return v


def _stop(v) -> Tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"a non-empty string or a list of at most {MAX_STOPS} of them", v)
    return tuple(stops)


def _common(body, kind: str, model_id: str) -> Ask:
    if not isinstance(body, dict):
        raise ApiError(400, f"request body: expected a JSON object (got {type(body).__name__})")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"the model's name, a string ({model_id!r})", model)
    if model != model_id:
        raise ApiError(404, f"model: {model!r} is not served here; expected {model_id!r}", "model",
                       code="model_not_found")
    for name, neutral in NEUTRAL.items():
        if name in body and not any(_same(body[name], n) for n in neutral):
            allowed = " or ".join("null" if n is None else _show(n) for n in neutral)
            raise bad(name, f"{allowed}: ANDREA serves one choice, without log-probabilities, tools "
                            "or penalties", body[name])
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad("stream", "true or false", stream)
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
        raise bad("stream_options", 'an object like {"include_usage": true}', opts)
    max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", 1)
    top_p = _number(body, "top_p", 0, 1, 1.0)
    if top_p == 0:
        raise bad("top_p", "a probability in (0, 1]", body["top_p"])
    prefix = "chatcmpl-" if kind == CHAT else "cmpl-"
    return Ask(kind=kind, model=model, max_tokens=max_tokens,
               temperature=_number(body, "temperature", 0, 2, 1.0), top_p=top_p,
               top_k=_integer(body, "top_k", 0) or 0,
               seed=_integer(body, "seed", 0, 2**64 - 1),
               stop=_stop(body.get("stop")), stream=bool(stream),
               include_usage=bool((opts or {}).get("include_usage", False)),
               id=prefix + uuid.uuid4().hex, created=int(time.time()))


def _same(v, neutral) -> bool:
    """v is the neutral value (True is not 1, 0.0 is 0)."""
    if neutral is None or isinstance(neutral, bool) or isinstance(v, bool):
        return v is neutral
    return v == neutral


def _content(v, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in v):
        return "".join(p["text"] for p in v)
    raise bad(where, 'a string or a list of {"type": "text", "text": ...} parts', v)


def parse_chat(body, model_id: str) -> Ask:
    ask = _common(body, CHAT, model_id)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "a non-empty list of {role, content} objects", msgs)
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "an object with role and content", m)
        role = ROLES.get(m.get("role")) if isinstance(m.get("role"), str) else None
        if role is None:
            raise bad(f"{where}.role", f"one of {', '.join(ROLES)}", m.get("role"))
        ask.messages.append((role, _content(m.get("content"), f"{where}.content")))
    if all(role == "system" for role, _ in ask.messages):
        raise bad("messages", "at least one user or assistant message")
    return ask


def parse_completion(body, model_id: str) -> Ask:
    ask = _common(body, TEXT, model_id)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    ok = (isinstance(p, str) and p != "") or (
        isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p))
    if not ok:
        raise bad("prompt", "a non-empty string or a non-empty list of token ids (one prompt)", p)
    ask.prompt = p
    if ask.max_tokens is None:
        ask.max_tokens = 16  # OpenAI's default for completions
    return ask


# ------------------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(ask: Ask, text: str, finish: str, use: dict) -> dict:
    """The whole answer: a chat.completion or a text_completion object."""
    if ask.kind == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": ask.id, "object": ask.kind, "created": ask.created, "model": ask.model,
            "choices": [choice], "usage": use}


def chunk(ask: Ask, text: Optional[str] = None, finish: Optional[str] = None, role: bool = False,
          use: Optional[dict] = None) -> dict:
    """One event of a stream: a piece of text, the opening role (chat), the finish reason, or the
    closing usage (no choices)."""
    if use is not None:
        choices = []
    elif ask.kind == CHAT:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    out = {"id": ask.id, "object": ask.kind + ".chunk" if ask.kind == CHAT else ask.kind,
           "created": ask.created, "model": ask.model, "choices": choices}
    if ask.include_usage:
        out["usage"] = use
    return out
