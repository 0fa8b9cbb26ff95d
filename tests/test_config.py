"""Hydra configs: experiments pin the contract shapes; bad configs fail naming the key; sweeps."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from andrea.core.model import count_params
from andrea.train import ConfigError, compose_config

REPO = Path(__file__).resolve().parent.parent
SHAPES = {  # docs/ARCHITECTURE.md, "The model"
    "ANDREA-tiny": (2, 64, 4, 64, 512),
    "ANDREA-12M": (6, 384, 6, 256, 8192),
    "ANDREA-120M": (12, 768, 12, 1024, 50304),
}


def run_train(*args, cwd=REPO, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "andrea.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("exp", sorted(SHAPES))
def test_experiment_shapes(exp):
    cfg = compose_config(exp)
    m = cfg.model
    assert (m.n_layer, m.d_model, m.n_head, m.context, m.vocab_size) == SHAPES[exp]
    assert cfg.exp == exp and m.name == exp


def test_parameter_counts():
    assert round(count_params(compose_config("ANDREA-12M").model) / 1e6, 1) == 13.9
    assert round(count_params(compose_config("ANDREA-120M").model) / 1e6, 1) == 124.5


def test_tiny_is_cpu_offline_default():
    cfg = compose_config("ANDREA-tiny")
    assert cfg.data.source == "synthetic" and cfg.train.precision == "fp32"
    assert (cfg.train.steps, cfg.train.batch_size) == (1500, 8)
    assert cfg.data.tokenizer == "data/synthetic/tok512/tokenizer.json"


@pytest.mark.parametrize("exp", ["ANDREA-12M", "ANDREA-120M"])
def test_gpu_experiments_pin_hub_revision_and_fp16(exp):
    cfg = compose_config(exp)
    assert cfg.train.precision == "fp16" and cfg.backend.name == "auto"
    assert cfg.data.source == "hub" and len(cfg.data.revision) == 40  # a commit sha, not "main"
    assert cfg.train.seq_len == cfg.model.context


@pytest.mark.parametrize("exp", sorted(SHAPES))
def test_experiment_file_pins_everything(exp):
    """The experiment file itself states what decides the result, not only the groups."""
    y = yaml.safe_load((REPO / "conf" / "experiment" / f"{exp}.yaml").read_text())
    assert y["exp"] == exp and "vocab_size" in y["model"]
    assert {"source", "seed" if exp == "ANDREA-tiny" else "revision"} <= set(y["data"])
    assert {"seed", "steps", "batch_size", "seq_len", "lr", "min_lr", "warmup_steps", "precision"} <= set(y["train"])


def test_override_changes_value():
    assert compose_config("ANDREA-tiny", ["train.lr=1e-3"]).train.lr == 1e-3


def test_unknown_key_named():
    with pytest.raises(ConfigError, match=r"Key 'lrr' not in 'TrainConfig'"):
        compose_config("ANDREA-tiny", ["train.lrr=1"])
    r = run_train("experiment=ANDREA-tiny", "train.lrr=1")
    assert r.returncode != 0 and "train.lrr" in r.stderr


def test_wrong_type_named():
    r = run_train("experiment=ANDREA-tiny", "train.steps=many")
    assert r.returncode != 0
    assert "train.steps" in r.stderr and "could not be converted to Integer" in r.stderr


def test_missing_experiment_named():
    r = run_train()
    assert r.returncode != 0 and "You must specify 'experiment'" in r.stderr and "ANDREA-tiny" in r.stderr
    r = run_train("experiment=ANDREA-huge")
    assert r.returncode != 0 and "Could not find 'experiment/ANDREA-huge'" in r.stderr


def test_bad_group_file_named(tmp_path):
    """A typo in a group YAML fails with the key and the file, before anything runs."""
    import shutil
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    p = conf / "train" / "tiny.yaml"
    p.write_text(p.read_text() + "warmup_stpes: 10\n")
    with pytest.raises(ConfigError, match=r"warmup_stpes") as e:
        compose_config("ANDREA-tiny", conf_dir=conf)
    assert "train/tiny" in str(e.value)


def test_cross_field_error_exit_2(tmp_path):
    r = run_train("experiment=ANDREA-tiny", f"results_dir={tmp_path}", "train.seq_len=128")
    assert r.returncode == 2
    assert "train.seq_len=128 exceeds model.context=64" in r.stderr
    assert not (tmp_path / "ANDREA-tiny" / "config.yaml").exists()


def _shard_overrides(tmp_path, named=True):
    """Small-run overrides; named: exp=ANDREA-tiny keeps the run in results/ANDREA-tiny."""
    from conftest import make_shards
    d = make_shards(tmp_path, vocab=512)
    return [f"data.train_shards={d}/train_*.bin", f"data.val_shards={d}/val_*.bin",
            f"data.tokenizer={tmp_path}/none.json", "train.steps=3", "train.eval_every=0",
            "train.sample_every=0", "train.ckpt_every=0", "train.seq_len=16", "train.batch_size=2",
            "backend=numpy", f"results_dir={tmp_path}/results"] + (["exp=ANDREA-tiny"] if named else [])


def test_run_writes_resolved_config_and_refuses_other_settings(tmp_path):
    ov = _shard_overrides(tmp_path)
    r = run_train("experiment=ANDREA-tiny", *ov)
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "results" / "ANDREA-tiny"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["steps"] == 3 and saved["exp"] == "ANDREA-tiny"
    assert (run / "checkpoints" / "step_00000003.bin").is_file()
    assert not (REPO / "outputs").exists()
    r = run_train("experiment=ANDREA-tiny", *ov, "train.lr=1e-4")
    assert r.returncode == 2
    assert "other model/training settings" in r.stderr and "checkpoints" in r.stderr


def test_corrupt_history_stops_the_run_with_its_name(tmp_path):
    ov = _shard_overrides(tmp_path)
    run = tmp_path / "results" / "ANDREA-tiny"
    run.mkdir(parents=True)
    (run / "ANDREA-tiny.loss.json").write_text('{"format": "andrea-loss/1", "history": [{"step": 1')
    r = run_train("experiment=ANDREA-tiny", *ov)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "ANDREA-tiny.loss.json" in r.stderr
    assert (run / "ANDREA-tiny.loss.json").read_text().endswith('"step": 1')  # left as it was


def test_sweep_runs_each_to_its_own_folder(tmp_path):
    r = run_train("-m", "experiment=ANDREA-tiny", *_shard_overrides(tmp_path), "train.lr=1e-3,2e-3", timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    results = tmp_path / "results"
    names = sorted(p.name for p in results.iterdir() if p.is_dir() and p.name != "sweeps")
    # train.steps etc. of _shard_overrides name the runs too; the paths and the backend do not
    assert len(names) == 2 and all(n.startswith("ANDREA-tiny+") and "train.lr=" in n for n in names), names
    assert not any("shards" in n or "results_dir" in n for n in names), names
    cfgs = [yaml.safe_load((results / n / "config.yaml").read_text()) for n in names]
    assert sorted(c["train"]["lr"] for c in cfgs) == [1e-3, 2e-3]
    for n, c in zip(names, cfgs):
        assert c["exp"] == n and "train.steps=3" in c["overrides"]
        assert (results / n / f"{n}.loss.json").is_file()


def test_override_run_gets_its_own_folder(tmp_path):
    """A run with train.lr=1e-3 lives beside the one without (which it leaves alone); exp=NAME names a run."""
    ov = _shard_overrides(tmp_path, named=False)
    results = tmp_path / "results"
    assert run_train("experiment=ANDREA-tiny", *ov).returncode == 0
    (first,) = list(results.iterdir())
    r = run_train("experiment=ANDREA-tiny", *ov, "train.lr=1e-3")
    assert r.returncode == 0, r.stderr[-2000:]
    (run,) = set(results.iterdir()) - {first}
    assert run.name.startswith("ANDREA-tiny+") and "train.lr=0.001" in run.name.split("+", 1)[1].split(",")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["exp"] == run.name and saved["train"]["lr"] == 1e-3 and "train.lr=1e-3" in saved["overrides"]
    assert (run / f"{run.name}.loss.json").is_file() and f"python -m andrea.pipeline.dashboard {run}" in r.stderr
    assert yaml.safe_load((first / "config.yaml").read_text())["train"]["lr"] == 3e-3  # untouched
    r = run_train("experiment=ANDREA-tiny", *ov, "train.lr=2e-3", "exp=my-run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert yaml.safe_load((results / "my-run" / "config.yaml").read_text())["exp"] == "my-run"
    assert (results / "my-run" / "my-run.loss.json").is_file()


def test_run_names():
    from andrea.pipeline.runs import base_experiment, run_name
    assert run_name("ANDREA-tiny", []) == "ANDREA-tiny"
    assert run_name("ANDREA-tiny", ["train.seed=2", "train.lr=1e-3"]) == "ANDREA-tiny+train.lr=0.001,train.seed=2"
    # where things are, evaluation and proxy settings do not name a run; the backend does
    assert run_name("ANDREA-tiny", ["data.local_path=/a/b", "eval.batches=4", "data.dir=d",
                                    "proxy.max_restarts=1", "results_dir=/tmp/r"]) == "ANDREA-tiny"
    assert run_name("ANDREA-tiny", ["backend=cuda"]) == "ANDREA-tiny+backend=cuda"
    assert "/" not in run_name("ANDREA-tiny", ["data.source=local", "model.name=a/b"])
    assert run_name("mine", ["exp=mine", "train.lr=1"]) == "mine"
    assert run_name("mine", ["exp=mine", "train.lr=1"], sweep=True) == "mine+train.lr=1.0"
    long_a = run_name("E", [f"train.k{i}={i}" for i in range(40)])
    long_b = run_name("E", [f"train.k{i}={i}" for i in range(41)])
    assert len(long_a) < 200 and long_a.startswith("E+run-") and long_a != long_b
    assert base_experiment("ANDREA-tiny+train.lr=1e-3") == "ANDREA-tiny"


def test_compose_config_names_the_run():
    cfg = compose_config("ANDREA-tiny", ["train.lr=1e-3", "eval.batches=2"])
    assert cfg.exp == "ANDREA-tiny+train.lr=0.001" and cfg.overrides == ["train.lr=1e-3", "eval.batches=2"]


def test_backend_cuda_without_gpu_fails_at_once(tmp_path):
    from andrea.backends import cuda_available
    if cuda_available():
        pytest.skip("a GPU is here")
    r = run_train("experiment=ANDREA-tiny", "backend=cuda", f"results_dir={tmp_path}", timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "backend=cuda" in r.stderr and "no usable CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "ANDREA-tiny").exists()  # no empty run folder left behind


def test_help_without_experiment():
    r = run_train("--help")
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stderr
    assert "experiment=<EXP>" in r.stdout and "ANDREA-12M" in r.stdout
    r = run_train("experiment=ANDREA-tiny", "--help")
    assert r.returncode == 0 and "model: ANDREA-120M, ANDREA-12M, ANDREA-tiny" in r.stdout, r.stdout
    assert "schema" not in r.stdout.split("== Config ==")[0]
