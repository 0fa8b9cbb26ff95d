"""README commands that must work as written: `andrea import` of a GPT-2 folder next to a trained
run, and `andrea-train --help` telling how to see every key."""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import make_shards
from trained_model import make_run

REPO = Path(__file__).resolve().parent.parent


def readme_line(marker: str) -> list:
    """The README command line holding marker, as argv (its comment dropped, python -> this one)."""
    (line,) = [x for x in (REPO / "README.md").read_text().splitlines() if marker in x]
    argv = shlex.split(line, comments=True)
    return [sys.executable if a == "python" else a for a in argv]


def run(argv, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_readme_import_example_works_beside_the_trained_run(tmp_path):
    """As after `snakemake results/ANDREA-120M`: results/ANDREA-120M holds the trained run and its
    resolved train.yaml (here of a small model, and a small GPT-2 folder to match). The README's
    import line starts a run from the GPT-2 weights without touching the trained one."""
    pytest.importorskip("safetensors")
    from andrea.use.export import export

    mini = make_run(tmp_path / "model", steps=1)
    export(mini, "hf", tmp_path / "gpt2-folder")
    make_shards(tmp_path, vocab=300)
    trained = tmp_path / "results" / "ANDREA-120M"
    cfg = yaml.safe_load((mini / "config.yaml").read_text())
    cfg.update(exp="ANDREA-120M", results_dir="results")
    cfg["data"].update(train_shards=str(tmp_path / "shards" / "train_*.bin"),
                       val_shards=str(tmp_path / "shards" / "val_*.bin"))
    (trained / "resolved").mkdir(parents=True)
    (trained / "resolved" / "train.yaml").write_text(yaml.safe_dump(cfg))
    shutil.copytree(mini / "checkpoints", trained / "checkpoints")
    before = sorted((trained / "checkpoints").iterdir())

    argv = readme_line("andrea.cli import gpt2-folder")
    r = run(argv, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / argv[argv.index("--run-dir") + 1]
    assert (out / "checkpoints" / "step_00000000.bin").is_file() and out != trained
    assert sorted((trained / "checkpoints").iterdir()) == before


def test_train_help_says_how_to_see_every_key(tmp_path):
    h = run([sys.executable, "-m", "andrea.train", "--help"], tmp_path)
    assert h.returncode == 0 and "--cfg job" in h.stdout
    (hint,) = [x for x in h.stdout.splitlines() if x.startswith("Every key") and "--cfg job" in x]
    argv = hint.split(": ", 1)[1].split("  (", 1)[0].replace("<EXP>", "ANDREA-tiny").split()
    assert argv[:3] == ["python", "-m", "andrea.train"]
    keys = run([sys.executable, *argv[1:]], tmp_path)
    assert keys.returncode == 0, keys.stderr[-2000:]
    shown = yaml.safe_load(keys.stdout)
    assert shown["train"]["lr"] == 0.003 and shown["objective"] == "val_loss" and shown["proxy"]["trackers"] == []
    assert not (tmp_path / "results").exists()  # nothing ran
