"""An experiment's config composed by Hydra outside a Hydra run (the workflow, tests, evaluation).

compose_config gives the same typed AndreaConfig as `python -m andrea.train experiment=<EXP>`:
the package's conf/ (andrea/paths.py), the experiment, then the overrides; errors become a
ConfigError whose message names the key or the file. The config's exp is the run's name
(andrea/pipeline/runs.py: the experiment, + the overrides that change what is trained) and `overrides`
lists the overrides; conf/config.yaml names run folders with the same function, through the
andrea_run_name resolver registered here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from . import runs
from ..config import AndreaConfig, load_run_config, register_configs
from ..paths import CONF_DIR

register_configs()


def _run_name_resolver(exp, overrides, mode) -> str:
    return runs.run_name(str(exp), [str(o) for o in (overrides or [])], sweep=str(mode) == "sweep")


# conf/config.yaml: hydra.run.dir is ${results_dir}/${andrea_run_name:${exp},${hydra.overrides.task},run}
OmegaConf.register_new_resolver("andrea_run_name", _run_name_resolver, replace=True)


def recorded_overrides(overrides) -> list:
    """The overrides a run keeps in its config (`overrides`): all but experiment= and exp=."""
    return [str(o) for o in overrides if runs.override_key(o) not in ("experiment", "exp")]


class ConfigError(ValueError):
    """A config that does not compose or validate; the message names the key or the file."""


def resolve(cfg: DictConfig) -> AndreaConfig:
    """The typed, validated AndreaConfig of a composed Hydra config (its hydra node dropped)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        data.pop("hydra", None)
        return load_run_config(data)
    except OmegaConfBaseException as e:  # e.g. +train.lrr=1: composes, but is no field of the schema
        raise ConfigError(one_line(e)) from e


def compose_config(exp: str, overrides: Iterable[str] = (), conf_dir: Optional[Path] = None) -> AndreaConfig:
    """The resolved config of experiment exp with Hydra overrides, outside of a Hydra run.

    Used by the workflow and the tests; gives the same config as `python -m andrea.train`.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    conf_dir = Path(conf_dir or CONF_DIR).resolve()
    given = [str(o) for o in overrides]
    overrides = [f"experiment={exp}", *given]
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            cfg = resolve(compose(config_name="config", overrides=overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"config {conf_dir}/config.yaml with overrides {overrides}: {_explain(e)}") from e
    cfg.exp = runs.run_name(cfg.exp, given)
    cfg.overrides = recorded_overrides(given)
    return cfg


def _explain(e: BaseException) -> str:
    """The message of e and of its causes: Hydra puts the key's name in the cause, OmegaConf in
    the exception it was handling. Only config errors are followed that way: an exception that
    merely happened to be handled when the config was composed (a caller's KeyError, as in
    Snakemake's input functions) says nothing about the config."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    parts = []
    while e is not None and len(parts) < 4:
        msg = str(e).strip()
        if msg and msg not in parts:
            parts.append(msg)
        ctx = e.__context__
        e = e.__cause__ or (ctx if isinstance(ctx, (HydraException, OmegaConfBaseException, ValueError))
                            and not isinstance(ctx, ConfigError) else None)
    return "\n".join(parts)


NOISE = ("reference_type", "object_type", "provider=", "Config search path", "full_key")


def one_line(e: BaseException) -> str:
    """_explain(e) on one line for a terminal message: each distinct line once, OmegaConf's
    internals (types, search path, templates) left out."""
    seen = []
    for line in _explain(e).splitlines():
        line = line.strip().rstrip(";")
        if line and line not in seen and not line.startswith(NOISE) and "$VALUE" not in line:
            seen.append(line)
    return "; ".join(seen)
