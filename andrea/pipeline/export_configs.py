"""Every experiment's resolved config as JSON: experiments/<EXP>-TRAIN.json.

    python -m andrea.pipeline.export_configs                 # (re)write experiments/<EXP>-TRAIN.json for each
    python -m andrea.pipeline.export_configs --check         # exit 1 when a file is missing, stale or extra

Each file is exactly what `python -m andrea.train experiment=<EXP>` resolves (conf/, no
overrides): model, data, train, backend, eval and proxy settings, every default filled in. The
files are checked in, so the list of experiments and their settings can be read without Hydra;
tests/test_export_configs.py fails when one no longer matches conf/.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .compose import compose_config
from ..util.atomic import atomic_write
from ..config import to_dict
from ..paths import experiments

SUFFIX = "-TRAIN.json"


def file_name(exp: str) -> str:
    return f"{exp}{SUFFIX}"


def resolved(exp: str) -> dict:
    return to_dict(compose_config(exp))  # Hydra is imported when the first config is composed


def render(exp: str) -> str:
    return json.dumps(resolved(exp), indent=2, sort_keys=True) + "\n"


def stale(out_dir: Path) -> list:
    """Problems of out_dir against conf/: missing, stale or extra files (empty: all match)."""
    problems = []
    exps = experiments()
    for exp in exps:
        p = out_dir / file_name(exp)
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.read_text() != render(exp):
            problems.append(f"{p}: differs from conf/experiment/{exp}.yaml resolved")
    for p in sorted(out_dir.glob(f"*{SUFFIX}")):
        if p.name[: -len(SUFFIX)] not in exps:
            problems.append(f"{p}: no experiment {p.name[: -len(SUFFIX)]} in conf/experiment/")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("experiments"), help="folder of the JSON files")
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on any difference")
    a = ap.parse_args(argv)
    if a.check:
        problems = stale(a.out)
        for p in problems:
            print(f"export_configs: {p}", file=sys.stderr)
        if problems:
            print("export_configs: run `python -m andrea.pipeline.export_configs` and commit the files", file=sys.stderr)
        return 1 if problems else 0
    a.out.mkdir(parents=True, exist_ok=True)
    exps = experiments()
    for exp in exps:
        atomic_write(a.out / file_name(exp), render(exp))
    for p in a.out.glob(f"*{SUFFIX}"):
        if p.name[: -len(SUFFIX)] not in exps:
            p.unlink()
    print(f"export_configs: {len(exps)} experiments -> {a.out}/<EXP>{SUFFIX}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
