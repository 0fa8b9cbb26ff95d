"""The tasks on the Hugging Face hub: which dataset, configuration and split each one is, and the
conversion of a hub row to an item of the JSONL layout (andrea/tasks/data.py), so that with network
`python -m andrea.tasks RUN --tasks ... --task-data hub` scores the same kind of items without the
local files. HellaSwag and MMLU come only this way where the local copy leaves them out.

    items = hub_items("arc_easy")            # datasets.load_dataset(...), each row converted

The local files (llm-foundry's eval gauntlet) were made from these datasets and splits; their text
is the converters' up to whitespace and, for a few tasks, the gauntlet's own preprocessing (its
HellaSwag drops the hub's bracketed section markers, which hellaswag() below also does). A task with
no converter (jeopardy, the BIG-bench files, ...) exists on the hub only in another layout: use the
JSONL file.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, NamedTuple, Optional

from .data import _check
from .suites import task_of


class HubTask(NamedTuple):
    dataset: str
    config: Optional[str]
    split: str
    convert: Optional[Callable[[dict], dict]]  # a hub row -> a JSONL item; None: no converter


def _lettered(row: dict) -> tuple:
    """(texts, gold) of a row with choices {"text": [...], "label": [...]} and answerKey."""
    ch = row["choices"]
    return list(ch["text"]), list(ch["label"]).index(row["answerKey"])


def arc(row: dict) -> dict:
    texts, gold = _lettered(row)
    return {"query": "Question: " + row["question"], "choices": texts, "gold": gold}


def openbook(row: dict) -> dict:
    texts, gold = _lettered(row)
    return {"query": row["question_stem"], "choices": texts, "gold": gold}


def commonsense_qa(row: dict) -> dict:
    texts, gold = _lettered(row)
    letters = list(row["choices"]["label"])
    listing = "".join(f"\n{L}. {t}" for L, t in zip(letters, texts))
    return {"query": f"Question: {row['question']}\nChoices:{listing}\nAnswer:", "choices": letters, "gold": gold}


def hellaswag(row: dict) -> dict:
    def clean(t: str) -> str:
        return re.sub(r"\s+", " ", re.sub(r"\[[^\]]*\]", " ", t.replace(" [title]", ". "))).strip()
    return {"query": clean(row["activity_label"] + ": " + row["ctx"]), "choices": [clean(e) for e in row["endings"]],
            "gold": int(row["label"])}


def mmlu(row: dict) -> dict:
    letters = "ABCD"[:len(row["choices"])]
    listing = " ".join(f"({L}) {c}" for L, c in zip(letters, row["choices"]))
    return {"query": f"Question: {row['question']}\n{listing}\n", "choices": list(letters), "gold": int(row["answer"]),
            "category": row.get("subject")}


def piqa(row: dict) -> dict:
    return {"query": f"Question: {row['goal']}\n", "choices": [row["sol1"], row["sol2"]], "gold": int(row["label"])}


def copa(row: dict) -> dict:
    def lower_first(t: str) -> str:
        return t[:1].lower() + t[1:]
    join = " because" if row["question"] == "cause" else ", therefore"
    return {"query": row["premise"].rstrip(".") + join,
            "choices": [lower_first(row["choice1"]), lower_first(row["choice2"])], "gold": int(row["label"])}


def boolq(row: dict) -> dict:
    q = row["question"][:1].lower() + row["question"][1:]
    return {"query": f"Passage: {row['passage']}\nQuestion: {q}?", "choices": ["no", "yes"], "gold": int(row["label"])}


def winogrande(row: dict) -> dict:
    i = row["sentence"].index("_")
    before, after = row["sentence"][:i], row["sentence"][i + 1:].strip()
    return {"context_options": [before + row["option1"], before + row["option2"]], "continuation": after,
            "gold": int(row["answer"]) - 1}


def winograd(row: dict) -> dict:
    i, p = row["pronoun_loc"], row["pronoun"]
    text = row["text"]
    return {"context_options": [text[:i] + o for o in row["options"]], "continuation": text[i + len(p):].strip(),
            "gold": int(row["label"])}


def lambada(row: dict) -> dict:
    context, word = row["text"].rsplit(" ", 1)
    return {"context": context, "continuation": word}


HUB: Dict[str, HubTask] = {
    "arc_easy": HubTask("allenai/ai2_arc", "ARC-Easy", "test", arc),
    "arc_challenge": HubTask("allenai/ai2_arc", "ARC-Challenge", "test", arc),
    "openbook_qa": HubTask("allenai/openbookqa", "main", "test", openbook),
    "commonsense_qa": HubTask("tau/commonsense_qa", None, "validation", commonsense_qa),
    "hellaswag": HubTask("Rowan/hellaswag", None, "validation", hellaswag),
    "mmlu": HubTask("cais/mmlu", "all", "test", mmlu),
    "piqa": HubTask("ybisk/piqa", None, "validation", piqa),
    "copa": HubTask("aps/super_glue", "copa", "validation", copa),
    "boolq": HubTask("aps/super_glue", "boolq", "validation", boolq),
    "winogrande": HubTask("allenai/winogrande", "winogrande_xl", "validation", winogrande),
    "winograd": HubTask("ErnestSDavis/winograd_wsc", "wsc273", "test", winograd),
    "lambada_openai": HubTask("EleutherAI/lambada_openai", "default", "test", lambada),
    "siqa": HubTask("allenai/social_i_qa", None, "validation", None),
    "agi_eval_lsat_ar": HubTask("hails/agieval-lsat-ar", None, "test", None),
    "squad": HubTask("rajpurkar/squad", None, "validation", None),
    "coqa": HubTask("stanfordnlp/coqa", None, "validation", None),
    "gsm8k": HubTask("openai/gsm8k", "main", "test", None),
    "human_eval": HubTask("openai/openai_humaneval", None, "test", None),
}


def hub_items(name: str) -> List[dict]:
    """The task's items from the hub through `datasets` (network, or its cache), converted and checked."""
    task = task_of(name)
    h = HUB.get(task.name)
    if h is None or h.convert is None:
        raise ValueError(f"task {name}: no converter from the hub" + (f" ({h.dataset} has another layout)" if h else "")
                         + "; pass --task-data with its JSONL file")
    from datasets import load_dataset

    try:
        rows = load_dataset(h.dataset, h.config, split=h.split)
    except Exception as e:  # datasets raises many kinds (offline, missing, gated): one line, the dataset named
        raise ValueError(f"task {name}: {h.dataset} ({h.config or 'default'}, {h.split}) cannot be loaded from the "
                         f"hub: {' '.join(str(e).split())[:200]}") from None
    return [_check(h.convert(dict(r)), task.kind, f"{h.dataset}:{h.split}[{i}]") for i, r in enumerate(rows)]
