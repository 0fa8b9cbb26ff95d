"""The synthetic experiments in the DAG: dry runs of ANDREA-12M/120M-synthetic and of the GPU
smoke target, and the data steps (pull -> tokenize, no training) sizing themselves to the 12M and
120M batch shapes. Runs in a copy of the checkout (tests/test_workflow.py's helpers)."""
import json

import pytest

from andrea.data.sizing import check_shards, need, synthetic_conversations
from andrea.data.tokenizer import load_tokenizer
from andrea.train import compose_config
from test_workflow import ALL_RULES, copy_repo, job_stats, smk


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return copy_repo(tmp_path_factory.mktemp("checkout"))


@pytest.mark.parametrize("target, exp", [("results/ANDREA-12M-synthetic", "ANDREA-12M-synthetic"),
                                         ("results/ANDREA-120M-synthetic", "ANDREA-120M-synthetic"),
                                         ("smoke-gpu", "ANDREA-12M-synthetic-smoke")])
def test_dry_run_every_rule(checkout, target, exp):
    r = smk(checkout, "-n", "--cores", "1", target)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    jobs = job_stats(out)
    assert ALL_RULES <= set(jobs) and jobs["train"] == jobs["archive"] == jobs["evaluate"] == 1
    assert f"results/{exp}/report.md" in out and jobs[target] == 1
    assert f"data/ANDREA-12M-synthetic/synthetic/" in out or exp == "ANDREA-120M-synthetic"


def test_smoke_shares_the_full_runs_data():
    """The smoke run's data is the full run's: same folder, same pull and prep settings."""
    smoke, full = compose_config("ANDREA-12M-synthetic-smoke"), compose_config("ANDREA-12M-synthetic")
    assert smoke.data == full.data and smoke.model == full.model
    assert synthetic_conversations(smoke) == synthetic_conversations(full)
    assert smoke.backend.name == "cuda" and smoke.train.steps < full.train.steps
    for k in ("batch_size", "seq_len", "grad_accum", "precision", "lr", "min_lr"):
        assert getattr(smoke.train, k) == getattr(full.train, k)


# ANDREA-120M-synthetic trains fewer, single-micro-batch steps than ANDREA-120M, so that its published
# reference re-runs in minutes (its experiment file says why); everything else is the hub experiment's
# the synthetic experiments keep one phase: the hub ones' polish phase on the assistant's tokens is a
# chat recipe, and the synthetic runs' published losses were measured without it
SHORTER = {"ANDREA-12M-synthetic": {"phases": []},
           "ANDREA-120M-synthetic": {"steps": 2000, "grad_accum": 1, "warmup_steps": 100, "phases": []}}


@pytest.mark.parametrize("exp, hub", [("ANDREA-12M-synthetic", "ANDREA-12M"), ("ANDREA-120M-synthetic", "ANDREA-120M")])
def test_synthetic_experiment_mirrors_the_hub_one(exp, hub):
    import dataclasses
    ours, theirs = compose_config(exp), compose_config(hub)
    assert ours.model == theirs.model and ours.backend == theirs.backend
    assert ours.train == dataclasses.replace(theirs.train, **SHORTER[exp])
    assert ours.data.source == "synthetic" and ours.eval.n_tasks > 0


@pytest.mark.parametrize("exp", ["ANDREA-12M", "ANDREA-120M"])
def test_data_steps_size_themselves(checkout, exp):
    """`results/<exp> --config overrides=data.source=synthetic` up to the shards: the pull generates
    enough tasks for the batch shape (one validation batch here, to stay small) and the shards hold
    the windows; for ANDREA-120M the BPE stops below 50,304 entries and the ids fit the model."""
    ov = ["data.source=synthetic", "train.eval_batches=1", "data.val_fraction=0.05"]
    r = smk(checkout, "--cores", "1", f"results/{exp}", "--until", "tokenize",
            "--config", "overrides=" + " ".join(ov))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    cfg = compose_config(exp, ov + [f"data.dir={checkout / 'data'}"])
    pulled = json.loads((checkout / "data/synthetic/raw/pull-report.json").read_text())
    assert pulled["rows"] == synthetic_conversations(cfg) > cfg.data.n_synthetic
    info = check_shards(cfg)
    n = need(cfg)
    assert info["train_windows"] >= n.train_windows and info["val_windows"] >= n.val_windows
    tok = load_tokenizer(cfg.data.tokenizer)
    assert tok.vocab_size <= cfg.model.vocab_size
    if exp == "ANDREA-120M":
        assert tok.vocab_size < cfg.model.vocab_size  # trained to what the tasks support
    assert not (checkout / f"results/{exp}/checkpoints").exists()
