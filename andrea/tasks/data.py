"""Reading and checking task files in the in-context-learning JSONL layout (one JSON object a line).

| kind | fields |
| --- | --- |
| multiple_choice | `query` (text), `choices` (two or more texts), `gold` (index into choices) |
| schema | `context_options` (two or more texts), `continuation` (text), `gold` (index into context_options) |
| language_modeling | `context` (text), `continuation` (non-empty text) |

Other fields (category, ...) are kept and ignored. A bad line is one TaskDataError naming the file,
the line and the field, and what was expected there.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

from .suites import LM, MC, SCHEMA

FIELDS = {MC: (("query", str), ("choices", list), ("gold", int)),
          SCHEMA: (("context_options", list), ("continuation", str), ("gold", int)),
          LM: (("context", str), ("continuation", str))}
OPTIONS = {MC: "choices", SCHEMA: "context_options"}  # the list gold indexes


class TaskDataError(ValueError):
    """A task file that cannot be scored: one line naming the file, the line and the field."""


def _check(item, kind: str, where: str) -> dict:
    if not isinstance(item, dict):
        raise TaskDataError(f"{where}: a JSON {type(item).__name__}; expected an object with the fields "
                            f"{', '.join(f for f, _ in FIELDS[kind])} ({kind})")
    for field, typ in FIELDS[kind]:
        v = item.get(field)
        if field not in item:
            raise TaskDataError(f"{where}: field {field} is missing; expected {_what(field, typ)} ({kind})")
        if not isinstance(v, typ) or isinstance(v, bool):
            raise TaskDataError(f"{where}: field {field} is {_short(v)}; expected {_what(field, typ)} ({kind})")
    opts = OPTIONS.get(kind)
    if opts:
        v = item[opts]
        if len(v) < 2 or not all(isinstance(s, str) for s in v):
            raise TaskDataError(f"{where}: field {opts} is {_short(v)}; expected a list of two or more texts")
        if not 0 <= item["gold"] < len(v):
            raise TaskDataError(f"{where}: field gold is {item['gold']}; expected an index into {opts} "
                                f"(0..{len(v) - 1})")
    if kind == LM and not item["continuation"]:
        raise TaskDataError(f"{where}: field continuation is empty; expected the text to predict")
    return item


def _what(field: str, typ) -> str:
    return {list: "a list of texts", int: "an integer index", str: "a text"}[typ]


def _short(v) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= 40 else s[:37] + "..."


def read_items(path, kind: str, limit: int = 0) -> List[dict]:
    """The items of a task file, each checked for its kind's fields; limit > 0: the first limit."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TaskDataError(f"{path}: no such file; expected a task file in the JSONL layout") from None
    except UnicodeDecodeError as e:
        raise TaskDataError(f"{path}: not UTF-8 text (byte {e.start}); expected JSON lines") from None
    except OSError as e:
        raise TaskDataError(f"{path}: cannot be read ({e.strerror or e})") from None
    items = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                                "expected one object a line") from None
        items.append(_check(obj, kind, where))
        if limit and len(items) == limit:
            break
    if not items:
        raise TaskDataError(f"{path}: no items; expected one JSON object a line")
    return items
