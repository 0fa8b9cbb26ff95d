"""Bad settings are refused at start with the field and what was expected: every numeric setting
is range-checked, and Hydra's own errors (unknown key, wrong type, `+key=`) exit 2 with one line
and no traceback, before anything is written."""
import subprocess
import sys

import pytest

from andrea.train import ConfigError, compose_config
from relkit import REPO, env

BAD_VALUES = [
    ("train.lr=nan", "train.lr"), ("train.lr=-0.001", "train.lr"), ("train.lr=inf", "train.lr"),
    ("train.lr=0", "train.lr"), ("train.min_lr=-1", "train.min_lr"), ("train.min_lr=nan", "train.min_lr"),
    ("train.eval_batches=0", "train.eval_batches"), ("train.batch_size=0", "train.batch_size"),
    ("train.steps=-5", "train.steps"), ("train.grad_accum=0", "train.grad_accum"),
    ("train.warmup_steps=-1", "train.warmup_steps"), ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.beta1=1.0", "train.beta1"), ("train.beta2=nan", "train.beta2"), ("train.eps=0", "train.eps"),
    ("train.grad_clip=-1", "train.grad_clip"), ("train.grad_clip=inf", "train.grad_clip"),
    ("train.init_std=0", "train.init_std"), ("train.ckpt_every=-1", "train.ckpt_every"),
    ("train.keep_last=0", "train.keep_last"), ("train.log_every=0", "train.log_every"),
    ("train.max_bad_steps=0", "train.max_bad_steps"), ("train.loss_scale=nan", "train.loss_scale"),
    ("train.seed=-1", "train.seed"), ("train.sample_every=-1", "train.sample_every"),
    ("model.n_layer=0", "model.n_layer"), ("model.vocab_size=1", "model.vocab_size"),
    ("model.vocab_size=70000", "model.vocab_size"), ("data.val_fraction=1.0", "data.val_fraction"),
    ("data.val_fraction=nan", "data.val_fraction"), ("data.n_synthetic=0", "data.n_synthetic"),
    ("eval.temperature=nan", "eval.temperature"), ("eval.batches=0", "eval.batches"),
    ("proxy.max_restarts=-1", "proxy.max_restarts"), ("proxy.restart_backoff_s=nan", "proxy.restart_backoff_s"),
    ("proxy.record_flush_s=-1", "proxy.record_flush_s"),
    ("+train.phases=[{name: polish, start_step: 5000}]", "train.phases[0].start_step"),
    ("+train.phases=[{name: polish, start_step: 100, lr: nan}]", "train.phases[0].lr"),
]


@pytest.mark.parametrize("override,field", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_every_numeric_setting_is_range_checked(override, field):
    with pytest.raises(ConfigError) as e:
        compose_config("ANDREA-tiny", [override])
    msg = str(e.value)
    assert f"{field}=" in msg and "expected" in msg, msg


def test_the_shipped_experiments_pass():
    for exp in ("ANDREA-tiny", "ANDREA-12M", "ANDREA-120M"):
        compose_config(exp)


def test_eval_batches_zero_is_fine_without_validation():
    cfg = compose_config("ANDREA-tiny", ["train.eval_every=0", "train.eval_batches=0"])
    assert cfg.train.eval_batches == 0


HYDRA_ERRORS = [
    ("train.lrr=1", "lrr"),  # unknown key
    ("train.lr=abc", "train.lr"),  # wrong type
    ("+train.lrr=1", "lrr"),  # an appended key that is no field (used to print a traceback)
    ("experiment=nope", "experiment/nope"),  # a missing experiment
    ("train.lr=nan", "train.lr"),  # a value out of range
]


@pytest.mark.parametrize("override,named", HYDRA_ERRORS, ids=[h[0] for h in HYDRA_ERRORS])
def test_train_cli_config_error_is_exit_2_and_one_line(tmp_path, override, named):
    args = ["experiment=ANDREA-tiny", f"results_dir={tmp_path}", override]
    r = subprocess.run([sys.executable, "-m", "andrea.train", *args], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("andrea.train: config error:") and named in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written
