"""experiments/<EXP>-TRAIN.json: one per experiment, each the resolved config of conf/."""
import json
import shutil
from pathlib import Path

from andrea.pipeline import export_configs
from andrea.config import to_dict
from andrea.paths import experiments
from andrea.train import compose_config

OUT = Path(__file__).resolve().parent.parent / "experiments"


def test_checked_in_files_match_conf():
    assert export_configs.stale(OUT) == [], "run: python -m andrea.pipeline.export_configs"
    names = sorted(p.name for p in OUT.glob("*-TRAIN.json"))
    assert names == sorted(f"{e}-TRAIN.json" for e in experiments())


def test_each_file_is_the_resolved_config():
    for exp in experiments():
        assert json.loads((OUT / f"{exp}-TRAIN.json").read_text()) == to_dict(compose_config(exp))


def test_check_finds_stale_missing_and_extra(tmp_path):
    shutil.copytree(OUT, tmp_path, dirs_exist_ok=True)
    d = json.loads((tmp_path / "ANDREA-tiny-TRAIN.json").read_text())
    d["train"]["lr"] *= 2
    (tmp_path / "ANDREA-tiny-TRAIN.json").write_text(json.dumps(d))
    (tmp_path / "ANDREA-12M-TRAIN.json").unlink()
    (tmp_path / "ANDREA-gone-TRAIN.json").write_text("{}")
    problems = "\n".join(export_configs.stale(tmp_path))
    assert "ANDREA-tiny-TRAIN.json: differs" in problems and "ANDREA-12M-TRAIN.json: missing" in problems
    assert "no experiment ANDREA-gone" in problems
    assert export_configs.main(["--check", "--out", str(tmp_path)]) == 1
    assert export_configs.main(["--out", str(tmp_path)]) == 0
    assert export_configs.stale(tmp_path) == []
