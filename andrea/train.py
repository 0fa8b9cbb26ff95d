"""Train one experiment: Hydra composes the config, the proxy supervises the engine.

    python -m andrea.train experiment=ANDREA-tiny                      # one run -> results/ANDREA-tiny/
    python -m andrea.train experiment=ANDREA-tiny train.lr=1e-3        # any field can be overridden
    python -m andrea.train -m experiment=ANDREA-tiny train.lr=1e-3,3e-3
        # a sweep: one run per combination, each in results/ANDREA-tiny/sweep/<overrides>/,
        # e.g. results/ANDREA-tiny/sweep/train.lr=0.001/ (path-like overrides are left out of
        # the name; an over-long name becomes run<N>-<hash>)

The config comes from conf/ (config.yaml, one option per group, conf/experiment/<EXP>.yaml), typed
by the dataclasses of andrea/config.py: an unknown key, a wrong type or a missing experiment stops
before anything runs, with Hydra's message naming the key. The resolved config is written to
`<run folder>/config.yaml`, then `andrea.proxy.supervise` runs the engine on it. The exit status is
the proxy's (andrea/protocol.py): 0 finished or stopped, 3 aborted (non-finite steps), 1 failed, 2
bad config, a run folder that belongs to another config, or a corrupt record file.

A run folder whose newest checkpoint was written with the same model and training settings
resumes from it; one written with other settings is refused (move it away to start afresh), so an
override never silently continues another run's weights.
"""
from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .atomic import atomic_write
# composing also registers the config schemas that hydra.main below needs
from .compose import ConfigError, compose_config, resolve  # noqa: F401 (compose_config: public here too)
from .config import AndreaConfig, config_hash
from .paths import CONF_DIR
from .protocol import EXIT_BAD_INPUT

MAX_TAG = 200  # sweep folder names stay under the usual 255-byte file-name limit


def sweep_tag(override_dirname: str, num) -> str:
    """A sweep run's folder name: its overrides (train.lr=0.001,train.seed=2) made path-safe;
    an empty or very long one becomes the job number plus a short hash, so names stay unique."""
    tag = re.sub(r"[^A-Za-z0-9._=,+-]", "_", str(override_dirname))
    if not tag or len(tag) > MAX_TAG:
        digest = hashlib.sha256(str(override_dirname).encode()).hexdigest()[:10]
        tag = f"run{num}-{digest}" if tag else f"run{num}"
    return tag


# conf/config.yaml names sweep folders with it: ${andrea_sweep_tag:${hydra.job.override_dirname},...}
OmegaConf.register_new_resolver("andrea_sweep_tag", sweep_tag, replace=True)


def write_config(path: Path, cfg: AndreaConfig) -> None:
    """The resolved config as YAML at path, atomically (the engine and archive read it)."""
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    atomic_write(path, text)


def check_run_folder(cfg: AndreaConfig, run_dir: Path) -> None:
    """Refuse a run folder whose newest checkpoint belongs to other model/training settings."""
    from .checkpoint import latest_checkpoint, read_sidecar

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return
    theirs, ours = read_sidecar(ckpt).get("config_hash"), config_hash(cfg)
    if theirs != ours:
        raise ConfigError(
            f"{ckpt} was written with other model/training settings (config_hash {str(theirs)[:12]}… but "
            f"this config gives {ours[:12]}…). Resuming would continue another run. Move "
            f"{run_dir / 'checkpoints'} away (or delete it) to start afresh, or restore the old settings "
            f"(see {run_dir / 'config.yaml'}) to resume it.")


def run_folder() -> Path:
    """hydra.run.dir for one run, hydra.sweep.dir/subdir for each run of a sweep (conf/config.yaml)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def train(cfg: DictConfig) -> int:
    try:
        run_cfg = resolve(cfg)
        run_dir = run_folder()
        check_run_folder(run_cfg, run_dir)
    except (ConfigError, ValueError) as e:
        print(f"andrea.train: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    write_config(run_dir / "config.yaml", run_cfg)
    print(f"andrea.train: {run_cfg.exp} -> {run_dir} (config_hash {config_hash(run_cfg)[:12]})", file=sys.stderr)
    from .proxy import RecordError, supervise  # imported late: composing a config must not need the engine

    try:
        return supervise(run_cfg, run_dir)
    except (RecordError, RuntimeError) as e:  # a corrupt record file, or another proxy on this run
        print(f"andrea.train: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    code = train(cfg)
    if code:
        sys.exit(code)  # in a sweep this stops the sweep: later runs would likely fail the same way


if __name__ == "__main__":
    main()
