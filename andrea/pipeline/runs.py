"""Run names: which folder a run with command-line overrides lives in.

A run of an experiment with its pinned config lives in `results/<EXP>/`. A run with overrides that
change what is trained lives beside it in `results/<EXP>+<overrides>/`, the overrides sorted and
joined with commas as Hydra's multirun names its jobs (`results/ANDREA-tiny+train.lr=0.001/`), so
an override never continues or overwrites the pinned run. Each override is named by its value as
parsed and typed (`normalised`): `train.lr=1e-3`, `train.lr=0.001`, `train.lr=.001` and a sweep's
`train.lr=0.001` are one run, `results/ANDREA-tiny+train.lr=0.001/`, and so are `train.lr=1` and
`train.lr=1.0` (a float field). The name is also the run's `exp`: its
records are `<name>.loss.json` and so on. `exp=NAME` on the command line names the run yourself.

Overrides of where things are (data paths, results_dir), of the training proxy and of evaluation
settings do not name a run: they do not change the weights. The backend does name a run (a run on
another backend is another run, and a failing one must not replace the pinned run's checkpoints)
but is no reason not to compare with the published run; evaluation overrides are
(`compared_overrides`).

`python -m andrea.train`, its sweeps (`-m`) and the Snakemake workflow all name runs here.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import typing
from typing import Iterable, List

MAX_NAME = 200  # run folder names stay under the usual 255-byte file-name limit
SEP = "+"  # between the experiment and its overrides
# where things are, not what is trained
PLACE_KEYS = ("experiment", "exp", "results_dir", "data.dir", "data.tokenizer", "data.train_shards",
              "data.val_shards", "data.local_path", "eval.task_data")
# where it runs: names a run, but the published comparison still applies (same numbers up to rounding)
BACKEND_KEYS = ("backend", "backend.name", "backend.device")
# sections that never change the weights (objective: what a sweep's task returns)
NON_TRAINING = ("eval", "proxy", "hydra", "objective")


def override_key(override: str) -> str:
    """The dotted key of a Hydra override: `+train.lr=1` -> train.lr, `~eval` -> eval."""
    key = str(override).lstrip("+~").split("=", 1)[0]
    return key.split("@", 1)[0].strip()


def _section(key: str) -> str:
    return key.split(".", 1)[0]


@functools.lru_cache(maxsize=None)
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _field_type(key: str):
    """The annotated type of a dotted key of the config schema (andrea/config.py), None where the
    key is no field (a config group such as model=, a list element, an unknown key)."""
    from ..config import AndreaConfig

    cls, hint = AndreaConfig, None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        hint = typing.get_type_hints(cls).get(part)
        if hint is None:
            return None
        cls = hint
    return hint


def _as_field(key: str, value):
    """value as the schema stores it: an integer given for a float field is that float."""
    hint = _field_type(key)
    if hint is float or hint == typing.Optional[float]:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
    return value


def normalised(override: str) -> str:
    """An override written as its parsed, typed value (`train.lr=3e-3` and `train.lr=0.003` ->
    `train.lr=0.003`; `+train.lr=1` -> `train.lr=1.0`), so one config gets one name. A sweep
    (`a=1,2`, `interval(...)`), a deletion or what does not parse stays as written."""
    try:
        o = _parser().parse_override(str(override))
    except Exception:  # noqa: BLE001 (Hydra reports it when the run composes)
        return str(override)
    if o.is_sweep_override() or o.is_delete():
        return str(override)
    key = o.key_or_group + (f"@{o.package}" if o.package else "")
    value = _as_field(o.key_or_group, o.value())
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, int):
        text = str(value)
    else:
        text = o.get_value_element_as_str()
    return f"{key}={text}"


def naming_overrides(overrides: Iterable[str]) -> List[str]:
    """The overrides that change what is trained, normalised and sorted: they name the run."""
    return sorted(normalised(o) for o in overrides
                  if override_key(o) not in PLACE_KEYS and _section(override_key(o)) not in NON_TRAINING)


def compared_overrides(overrides: Iterable[str]) -> List[str]:
    """The overrides that make a result differ from the published one's config (training or eval)."""
    return sorted(str(o) for o in overrides if override_key(o) not in PLACE_KEYS + BACKEND_KEYS
                  and _section(override_key(o)) not in ("proxy", "hydra", "objective"))


def training_overrides(overrides: Iterable[str]) -> List[str]:
    """All overrides but evaluation ones, in their order: what the train step is given."""
    return [str(o) for o in overrides if _section(override_key(o)) != "eval"]


def names_itself(overrides: Iterable[str]) -> bool:
    """True when the overrides set exp=NAME: the run is then called NAME, nothing appended."""
    return any(override_key(o) == "exp" for o in overrides)


def tag(overrides: Iterable[str], normalise: bool = True) -> str:
    """The naming overrides made path-safe (`train.lr=0.001,train.seed=2`); "" when there are none;
    a very long one becomes `run-<hash>`, so names stay unique and short. normalise=False: the
    values as typed, the names runs had before values were normalised (`train.lr=1e-3`)."""
    named = naming_overrides(overrides) if normalise else sorted(
        str(o) for o in overrides if override_key(o) not in PLACE_KEYS and _section(override_key(o)) not in NON_TRAINING)
    joined = ",".join(named)
    safe = re.sub(r"[^A-Za-z0-9._=,+-]", "_", joined)
    if len(safe) > MAX_NAME - 40:
        safe = "run-" + hashlib.sha256(joined.encode()).hexdigest()[:12]
    return safe


def run_name(exp: str, overrides: Iterable[str] = (), sweep: bool = False) -> str:
    """The run folder's name (= the run's exp) of experiment exp with these overrides.

    exp is the config's exp: the experiment's own name, or the NAME of an exp=NAME override, which
    stands as given for one run; in a sweep the job's other overrides are appended to it as well,
    so each job keeps its own folder.
    """
    overrides = [str(o) for o in overrides]
    if names_itself(overrides) and not sweep:
        return str(exp)
    t = tag(overrides)
    return f"{exp}{SEP}{t}" if t else str(exp)


def typed_name(exp: str, overrides: Iterable[str] = ()) -> str:
    """run_name with the override values as typed: the folder such a run had before run names were
    normalised. Where it differs and exists, andrea.train says so (the same config, another folder)."""
    overrides = [str(o) for o in overrides]
    if names_itself(overrides):
        return str(exp)
    t = tag(overrides, normalise=False)
    return f"{exp}{SEP}{t}" if t else str(exp)


def base_experiment(name: str) -> str:
    """The experiment a run name starts with (`ANDREA-tiny+train.lr=0.001` -> ANDREA-tiny)."""
    return str(name).split(SEP, 1)[0]
