"""The tasks this command knows, their files in the in-context-learning JSONL layout (MosaicML's eval
gauntlet, the DCLM paper's CORE metric), and the suites `core` and `gauntlet`.

Each task has one kind (how it is scored, andrea/tasks/score.py), the continuation delimiter its
prompts put between query and answer, and the random baseline its centered accuracy subtracts:
(accuracy - baseline) / (1 - baseline). The baselines are those of CORE's task metadata (boolq's
0.62 is the majority answer, not a coin: a model that always says "yes" centres at 0); `chance`
in the results is measured from the items themselves (the mean of 1 / number of options).

A suite names tasks with their few-shot counts: `core` uses CORE's own (DCLM, arXiv 2406.11794,
Table 11; the same settings karpathy/nanochat's base_eval reads), `gauntlet` those of llm-foundry's
eval gauntlet. Tasks of a suite whose file is not in the data folder are reported as missing and
left out of its mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

MC, SCHEMA, LM = "multiple_choice", "schema", "language_modeling"
KINDS = (MC, SCHEMA, LM)
ANSWER = "\nAnswer: "  # the delimiter CORE gives jeopardy, arc, piqa and boolq; the others take " "


@dataclass(frozen=True)
class Task:
    name: str
    path: str  # relative to --task-data
    kind: str  # MC, SCHEMA or LM; "generation" / "code": known, not scored by this command
    baseline: float  # the random baseline of the centered accuracy
    delimiter: str = " "  # between the query (context) and the answer (continuation)


def _t(name, path, kind, baseline, delimiter=" "):
    return name, Task(name, path, kind, baseline, delimiter)


TASKS: Dict[str, Task] = dict([
    _t("arc_easy", "world_knowledge/arc_easy.jsonl", MC, 0.25, ANSWER),
    _t("arc_challenge", "world_knowledge/arc_challenge.jsonl", MC, 0.25, ANSWER),
    _t("jeopardy", "world_knowledge/jeopardy_all.jsonl", LM, 0.0, ANSWER),
    _t("bigbench_qa_wikidata", "world_knowledge/bigbench_qa_wikidata.jsonl", LM, 0.0),
    _t("mmlu", "world_knowledge/mmlu.jsonl", MC, 0.25, ANSWER),
    _t("copa", "commonsense_reasoning/copa.jsonl", MC, 0.5),
    _t("commonsense_qa", "commonsense_reasoning/commonsense_qa.jsonl", MC, 0.25),
    _t("piqa", "commonsense_reasoning/piqa.jsonl", MC, 0.5, ANSWER),
    _t("openbook_qa", "commonsense_reasoning/openbook_qa.jsonl", MC, 0.25),
    _t("siqa", "commonsense_reasoning/siqa.jsonl", MC, 0.5),
    _t("hellaswag", "language_understanding/hellaswag.jsonl", MC, 0.25),
    _t("lambada_openai", "language_understanding/lambada_openai.jsonl", LM, 0.0),
    _t("winograd", "language_understanding/winograd_wsc.jsonl", SCHEMA, 0.5),
    _t("winogrande", "language_understanding/winogrande.jsonl", SCHEMA, 0.5),
    _t("bigbench_language_identification", "language_understanding/bigbench_language_identification.jsonl",
       MC, 0.25),
    _t("bigbench_dyck_languages", "symbolic_problem_solving/bigbench_dyck_languages.jsonl", LM, 0.0),
    _t("agi_eval_lsat_ar", "symbolic_problem_solving/agi_eval_lsat_ar.jsonl", MC, 0.25),
    _t("bigbench_cs_algorithms", "symbolic_problem_solving/bigbench_cs_algorithms.jsonl", LM, 0.0),
    _t("bigbench_operators", "symbolic_problem_solving/bigbench_operators.jsonl", LM, 0.0),
    _t("bigbench_repeat_copy_logic", "symbolic_problem_solving/bigbench_repeat_copy_logic.jsonl", LM, 0.0),
    _t("squad", "reading_comprehension/squad.jsonl", LM, 0.0),
    _t("coqa", "reading_comprehension/coqa.jsonl", LM, 0.0),
    _t("boolq", "reading_comprehension/boolq.jsonl", MC, 0.62, ANSWER),
    _t("gsm8k", "symbolic_problem_solving/gsm8k.jsonl", "generation", 0.0),
    _t("human_eval", "programming/human_eval.jsonl", "code", 0.0),
])

# CORE's 22 entries: (task, few-shot). hellaswag twice (0- and 10-shot); the zero-shot one is named
# hellaswag_zeroshot in the results.
CORE: List[Tuple[str, int]] = [
    ("hellaswag_zeroshot", 0), ("jeopardy", 10), ("bigbench_qa_wikidata", 10), ("arc_easy", 10),
    ("arc_challenge", 10), ("copa", 0), ("commonsense_qa", 10), ("piqa", 10), ("openbook_qa", 0),
    ("lambada_openai", 0), ("hellaswag", 10), ("winograd", 0), ("winogrande", 0),
    ("bigbench_dyck_languages", 10), ("agi_eval_lsat_ar", 3), ("bigbench_cs_algorithms", 10),
    ("bigbench_operators", 10), ("bigbench_repeat_copy_logic", 10), ("squad", 10), ("coqa", 0),
    ("boolq", 10), ("bigbench_language_identification", 10)]

# llm-foundry's gauntlet settings for the tasks of its JSONL layout that this command scores
# (gsm8k and human_eval are generation tasks: named missing when asked for).
GAUNTLET: List[Tuple[str, int]] = [
    ("arc_easy", 3), ("arc_challenge", 3), ("jeopardy", 3), ("bigbench_qa_wikidata", 3), ("mmlu", 5),
    ("copa", 0), ("commonsense_qa", 0), ("piqa", 0), ("openbook_qa", 10), ("siqa", 3),
    ("hellaswag", 0), ("lambada_openai", 0), ("winograd", 3), ("winogrande", 5),
    ("bigbench_dyck_languages", 5), ("agi_eval_lsat_ar", 5), ("bigbench_cs_algorithms", 10),
    ("bigbench_operators", 3), ("boolq", 0), ("gsm8k", 0), ("human_eval", 0)]

SUITES = {"core": CORE, "gauntlet": GAUNTLET}
ALIASES = {"hellaswag_zeroshot": "hellaswag"}  # a result name -> the task whose file it reads
DEFAULT_FEWSHOT = 0  # a task named on its own, without --fewshot


def task_of(name: str) -> Task:
    """The Task a result name reads (hellaswag_zeroshot reads hellaswag's file)."""
    return TASKS[ALIASES.get(name, name)]


def resolve(spec: str, fewshot=None) -> Tuple[List[Tuple[str, int]], str]:
    """--tasks LIST (comma-separated task and suite names) -> [(result name, few-shot)] in order,
    no name twice, and the suite's name when LIST is exactly one suite (else "")."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError("--tasks is empty; expected task names or a suite (core, gauntlet)")
    out: Dict[str, int] = {}
    for n in names:
        if n in SUITES:
            entries = SUITES[n]
        elif n in TASKS or n in ALIASES:
            entries = [(n, DEFAULT_FEWSHOT)]
        else:
            raise ValueError(f"--tasks: unknown task or suite {n!r}; expected one of the suites "
                             f"{', '.join(SUITES)} or the tasks {', '.join(sorted(TASKS))}")
        for name, k in entries:
            out.setdefault(name, k if fewshot is None else fewshot)
    suite = names[0] if len(names) == 1 and names[0] in SUITES else ""
    return list(out.items()), suite
