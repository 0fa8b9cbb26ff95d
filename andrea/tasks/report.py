"""The standard tasks in the evaluation step (andrea/pipeline/evaluate.py): score eval.tasks from
eval.task_data on the evaluated checkpoint, and the report's section with the table, the baselines
and, against a published reference that holds task scores, the binomial comparison.

    b = for_report(cfg, params, tok, published)     # results.py's dict, or {"skipped": why}
    text = section(b)                                # markdown appended to report.md
    pub = published_fields(metrics)                  # what docs/published/<exp>.json keeps of them
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .results import FORMAT, compare_tasks, comparison_md, table

SKIPPED_EMPTY = ("eval.task_data is empty, so no benchmark file was read (set eval.task_data to the folder "
                 "of the JSONL task files; docs/EVALUATION.md)")


def for_report(cfg, params, tok, published: Optional[dict] = None, log=None) -> dict:
    """eval.tasks scored on the run's backend (its training precision on CUDA, fp32 on NumPy), with
    the comparison against published["tasks"] where there is one; {"skipped": why} when eval.tasks
    or eval.task_data is empty."""
    from ..backends import get_backend
    from ..core.plan import compute_dtype
    from .run import present, run_tasks
    from .score import Scorer
    from .suites import resolve

    e = cfg.eval
    if not e.tasks.strip():
        return {"format": FORMAT, "skipped": "eval.tasks is empty"}
    if not e.task_data:
        return {"format": FORMAT, "skipped": SKIPPED_EMPTY, "asked": e.tasks}
    data = Path(e.task_data)
    if not data.is_dir():
        raise ValueError(f"eval.task_data={e.task_data}: no such folder; expected the folder of the JSONL task files")
    try:
        entries, suite = resolve(e.tasks)
    except ValueError as err:
        raise ValueError(f"eval.tasks={e.tasks!r}: {err}") from None
    present(entries, data)
    be = get_backend(cfg.backend.name)
    precision = "bf16" if cfg.train.precision == "fp8" else cfg.train.precision
    dtype = compute_dtype(precision if precision in be.precisions else "fp32", "float32")
    window = min(cfg.model.context, cfg.train.seq_len)
    scorer = Scorer(cfg.model, be, params, window, dtype)
    res = run_tasks(scorer, tok, entries, data, e.task_limit, suite,
                    {"backend": be.name, "dtype": dtype, "window": window, "shared_context": scorer.shared}, log)
    res["published"] = compare_tasks(res, published)
    return res


def section(b: Optional[dict]) -> str:
    """The report's "Standard tasks" section (markdown, starting with a blank line)."""
    if not b:
        return ""
    out = ["", "## Standard tasks", ""]
    if b.get("skipped"):
        asked = f" (asked for: `{b['asked']}`)." if b.get("asked") else "."
        return "\n".join(out + [f"Not scored: {b['skipped']}{asked}", ""])
    out += [table(b), "",
            f"{b['items']:,} items in {b['wall_s']:.1f} s ({b['items_per_s']:,.1f} items/s) on backend "
            f"`{b['backend']}` ({b['dtype']}, window {b['window']})"
            + (f", the first {b['limit']} items of each task" if b.get("limit") else "")
            + "; how to read them: docs/EVALUATION.md."]
    if b.get("published"):
        out += ["", comparison_md(b["published"])]
    return "\n".join(out + [""])


KEPT = ("kind", "accuracy", "n", "fewshot", "random_baseline", "centered", "truncated")


def published_fields(m: dict) -> dict:
    """What a published reference keeps of an evaluation's standard tasks (metrics.json's
    "benchmarks"): each task's result, the suite's score and how they were computed; {} when none."""
    b = m.get("benchmarks") or {}
    if not b.get("tasks"):
        return {}
    return {"tasks": {n: {k: t[k] for k in KEPT} for n, t in b["tasks"].items()},
            "suite": {k: b["suite"][k] for k in ("name", "score", "averaged")},
            "task_settings": {k: b.get(k) for k in ("backend", "dtype", "window", "limit")}}
