"""Scoring a list of tasks on one model: items -> requests -> batched scores -> choices -> results.

    scorer, tok, meta = load_model("results/ANDREA-tiny", backend="numpy")
    res = run_tasks(scorer, tok, resolve("core")[0], "path/to/eval-data", suite="core")
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from .hub import HUB_DATA, from_hub
from .prepare import Prepared, build
from .results import FORMAT, centered, suite_summary
from .suites import KINDS, LM, task_of

def load_model(path, backend: str = "auto", tokenizer=None, precision: str = "", batch_tokens: int = 0,
               shared: bool = True):
    """(Scorer with the weights loaded, tokenizer, run metadata) for a run folder, an archive or a
    checkpoint (andrea/use/locate.py); precision: the compute dtype (default fp32 on NumPy, the
    training precision on CUDA; an fp8 run's outside its products, bf16); shared: options' common
    context computed once (andrea/tasks/shared.py)."""
    from ..backends import get_backend
    from ..core.plan import compute_dtype
    from ..use.locate import load_tokenizer_for, locate
    from .score import Scorer

    located = locate(path, tokenizer, prog="andrea tasks")
    cfg, params = located.load()
    tok = load_tokenizer_for(located, cfg)
    be = get_backend(backend)
    trained = "bf16" if cfg.train.precision == "fp8" else cfg.train.precision
    precision = precision or (trained if trained in be.precisions else "fp32")
    if precision not in be.precisions:
        raise ValueError(f"--precision {precision} needs the CUDA backend; backend {be.name} runs "
                         f"{', '.join(be.precisions)}")
    window = min(cfg.model.context, cfg.train.seq_len)  # positions past seq_len were never trained
    dtype = compute_dtype(precision, "float32")
    scorer = Scorer(cfg.model, be, params, window, dtype, batch_tokens, shared)
    meta = {"run": str(path), "checkpoint": str(located.checkpoint), "exp": cfg.exp, "backend": be.name,
            "dtype": dtype, "window": window, "shared_context": shared}
    return scorer, tok, meta


def choices(reqs, loss, count, greedy, kind: str):
    """Per item (in order): the option picked (lowest mean loss per token; the first on a tie) and,
    for language modelling, whether the continuation is a greedy match (picked 0 or -1)."""
    import pandas as pd

    df = pd.DataFrame({"item": [r.item for r in reqs], "option": [r.option for r in reqs],
                       "mean": loss / count})
    if kind == LM:
        return df["item"].to_numpy(), np.where(greedy, 0, -1)
    best = df.loc[df.groupby("item", sort=True)["mean"].idxmin()]
    return best["item"].to_numpy(), best["option"].to_numpy()


def score_task(scorer, tok, name: str, fewshot: int, data_dir, limit: int = 0, prepared=None):
    """(result dict, per-item picks, requests with their losses) of one task; prepared: its (items,
    Requests) built already (prepare.py), else built here."""
    task = task_of(name)
    t0 = time.perf_counter()
    items, reqs = prepared or build(tok, name, fewshot, data_dir, scorer.window, limit)
    n = min(limit, len(items)) if limit else len(items)
    loss, count, greedy = scorer.score(reqs, argmax=task.kind == LM)
    item, picked = choices(reqs, loss, count, greedy, task.kind)
    gold = np.array([items[i].get("gold", 0) for i in item])
    acc = float((picked == gold).mean())
    n_opts = np.bincount([r.item for r in reqs], minlength=n)[:n]
    chance = 0.0 if task.kind == LM else float((1.0 / n_opts).mean())
    cut = len({r.item for r in reqs if r.cut})
    dt = time.perf_counter() - t0
    res = {"kind": task.kind, "file": HUB_DATA if from_hub(data_dir) else task.path, "accuracy": acc, "n": n,
           "fewshot": fewshot, "random_baseline": task.baseline, "centered": centered(acc, task.baseline),
           "chance": chance, "truncated": cut, "items_per_s": n / dt if dt > 0 else None}
    return res, picked, (reqs, loss, count, greedy)


def why_missing(name: str, data_dir) -> Optional[str]:
    task = task_of(name)
    if task.kind not in KINDS:
        return f"a {task.kind} task (generated answers): not scored by this command"
    if from_hub(data_dir):
        from .hub import HUB
        h = HUB.get(task.name)
        return None if h and h.convert else "no converter from the hub (andrea/tasks/hub.py)"
    if not (Path(data_dir) / task.path).is_file():
        return f"no file {task.path} in {data_dir}"
    return None


def present(entries: List[Tuple[str, int]], data_dir) -> Tuple[List[Tuple[str, int]], List[dict]]:
    """(the entries this command can score from data_dir, [{"task", "why"}] of the others); a
    ValueError when none is there."""
    here, missing = [], []
    for name, k in entries:
        why = why_missing(name, data_dir)
        if why:
            missing.append({"task": name, "why": why})
        else:
            here.append((name, k))
    if not here:
        raise ValueError(f"--task-data {data_dir}: none of the tasks asked for is there ("
                         + "; ".join(f"{m['task']}: {m['why']}" for m in missing) + ")")
    return here, missing


def run_tasks(scorer, tok, entries: List[Tuple[str, int]], data_dir, limit: int = 0, suite: str = "",
              meta: Optional[dict] = None, log=None) -> dict:
    """Every task of entries [(name, few-shot)] present in data_dir, scored; the results dict of
    results.py's format. Progress and items/s per task go to log (stderr)."""
    log = log or sys.stderr
    t0 = time.perf_counter()
    here, missing = present(entries, data_dir)
    for m in missing:
        print(f"andrea tasks: {m['task']}: skipped, {m['why']}", file=log, flush=True)
    tasks = {}
    with Prepared(tok, here, data_dir, scorer.window, limit) as prep:  # the next tasks' built meanwhile
        for name, k in here:
            res, _, _ = score_task(scorer, tok, name, k, data_dir, limit, prep.get(name))
            tasks[name] = res
            print(f"andrea tasks: {name:<34} acc {res['accuracy']:.4f}  n {res['n']:>6,}  {k:>2}-shot  "
                  f"centered {res['centered']:+.4f}  cut {res['truncated']}  {res['items_per_s']:,.1f} items/s",
                  file=log, flush=True)
    wall = time.perf_counter() - t0
    n = sum(t["n"] for t in tasks.values())
    return {"format": FORMAT, **(meta or {}), "limit": limit, "tasks": tasks,
            "suite": suite_summary(suite or "tasks", tasks, missing), "items": n, "wall_s": wall,
            "items_per_s": n / wall if wall > 0 else None}
