"""Compare runs: one table of run folders, one overlay plot of their loss curves.

    python -m andrea.pipeline.compare results/ANDREA-tiny results/ANDREA-tiny+train.lr=0.001 [--plot results/compare.png]
    python -m andrea.pipeline.compare results/ANDREA-tiny*          # a sweep, every run of an experiment

For each run folder (its config.yaml and <exp>.loss.json, and eval/metrics.json once evaluated)
the table gives: the run, its overrides, the two validation losses, each beside its batch count
(never one column of both: they average different numbers of the same windows): the evaluation's
(val_loss, eval.batches, blank until evaluated) and the last one measured during training
(train_val_loss, train.eval_batches), synthetic-task accuracy, the standard tasks' suite score
(eval/tasks.json's mean centered accuracy, andrea/tasks), median tokens/s over the logged
steps, the steps done and the training wall time. Rows are sorted by the evaluation's validation
loss, then training's. The plot overlays each run's validation loss (training loss faint), labelled by its
overrides; --log-scale puts the loss on a logarithmic axis. --csv writes the table too.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import pandas as pd

from ..util.atomic import atomic_savefig, atomic_write

COLUMNS = ["run", "overrides", "val_loss", "val_batches", "train_val_loss", "train_val_batches", "task_accuracy",
           "suite_score", "tokens_per_s", "steps", "wall_s"]


class RunError(ValueError):
    """A run folder that cannot be read; the message names the file."""


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: {e}") from e


def read_run(run_dir: Path) -> dict:
    """{exp, overrides, history (DataFrame of step records), metrics (dict or None)} of a run folder."""
    import yaml

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise RunError(f"{run_dir}: no config.yaml (not a run folder of python -m andrea.train)")
    try:
        cfg = yaml.safe_load(cfg_path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RunError(f"{cfg_path}: {e}") from e
    exp = str(cfg.get("exp") or run_dir.name)
    loss_path = run_dir / f"{exp}.loss.json"
    hist = _json(loss_path).get("history", []) if loss_path.is_file() else []
    if not isinstance(hist, list):
        raise RunError(f"{loss_path}: field history is not a list")
    frame = pd.DataFrame.from_records([r for r in hist if isinstance(r, dict)],
                                      columns=["step", "loss", "val_loss", "tokens_per_s", "wall_s"])
    metrics_path = run_dir / "eval" / "metrics.json"
    metrics = _json(metrics_path) if metrics_path.is_file() else None
    train = cfg.get("train") if isinstance(cfg.get("train"), dict) else {}
    return {"run": run_dir.name, "dir": run_dir, "overrides": list(cfg.get("overrides") or []),
            "history": frame, "metrics": metrics, "train_val_batches": train.get("eval_batches")}


def summary(runs: Sequence[dict]) -> pd.DataFrame:
    """One row per run (COLUMNS), sorted by the evaluation's validation loss, then training's
    (runs without one last)."""
    rows = []
    for r in runs:
        h, m = r["history"], r["metrics"] or {}
        val = h["val_loss"].dropna()
        rows.append({
            "run": r["run"],
            "overrides": " ".join(r["overrides"]) or "(pinned)",
            "val_loss": m.get("val_loss"),
            "val_batches": m.get("val_batches") if "val_loss" in m else None,
            "train_val_loss": val.iloc[-1] if len(val) else None,
            "train_val_batches": r.get("train_val_batches") if len(val) else None,
            "task_accuracy": (m.get("tasks") or {}).get("accuracy"),
            "suite_score": ((m.get("benchmarks") or {}).get("suite") or {}).get("score"),
            "tokens_per_s": h["tokens_per_s"].dropna().median() if len(h) else None,
            "steps": int(h["step"].max()) if h["step"].notna().any() else 0,
            "wall_s": h["wall_s"].dropna().max() if len(h) else None,
        })
    df = pd.DataFrame.from_records(rows, columns=COLUMNS)
    for col in ("val_loss", "train_val_loss", "task_accuracy", "suite_score", "tokens_per_s", "wall_s"):
        df[col] = pd.to_numeric(df[col])
    for col in ("val_batches", "train_val_batches"):
        df[col] = pd.to_numeric(df[col]).astype("Int64")
    return df.sort_values(["val_loss", "train_val_loss"], na_position="last", kind="stable").reset_index(drop=True)


def label(r: dict) -> str:
    return " ".join(r["overrides"]) or f"{r['run']} (pinned)"


def plot(path: Path, runs: Sequence[dict], log_scale: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for i, r in enumerate(runs):
        h, color = r["history"], f"C{i % 10}"
        tr = h.dropna(subset=["loss"])
        va = h.dropna(subset=["val_loss"])
        if len(tr):
            ax.plot(tr["step"], tr["loss"], color=color, lw=0.8, alpha=0.35)
        if len(va):
            ax.plot(va["step"], va["val_loss"], "o-", color=color, ms=3, label=label(r))
        elif len(tr):
            ax.plot([], [], color=color, label=label(r))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats" + (", log scale)" if log_scale else ")"))
    if log_scale:
        ax.set_yscale("log")
    counts = sorted({str(r.get("train_val_batches")) for r in runs if r.get("train_val_batches") is not None})
    ax.set_title("validation loss during training (points" + (f", {'/'.join(counts)} batches" if counts else "")
                 + "), training loss (faint)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def _count(v) -> str:
    return "-" if pd.isna(v) else str(int(v))


def format_table(df: pd.DataFrame) -> str:
    counts = ("val_batches", "train_val_batches")  # nullable integers, printed as "-" when absent
    df = df.assign(**{c: df[c].map(_count) for c in counts})
    return df.to_string(index=False, na_rep="-", formatters={
        "val_loss": "{:.4f}".format, "train_val_loss": "{:.4f}".format, "task_accuracy": "{:.3f}".format,
        "suite_score": "{:+.4f}".format,
        "tokens_per_s": "{:,.0f}".format, "wall_s": "{:.1f}".format})


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m andrea.pipeline.compare", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (results/<run>)")
    ap.add_argument("--plot", type=Path, help="overlay plot (default: compare.png beside the first run, results/compare.png)")
    ap.add_argument("--log-scale", action="store_true", help="logarithmic loss axis")
    ap.add_argument("--csv", type=Path, help="also write the table as CSV")
    a = ap.parse_args(argv)
    try:
        runs = [read_run(d) for d in a.runs]
    except RunError as e:
        print(f"andrea.pipeline.compare: {e}", file=sys.stderr)
        return 2
    df = summary(runs)
    print(format_table(df))
    if a.csv:
        atomic_write(a.csv, df.to_csv(index=False))
    out = a.plot or a.runs[0].resolve().parent / "compare.png"  # under results/, never the checkout's top
    plot(out, runs, a.log_scale)
    print(f"andrea.pipeline.compare: overlay plot {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
