"""Sweeps that optimise: the task returns the run's objective, so Hydra's Optuna sweeper (the
hydra-optuna-sweeper plugin, in the dev extra) can minimise it; each sweep keeps its own
multirun.yaml / optimization_results.yaml under results/sweeps/."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import make_shards

REPO = Path(__file__).resolve().parent.parent


def sweep(tmp_path, *args):
    """python -m andrea.train -m on ANDREA-tiny shapes, 3 steps, random-token shards in tmp_path."""
    d = tmp_path
    argv = [sys.executable, "-m", "andrea.train", "-m", "experiment=ANDREA-tiny", "train.steps=3",
            "train.eval_every=3", "train.eval_batches=1", "train.ckpt_every=0", "train.sample_every=0",
            "backend=numpy", f"results_dir={d / 'results'}", f"data.train_shards={d}/shards/train_*.bin",
            f"data.val_shards={d}/shards/val_*.bin", f"data.tokenizer={d}/none.json", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def last_val_loss(run: Path) -> float:
    hist = json.loads((run / "trained" / f"{run.name}.loss.json").read_text())["history"]
    return [r["val_loss"] for r in hist if r.get("val_loss") is not None][-1]


def test_optuna_sweeper_minimises_the_validation_loss(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    make_shards(tmp_path)
    r = sweep(tmp_path, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=0",
              "train.lr=interval(0.001,0.005)")
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p for p in (tmp_path / "results").iterdir() if p.name.startswith("ANDREA-tiny+"))
    assert len(runs) == 2 and all("train.lr=0.00" in p.name for p in runs)
    (found,) = (tmp_path / "results" / "sweeps").glob("*/optimization_results.yaml")
    first = found.read_text()
    assert yaml.safe_load(first)["best_value"] == pytest.approx(min(last_val_loss(p) for p in runs), rel=1e-12)
    # a second sweep (Hydra's basic sweeper, one job) keeps the first one's results and writes its own
    r2 = sweep(tmp_path, "train.seed=5", "train.steps=2", "train.eval_every=2")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert found.read_text() == first
    kept = sorted((tmp_path / "results" / "sweeps").iterdir())
    assert len(kept) == 2 and (kept[1] / "multirun.yaml").is_file()
    assert not (tmp_path / "results" / "multirun.yaml").exists()


def test_objective_is_the_last_value_of_the_chosen_field(tmp_path):
    from andrea.pipeline.compose import ConfigError
    from andrea.train import objective

    run = tmp_path / "E+train.lr=0.1"
    (run / "trained").mkdir(parents=True)
    hist = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5, "val_loss": 2.7}, {"step": 3, "loss": 2.0},
            {"step": 4, "loss": None, "val_loss": 2.2}]
    (run / "trained" / f"{run.name}.loss.json").write_text(json.dumps({"history": hist}))
    assert objective(run) == 2.2 and objective(run, "loss") == 2.0
    with pytest.raises(ConfigError, match="grad_norm"):
        objective(run, "grad_norm")


def test_optimising_sweep_without_validation_is_refused_before_training(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    make_shards(tmp_path)
    r = sweep(tmp_path, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "train.seed=1,2", "train.eval_every=0")
    assert r.returncode == 2 and "objective=val_loss" in r.stderr and "Traceback" not in r.stderr
    assert not list((tmp_path / "results").glob("ANDREA-tiny+*/checkpoints"))
