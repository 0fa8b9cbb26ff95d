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

Where the hub and the local file differ in more than text, the converter's docstring says so: SIQA
and AGIEval LSAT-AR keep every option the hub has (three and five), where the gauntlet's files keep
two and four; SQuAD and CoQA are written in a layout of this module's own (the gauntlet's files of
them are not in the local copy to compare with). A converter returns one item, or a list of items
where one hub row holds several (CoQA: one story, a conversation of questions).
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, NamedTuple, Optional, Union

from .data import TaskDataError, _check
from .suites import task_of


HUB_DATA = "hub"  # --task-data hub: the items from the Hugging Face hub


def from_hub(data_dir) -> bool:
    """Whether --task-data names the hub rather than a folder."""
    return str(data_dir) == HUB_DATA


class HubTask(NamedTuple):
    dataset: str
    config: Optional[str]
    split: str
    convert: Optional[Callable[[dict], Union[dict, List[dict]]]]  # a hub row -> JSONL item(s); None: none


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


def siqa(row: dict) -> dict:
    """Social IQa (allenai/social_i_qa: context, question, answerA/B/C, label "1".."3"), in the local
    file's text: "Context: ...\nQuestion: ...\nChoices:\nA. ...\nB. ...\nAnswer:", the letters as
    choices. The hub has three answers a question and the local file two: the gauntlet dropped one
    wrong answer of each, by a rule its sources do not give, so all three are kept here (chance 1/3,
    not the file's 1/2; the table's baseline 0.5 is the file's)."""
    answers = [row["answerA"], row["answerB"], row["answerC"]]
    listing = "".join(f"\n{L}. {a}" for L, a in zip("ABC", answers))
    return {"query": f"Context: {row['context']}\nQuestion: {row['question']}\nChoices:{listing}\nAnswer:",
            "choices": list("ABC"), "gold": int(row["label"]) - 1}


def lsat_ar(row: dict) -> dict:
    """AGIEval LSAT-AR (hails/agieval-lsat-ar: query, choices, gold as a one-element list), in the local
    file's text: "Passage: ...\nQ: ...\nChoices:\nA.) ...\nAnswer:", the letters as choices. The hub's
    query is AGIEval's zero-shot prompt, passage + "Q: " + question + " Answer Choices: (A)... (B)..." +
    "\nA: Among A through E, the answer is", and its choices the options "(A)..."; the passage and
    question are read back out of it. The hub has five options (A-E) and the local file four: the
    gauntlet dropped one wrong option, by a rule its sources do not give, so all five are kept (chance
    1/5; the table's baseline 0.25 is the file's)."""
    head = row["query"][:row["query"].rindex(" Answer Choices: ")]
    passage, question = head.rsplit("Q: ", 1)
    options = [re.sub(r"^\s*\([A-Z]\)\s*", "", c) for c in row["choices"]]
    letters = "ABCDEFG"[:len(options)]
    if len(row["gold"]) != 1:
        raise ValueError(f"gold is {row['gold']}; expected one index")
    listing = "".join(f"\n{L}.) {o}" for L, o in zip(letters, options))
    return {"query": f"Passage: {passage.strip()}\nQ: {question.strip()}\nChoices:{listing}\nAnswer:",
            "choices": list(letters), "gold": int(row["gold"][0])}


def squad(row: dict) -> dict:
    """SQuAD v1.1 (rajpurkar/squad: id, title, context, question, answers {text, answer_start}): the
    passage and the question as context, the first reference answer as continuation (exact match on
    it alone, where SQuAD's own score takes the best of the references). The gauntlet's squad.jsonl
    is not in the local copy, so its text could not be matched: the layout is this module's own,
    "{passage}\nQuestion: {question}\nAnswer:", the prompt's delimiter then the answer."""
    return {"context": f"{row['context']}\nQuestion: {row['question']}\nAnswer:",
            "continuation": row["answers"]["text"][0]}


def coqa(row: dict) -> List[dict]:
    """CoQA (stanfordnlp/coqa: source, story, questions [...], answers {input_text, answer_start,
    answer_end}): one hub row is a story and its conversation, and becomes one item per question (500
    stories in the validation split; the gauntlet counts 7,983 questions). Item k's context is the
    story, the questions before k each with its answer, and question k; its continuation answer k.
    The gauntlet describes its coqa.jsonl so ("the document as well as all the preceding
    questions/answers"), but the file is not in the local copy: the text layout is squad()'s.
    Unanswerable questions keep CoQA's answer "unknown". Few-shot examples may come from the same
    story (CORE scores CoQA zero-shot)."""
    turns = [f"\nQuestion: {q}\nAnswer:" for q in row["questions"]]
    answers = list(row["answers"]["input_text"])
    if len(answers) != len(turns):
        raise ValueError(f"{len(turns)} questions and {len(answers)} answers; expected one answer a question")
    return [{"context": row["story"] + "".join(t + " " + a for t, a in zip(turns[:k], answers[:k])) + turns[k],
             "continuation": answers[k]} for k in range(len(turns))]


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
    "siqa": HubTask("allenai/social_i_qa", None, "validation", siqa),
    "agi_eval_lsat_ar": HubTask("hails/agieval-lsat-ar", None, "test", lsat_ar),
    "squad": HubTask("rajpurkar/squad", None, "validation", squad),
    "coqa": HubTask("stanfordnlp/coqa", None, "validation", coqa),
    "gsm8k": HubTask("openai/gsm8k", "main", "test", None),
    "human_eval": HubTask("openai/openai_humaneval", None, "test", None),
}


def hub_items(name: str) -> List[dict]:
    """The task's items from the hub through `datasets` (network, or its cache), converted and checked;
    a row the converter cannot read, or an item it makes that fails the check, is one TaskDataError
    naming the row (and the item's place in it where the row makes several)."""
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
    items = []
    for i, r in enumerate(rows):
        where = f"{h.dataset}:{h.split}[{i}]"
        try:
            out = h.convert(dict(r))
        except (KeyError, IndexError, TypeError, ValueError) as e:  # a row not in the layout the converter reads
            raise TaskDataError(f"{where}: not in the layout of {h.dataset} ({type(e).__name__}: {e})") from None
        many = isinstance(out, list)  # several items of one row (coqa): each named by its place in the row
        items += [_check(it, task.kind, f"{where}.{j}" if many else where)
                  for j, it in enumerate(out if many else [out])]
    return items
