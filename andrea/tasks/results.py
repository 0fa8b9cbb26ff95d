"""What a task run reports: per-task accuracy, the suite's mean centered accuracy, the markdown table
(the report's and the terminal's), and the comparison of task scores with a published reference.

tasks.json (format andrea-tasks/1):

    {"format": "andrea-tasks/1", "run", "checkpoint", "exp", "backend", "dtype", "window", "limit",
     "tasks": {name: {"kind", "file", "accuracy", "n", "fewshot", "random_baseline", "centered",
                      "chance", "truncated", "items_per_s"}},
     "suite": {"name", "score", "averaged": [names], "missing": [{"task", "why"}]},
     "items", "wall_s", "items_per_s"}

centered = (accuracy - random_baseline) / (1 - random_baseline): 0 at the baseline, 1 when every
item is right, negative below the baseline; the suite's score is its mean over the tasks scored
(CORE's definition). chance is measured from the items (mean of 1 / options).

Against a published reference, each task's accuracy is compared with the reference's by a binomial
interval: the Wilson score interval at Z (99%) of the reference's accuracy over the same n items.
Two runs of one model on one machine give the same choices; another machine or kernel can flip the
few items whose options score within rounding of each other, which moves the accuracy by about
1/n each: far inside the interval. A different model lands outside it on tasks it does better or
worse at, unless n is small.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

FORMAT = "andrea-tasks/1"
Z = 2.576  # two-sided 99%


def centered(acc: float, baseline: float) -> float:
    return (acc - baseline) / (1.0 - baseline)


def suite_summary(name: str, tasks: Dict[str, dict], missing: List[dict]) -> dict:
    scored = list(tasks)
    score = sum(tasks[t]["centered"] for t in scored) / len(scored) if scored else None
    return {"name": name, "score": score, "averaged": scored, "missing": missing}


def table(res: dict) -> str:
    """Markdown: one row per task (accuracy, items, few-shot, baseline, centered, cut), the suite's
    mean, and the tasks missing from it."""
    import pandas as pd

    t = res.get("tasks") or {}
    if not t:
        return "No task scored."
    df = pd.DataFrame.from_dict(t, orient="index")
    df = pd.DataFrame({"task": df.index, "kind": df["kind"], "accuracy": df["accuracy"].map("{:.4f}".format),
                       "n": df["n"].map("{:,}".format), "few-shot": df["fewshot"].astype(str),
                       "random baseline": df["random_baseline"].map("{:.2f}".format),
                       "centered": df["centered"].map("{:+.4f}".format),
                       "cut to the window": df["truncated"].astype(str)})
    lines = ["| " + " | ".join(df.columns) + " |", "|" + " --- |" * len(df.columns)]
    lines += ("| " + df.astype(str).agg(" | ".join, axis=1) + " |").tolist()
    s = res.get("suite") or {}
    if s.get("score") is not None:
        lines += ["", f"**{s['name']}**: mean centered accuracy {s['score']:+.4f} over {len(s['averaged'])} tasks"
                  + (f"; missing: {', '.join(m['task'] for m in s['missing'])}" if s.get("missing") else "") + "."]
    return "\n".join(lines)


def wilson(p: float, n: int, z: float = Z) -> tuple:
    """The Wilson score interval of a proportion p measured on n items."""
    if n <= 0:
        return 0.0, 1.0
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return mid - half, mid + half


def compare_tasks(mine: dict, published: Optional[dict]) -> Optional[dict]:
    """Each task both hold (the same n and few-shot): inside the Wilson interval of the published
    accuracy or not; verdict PASS when every such task is inside. None when there is nothing to
    compare."""
    ref = (published or {}).get("tasks") or {}
    rows = []
    for name, t in (mine.get("tasks") or {}).items():
        r = ref.get(name)
        if not r or r.get("n") != t["n"] or r.get("fewshot") != t["fewshot"]:
            continue
        lo, hi = wilson(r["accuracy"], r["n"])
        rows.append({"task": name, "accuracy": t["accuracy"], "published": r["accuracy"], "n": t["n"],
                     "low": lo, "high": hi, "inside": lo <= t["accuracy"] <= hi})
    if not rows:
        return None
    return {"verdict": "PASS" if all(r["inside"] for r in rows) else "FAIL", "z": Z, "tasks": rows,
            "suite": ((published or {}).get("suite") or {}).get("score")}


def comparison_md(c: dict) -> str:
    out = [f"Task scores against the published run: **{c['verdict']}** (each accuracy inside the 99% Wilson "
           "interval of the published one over the same items)", "",
           "| task | accuracy | published | interval | |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {r['task']} | {r['accuracy']:.4f} | {r['published']:.4f} | [{r['low']:.4f}, {r['high']:.4f}] | "
            f"{'inside' if r['inside'] else 'OUTSIDE'} |" for r in c["tasks"]]
    return "\n".join(out)
