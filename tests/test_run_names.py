"""One config, one run folder: run names come from the overrides' parsed, typed values, so
`train.lr=3e-3` on the command line and a sweep's `train.lr=0.003` train the same run."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from andrea.paths import CONF_DIR
from andrea.pipeline.compose import compose_config
from andrea.pipeline.runs import normalised, run_name


@pytest.mark.parametrize("a, b", [
    ("train.lr=3e-3", "train.lr=0.003"),
    ("train.lr=3E-3", "train.lr=.003"),
    ("train.lr=1", "train.lr=1.0"),  # a float field: the int is that float
    ("+train.lr=1e-3", "train.lr=0.001"),
    ("data.mixer.alpha=1", "data.mixer.alpha=1.0"),
])
def test_same_value_same_name(a, b):
    assert run_name("ANDREA-tiny", [a]) == run_name("ANDREA-tiny", [b])


def test_different_values_and_kinds_stay_apart():
    assert run_name("E", ["train.lr=3e-3"]) != run_name("E", ["train.lr=3e-4"])
    assert normalised("train.seed=2") == "train.seed=2"  # an int field keeps its int
    assert normalised("model=ANDREA-12M") == "model=ANDREA-12M"
    assert normalised("train.lr=1e-3,3e-3") == "train.lr=1e-3,3e-3"  # a sweep: each job is named by its value
    assert run_name("E", ["train.seed=2", "train.lr=1e-3"]) == "E+train.lr=0.001,train.seed=2"


def hydra_run_dir(overrides, mode):
    """The folder Hydra gives a run (mode run) or a sweep's job (mode sweep) with these overrides."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["experiment=ANDREA-tiny", *overrides],
                          return_hydra_config=True)
            h = cfg.hydra
            if mode == "run":
                return Path(OmegaConf.select(h, "run.dir")).name
            return (Path(OmegaConf.select(h, "sweep.dir")) / OmegaConf.select(h, "sweep.subdir")).resolve().name
    finally:
        GlobalHydra.instance().clear()


def test_command_line_sweep_and_workflow_agree():
    """`train.lr=3e-3` given once, the job `train.lr=0.003` of a sweep (`train.lr=0.003,0.001`
    -> Hydra gives each job its value) and the workflow's name are one folder."""
    one = hydra_run_dir(["train.lr=3e-3"], "run")
    job = hydra_run_dir(["train.lr=0.003"], "sweep")
    assert one == job == compose_config("ANDREA-tiny", ["train.lr=3e-3"]).exp == "ANDREA-tiny+train.lr=0.003"


def test_a_folder_named_by_the_typed_values_is_pointed_out(tmp_path, capsys):
    """A run made before names were normalised lives in +train.lr=1e-3; the same overrides now name
    +train.lr=0.001: andrea.train says so in one line instead of training again in silence, and
    says nothing once the new folder exists or when the names agree."""
    from types import SimpleNamespace

    from andrea.train import said_typed_folder

    cfg = SimpleNamespace(overrides=["train.lr=1e-3", "data.dir=/d"])
    new = tmp_path / "ANDREA-tiny+train.lr=0.001"
    said_typed_folder(new, cfg)
    assert capsys.readouterr().err == ""  # no old folder
    (tmp_path / "ANDREA-tiny+train.lr=1e-3").mkdir()
    said_typed_folder(new, cfg)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ANDREA-tiny+train.lr=1e-3 holds a run" in err and str(new) in err
    new.mkdir()
    said_typed_folder(new, cfg)
    assert capsys.readouterr().err == ""
    said_typed_folder(tmp_path / "ANDREA-tiny+train.lr=0.002", SimpleNamespace(overrides=["train.lr=0.002"]))
    assert capsys.readouterr().err == ""
