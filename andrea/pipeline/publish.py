"""Freeze a finished experiment's evaluation as its published reference.

    python -m andrea.pipeline.publish results/ANDREA-12M-synthetic --machine "one NVIDIA H200, CUDA backend"

Reads `<results>/eval/metrics.json` (written by andrea.pipeline.evaluate) and the run's `<exp>.loss.json`, and
writes `docs/published/<exp>.json` (or --out): the numbers the report of a later run of the same
experiment is judged against (PASS/FAIL on the validation loss within eval.tolerance), its training
speed, wall time and memory plan, the machine, the commit, and the logged losses, so a rerun can say
how many of them it reproduced bit for bit. Where the evaluation scored standard tasks (eval.tasks,
eval/tasks.json) the reference keeps each task's accuracy, items and few-shot count and the
suite's score; a later report compares its own with a binomial interval per task
(andrea/tasks/results.py). Its provenance (the evaluation's: commit, numpy, Python, GPU, backend,
a sha256 of the kernel sources) gets the CUDA backend's tuning defaults (`kernel_settings`, the
launch geometry of andrea/backends/cuda/tuning.py; None where CuPy is not installed). Nothing is
evaluated again.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .evaluate import git_commit, history_of, write_published
from .runs import compared_overrides


def kernel_settings():
    """The CUDA backend's tuning defaults (they change how kernels are launched, not the bits they
    are meant to give), or None where the CUDA backend cannot be imported (no CuPy)."""
    try:
        from ..backends.cuda.tuning import Tuning
    except ImportError:
        return None
    return dataclasses.asdict(Tuning())


def publish(results: Path, out: Path | None, machine: str, commit: str | None) -> Path:
    metrics_path = results / "eval" / "metrics.json"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path}: no evaluation; run `snakemake --cores 1 {results}` first")
    m = json.loads(metrics_path.read_text())
    for field in ("exp", "val_loss", "perplexity", "bits_per_byte", "step", "config_hash"):
        if field not in m:
            raise ValueError(f"{metrics_path}: field {field!r} is missing; expected andrea.pipeline.evaluate's metrics")
    differ = compared_overrides(m.get("overrides") or [])
    if differ:
        raise ValueError(f"{metrics_path}: field overrides holds {' '.join(differ)}; "
                         "only an experiment's pinned config is published")
    loss_path = results / "trained" / f"{m['exp']}.loss.json"
    if not loss_path.is_file():
        raise FileNotFoundError(f"{loss_path}: the run's training history is missing")
    out = out or Path("docs") / "published" / f"{m['exp']}.json"
    m["provenance"] = {**(m.get("provenance") or {}), "kernel_settings": kernel_settings()}
    write_published(out, m, history_of(json.loads(loss_path.read_text())), machine, commit or git_commit())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m andrea.pipeline.publish", description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="the experiment's results folder (results/<EXP>)")
    ap.add_argument("--machine", required=True, help="where it ran, in words (GPU, backend, command)")
    ap.add_argument("--commit", default="", help="the commit it ran at (default: git rev-parse HEAD)")
    ap.add_argument("--out", type=Path, help="default docs/published/<exp>.json")
    a = ap.parse_args(argv)
    try:
        path = publish(a.results, a.out, a.machine, a.commit or None)
    except (FileNotFoundError, ValueError) as e:
        print(f"andrea.pipeline.publish: {e}", file=sys.stderr)
        return 2
    print(f"andrea.pipeline.publish: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
