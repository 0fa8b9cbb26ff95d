"""What more than one benchmark reads: the model shape of an experiment."""
from __future__ import annotations


def model_dict(exp: str) -> dict:
    """conf/model/<exp>.yaml as a dict (the benchmarks' model shapes); a missing one exits."""
    from omegaconf import OmegaConf

    from ..paths import model_config
    path = model_config(exp)
    if not path.is_file():
        raise SystemExit(f"--exp {exp}: no model config {path}")
    return OmegaConf.to_container(OmegaConf.load(path))
