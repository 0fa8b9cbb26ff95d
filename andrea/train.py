"""Train one experiment: Hydra composes the config, the proxy supervises the engine.

    python -m andrea.train experiment=ANDREA-tiny                # one run -> results/ANDREA-tiny/
    python -m andrea.train experiment=ANDREA-tiny train.lr=1e-3  # -> results/ANDREA-tiny+train.lr=0.001/
    python -m andrea.train experiment=ANDREA-tiny train.lr=1e-3 exp=tiny-lr   # -> results/tiny-lr/
    python -m andrea.train -m experiment=ANDREA-tiny train.lr=1e-3,3e-3
        # a sweep: one run per combination, results/ANDREA-tiny+train.lr=0.001/ and so on
    python -m andrea.train -m experiment=ANDREA-tiny hydra/sweeper=optuna hydra.sweeper.n_trials=8 \
        'train.lr=interval(0.001,0.01)'   # a sweeper that optimises (pip install hydra-optuna-sweeper)
    python -m andrea.train experiment=ANDREA-tiny --cfg job      # every key and its value, nothing run

A sweep's task returns the run's objective (config `objective`: the last validation loss by
default, or the last value of another field of the loss history), which Optuna, Nevergrad and Ax
sweepers minimise (or maximise: hydra.sweeper.direction=maximize). Each sweep keeps its
multirun.yaml (and a sweeper's optimization_results.yaml) in results/sweeps/<time>/; its runs
are results/<run name>/ as always.

Data parallelism (docs/DISTRIBUTED.md): each of N ranks trains on its part of every step's
microbatches (train.grad_accum must be a multiple of N), rank 0 keeps the records and checkpoints:
    python -m andrea.train --ranks 2 experiment=ANDREA-120M train.grad_accum=2   # this host
    mpirun -n 2 python -m andrea.train experiment=ANDREA-120M train.grad_accum=2 # or srun, a cluster
With --zero1 (first arguments, as --ranks) each rank keeps the Adam moments of its shard of the
weights only (ZeRO-1); it is not part of the config, so a run resumes with or without it:
    python -m andrea.train --ranks 2 --zero1 experiment=ANDREA-120M train.grad_accum=2

A run with overrides gets its own folder, named after them (andrea/pipeline/runs.py says which overrides
name a run: data paths, proxy and eval settings do not); that name is also its `exp`.

The config comes from conf/ (config.yaml, one option per group, conf/experiment/<EXP>.yaml), typed
by the dataclasses of andrea/config.py: an unknown key, a wrong type or a missing experiment stops
before anything runs, with Hydra's message naming the key. The resolved config is written to
`<run folder>/config.yaml`, then `andrea.run.proxy.supervise` runs the engine on it. Exit status
(andrea/run/protocol.py): 0
only when the run finished (then `<run folder>/trained/` holds final.bin and final.json, links to
the final checkpoint and its sidecar, the completed `<exp>.loss.json` and `config.yaml`); 75 when
it stopped before its last step (SIGTERM, Ctrl-C, a preemption: the same command resumes it); 3
aborted (non-finite steps); 1 failed; 2 bad config (one line on stderr, no traceback) or a run
folder that belongs to another config or holds only damaged checkpoints; 4 a checkpoint did not
fit on the disk. The run folder's lock is taken before anything in it is read or written, so a
refused second command changes nothing.

A run folder whose newest checkpoint was written with the same model and training settings
resumes from it; one written with other settings is refused (move it away to start afresh), so an
override never silently continues another run's weights. With `--new-run-on-change` (first
argument; the workflow passes it) that run is moved to `<run folder>/previous/<hash>-<time>/`
instead, never deleted, and this one starts afresh.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from .pipeline import runs
from .util.atomic import atomic_write
# composing also registers the config schemas that hydra.main below needs
from .core.comm import ZERO1_ENV, launch_rank
from .pipeline.compose import ConfigError, compose_config, one_line, recorded_overrides, resolve  # noqa: F401 (compose_config: public here too)
from .config import AndreaConfig, config_hash
from .data.sizing import check_shards
from .paths import CONF_DIR
from .run.protocol import EXIT_BAD_INPUT, EXIT_STOPPED

TRAINED_DIR = "trained"  # what a finished run produces (the workflow's train outputs)
NEW_RUN_FLAG = "--new-run-on-change"
NEW_RUN_ON_CHANGE = False  # set by NEW_RUN_FLAG (the workflow passes it)
RANKS_FLAG = "--ranks"  # data parallelism on this host: python -m andrea.train --ranks N ... (andrea/run/launch.py)
ZERO1_FLAG = "--zero1"  # ZeRO-1: sets comm.ZERO1_ENV for the engine (every rank runs the same command)
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


def check_run_folder(cfg: AndreaConfig, run_dir: Path, new_run_on_change: bool = False) -> None:
    """Refuse a run folder whose newest checkpoint belongs to other model/training settings; with
    new_run_on_change, move that run aside (set_aside) instead, so this one starts afresh."""
    from .core.checkpoint import latest_checkpoint, read_sidecar

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return
    theirs, ours = read_sidecar(ckpt).get("config_hash"), config_hash(cfg)
    if theirs != ours and new_run_on_change:
        dest = set_aside(cfg, run_dir, str(theirs))
        print(f"andrea.train: {ckpt.name} was written with other model/training settings (config_hash "
              f"{str(theirs)[:12]}…); that run was moved to {dest} and this one starts afresh", file=sys.stderr)
    elif theirs != ours:
        raise ConfigError(
            f"{ckpt} was written with other model/training settings (config_hash {str(theirs)[:12]}… but "
            f"this config gives {ours[:12]}…). Resuming would continue another run. Move that one "
            f"checkpoint ({ckpt} and its sidecar {ckpt.with_suffix('.json').name}) out of the folder, "
            f"or pass --new-run-on-change to set the old run aside, or restore the old settings "
            f"(see {run_dir / 'config.yaml'}) to resume it.")


def set_aside(cfg: AndreaConfig, run_dir: Path, their_hash: str) -> Path:
    """Move a previous run's checkpoints and records to <run>/previous/<hash>-<time>/ (renames in
    the same folder: nothing is copied, nothing deleted)."""
    from .run.proxy.aside import set_aside as move_aside
    from .run.proxy.records import record_names

    return move_aside(run_dir, ("checkpoints", "archive", TRAINED_DIR, "config.yaml", *record_names(cfg.exp)),
                      their_hash[:12])


def publish_trained(cfg: AndreaConfig, run_dir: Path, final: Path) -> Path:
    """<run>/trained/: what a finished run produces, the workflow's train outputs: final.bin and
    final.json (hard links to the final checkpoint and its sidecar, copies where links cannot be
    made), <exp>.loss.json (the completed history), <exp>.state.json and config.yaml. Assembled under a temporary
    name and renamed, so it is complete or absent; resume state never lives there."""
    import shutil

    from .util.atomic import atomic_copy
    from .core.checkpoint import sidecar_path

    out = run_dir / TRAINED_DIR
    tmp = run_dir / f".{TRAINED_DIR}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for src, name in ((final, "final.bin"), (sidecar_path(final), "final.json")):
            try:
                os.link(src, tmp / name)
            except OSError:
                atomic_copy(src, tmp / name)
        for name in (f"{cfg.exp}.loss.json", "config.yaml"):
            atomic_copy(run_dir / name, tmp / name)
        if (run_dir / f"{cfg.exp}.state.json").is_file():  # the run's state: its memory plan, restarts
            atomic_copy(run_dir / f"{cfg.exp}.state.json", tmp / f"{cfg.exp}.state.json")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def in_sweep() -> bool:
    """True in a job of a sweep (-m), whose task returns the objective."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def sweeper_optimises() -> bool:
    """True in a job of a sweep whose sweeper uses the objective (Optuna, Nevergrad, Ax: any but
    Hydra's basic grid sweeper, which ignores it)."""
    from hydra.core.hydra_config import HydraConfig

    return in_sweep() and not str(HydraConfig.get().sweeper.get("_target_", "")).endswith(".BasicSweeper")


def run_folder() -> Path:
    """hydra.run.dir for one run, hydra.sweep.dir/subdir for each run of a sweep (conf/config.yaml)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def check_backend(cfg: AndreaConfig) -> None:
    """A run that needs a GPU fails now, not after the engine's restarts: one line, exit 2."""
    if cfg.backend.name == "numpy":
        if cfg.train.precision != "fp32":
            raise ConfigError(f"train.precision={cfg.train.precision} needs backend=cuda; the NumPy engine runs fp32")
        return
    from .backends import cuda_available

    if cuda_available():
        return
    if cfg.backend.name == "cuda":
        raise ConfigError("backend=cuda but no usable CUDA GPU here (CuPy missing or no device); "
                          "use backend=auto or backend=numpy, or install the cuda12/cuda13 extra on a GPU machine")
    if cfg.train.precision != "fp32":
        raise ConfigError(f"train.precision={cfg.train.precision} needs backend=cuda and there is no usable "
                          "CUDA GPU here; the NumPy engine runs train.precision=fp32")


def _remove_if_empty(d: Path) -> None:
    """Hydra makes the run folder before the job starts; a refused run leaves none behind."""
    try:
        d.rmdir()
    except OSError:  # not empty (a run that was there before), or already gone
        pass


def said_typed_folder(run_dir: Path, run_cfg) -> None:
    """One line when this run's folder is new but a folder named by the overrides as typed exists
    (runs made before run names were normalised: +train.lr=1e-3 is now +train.lr=0.001), so the
    same config does not train again in silence."""
    from .pipeline.runs import base_experiment, typed_name

    old = run_dir.parent / typed_name(base_experiment(run_dir.name), run_cfg.overrides)
    if old != run_dir and old.is_dir() and not run_dir.exists():
        print(f"andrea.train: note: {old} holds a run of these overrides under their typed values; this run "
              f"is {run_dir} (run names use normalised values now: rename the folder to {run_dir.name} "
              "to resume it instead)", file=sys.stderr)


def train(cfg: DictConfig) -> int:
    """Lock, check and prepare the run folder, supervise the run; returns the exit status."""
    try:
        from hydra.core.hydra_config import HydraConfig

        run_cfg = resolve(cfg)
        run_dir = run_folder()
        run_cfg.exp = run_dir.name  # the run's name: its folder (see andrea/pipeline/runs.py)
        run_cfg.overrides = recorded_overrides(HydraConfig.get().overrides.task)
        check_backend(run_cfg)
        # too few windows for one batch: stop and say which setting; fewer than a step's or a
        # validation's worth: say so and go on (the loader re-reads windows)
        check_shards(run_cfg, warn=lambda msg: print(f"andrea.train: warning: {msg}", file=sys.stderr))
        if sweeper_optimises() and run_cfg.objective == "val_loss" and not run_cfg.train.eval_every:
            raise ConfigError("objective=val_loss (what this sweep's task returns) needs train.eval_every > 0; "
                              "set train.eval_every, or objective=loss")
    except (ConfigError, ValueError) as e:
        print(f"andrea.train: {e}", file=sys.stderr)
        _remove_if_empty(run_folder())
        return EXIT_BAD_INPUT
    rank, size = launch_rank()
    if rank > 0:
        return follow(run_cfg, run_dir)
    from .core.checkpoint import CheckpointError
    from .util.lock import LockHeld, run_lock
    from .run.proxy import RecordError, refuse_unusable_checkpoints, supervise  # late: composing needs no engine

    said_typed_folder(run_dir, run_cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        # the proxy's lock first: a refused second command must not touch a live run's folder
        with run_lock(run_dir, "proxy"):
            refuse_unusable_checkpoints(run_dir)
            check_run_folder(run_cfg, run_dir, NEW_RUN_ON_CHANGE)
            write_config(run_dir / "config.yaml", run_cfg)
            ov = " ".join(run_cfg.overrides) or "none"
            print(f"andrea.train: {run_cfg.exp} -> {run_dir} (config_hash {config_hash(run_cfg)[:12]}, "
                  f"overrides: {ov})\nandrea.train: watch it live: python -m andrea.pipeline.dashboard {run_dir}",
                  file=sys.stderr)
            if size > 1:
                print(f"andrea.train: data parallel over {size} ranks; this is rank 0, which keeps the "
                      "records and checkpoints", file=sys.stderr)
            # several ranks: an engine that crashed cannot rejoin its MPI world, so the proxy does not
            # restart it; its exit ends the launch (every rank), and the same command resumes the run
            rc = supervise(run_cfg, run_dir, max_restarts=0 if size > 1 else None)
            return finish(run_cfg, run_dir, rc)
    except (ConfigError, RecordError, CheckpointError, LockHeld) as e:  # bad config, records or checkpoints
        print(f"andrea.train: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def follow(cfg: AndreaConfig, run_dir: Path) -> int:
    """Rank r > 0 of a data-parallel launch (docs/DISTRIBUTED.md): the engine runs in this process,
    on the config this rank composed (checked against rank 0's), and writes nothing; rank 0's
    proxy keeps the records. 0 when the run finished or stopped (rank 0 says which), else the
    engine's exit code, which ends the launch."""
    from .cli import run_engine

    return run_engine(cfg, run_dir, resume=True)


def objective(run_dir: Path, name: str = "val_loss") -> float:
    """The run's objective for a sweeper: the last value of field `name` in the finished run's
    history (<run>/trained/<exp>.loss.json). ConfigError when the history has none (objective=
    val_loss with train.eval_every=0)."""
    import json

    path = run_dir / TRAINED_DIR / f"{run_dir.name}.loss.json"
    history = json.loads(path.read_text())["history"]
    values = [r[name] for r in history if isinstance(r.get(name), (int, float))]
    if not values:
        raise ConfigError(f"{path}: no record holds {name!r}, the objective the sweeper asked for "
                          f"(objective={name}; val_loss needs train.eval_every > 0)")
    return float(values[-1])


def finish(cfg: AndreaConfig, run_dir: Path, rc: int) -> int:
    """0 only when the run finished (a valid checkpoint at train.steps; trained/ is then written);
    75 when it stopped before its last step (a signal, a preemption): the same command resumes it."""
    from .core.checkpoint import bin_path, is_valid, latest_checkpoint

    if rc != 0:
        return rc
    final = bin_path(run_dir / "checkpoints", cfg.train.steps)
    if not is_valid(final):
        newest = latest_checkpoint(run_dir)
        at = newest.name if newest is not None else "no checkpoint yet"
        print(f"andrea.train: stopped before step {cfg.train.steps} (newest checkpoint: {at}); the same "
              f"command resumes it (exit {EXIT_STOPPED})", file=sys.stderr)
        return EXIT_STOPPED
    out = publish_trained(cfg, run_dir, final)
    print(f"andrea.train: finished; {out} holds the final checkpoint and the completed history", file=sys.stderr)
    return 0


def precheck(argv, ranks: int = 1) -> Optional[str]:
    """What is wrong with the config of a single run given these command-line overrides, on one
    line (None when it composes and validates; with several ranks, train.grad_accum must be a
    multiple of them). Sweeps (-m) and Hydra flags are left to Hydra."""
    if any(a.startswith("-") or a.startswith(("hydra.", "hydra/", "+hydra", "~hydra")) for a in argv):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = resolve(compose(config_name="config", overrides=list(argv)))
        if cfg.train.grad_accum % ranks:
            return (f"train.grad_accum={cfg.train.grad_accum} is not a multiple of the {ranks} ranks: each rank runs "
                    f"grad_accum/ranks microbatches (set train.grad_accum=<a multiple of {ranks}>)")
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        return one_line(e)
    finally:
        GlobalHydra.instance().clear()
    return None


def short_help(conf_dir: Path = CONF_DIR) -> str:
    """What --help prints when no experiment is named (Hydra's own help needs one to compose)."""
    exps = sorted(p.stem for p in (Path(conf_dir) / "experiment").glob("*.yaml"))
    title, body = __doc__.strip("\n").split("\n\n", 1)
    return (f"{title}\n\nusage: python -m andrea.train experiment=<EXP> [key=value ...] [-m for sweeps]\n"
            f"experiments: {', '.join(exps)}\n\n{body.rstrip()}\n\n"
            "The groups, their options and every field: python -m andrea.train experiment=<EXP> --help\n"
            "Every key with the value it resolves to (nothing is run): python -m andrea.train experiment=<EXP> "
            "--cfg job  (add train.lr=... to see an override's effect; the types and comments are in "
            "andrea/config.py)\n")


_task_started = False  # set once Hydra has composed the config and called main


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Hydra's task: train, then return the run's objective (what sweepers optimise)."""
    global _task_started
    _task_started = True
    code = train(cfg)
    if code:
        sys.exit(code)  # in a sweep this stops the sweep: later runs would likely fail the same way
    if not in_sweep():
        return None
    try:
        return objective(run_folder(), str(cfg.objective))
    except (ConfigError, OSError, ValueError, KeyError) as e:
        if not sweeper_optimises():
            return None  # a grid sweep does not need it
        print(f"andrea.train: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def take_ranks_flag(argv: list) -> Optional[int]:
    """Remove `--ranks N` / `--ranks=N` from argv; N, or None without the flag. Exits 2 on a bad
    N, or on an N that differs from the launch this process is part of."""
    for i, a in enumerate(argv):
        if a == RANKS_FLAG or a.startswith(RANKS_FLAG + "="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            del argv[i:i + (1 if "=" in a else 2)]
            if not value.isdigit() or int(value) < 1:
                print(f"andrea.train: {RANKS_FLAG} {value!r}: expected a whole number of ranks >= 1", file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)
            size = launch_rank()[1]
            if size > 1 and int(value) != size:
                print(f"andrea.train: {RANKS_FLAG} {value} inside a launch of {size} ranks", file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)
            return int(value) if size == 1 else None
    return None


def cli() -> None:
    """`python -m andrea.train`: a config that does not compose exits 2 with one line, before Hydra
    starts; anything Hydra itself refuses later (a sweep's config) exits 2 as well."""
    global NEW_RUN_ON_CHANGE
    argv = sys.argv[1:]
    if {"-h", "--help"} & set(argv) and not any(a.startswith("experiment=") for a in argv):
        print(short_help())  # Hydra's own help needs an experiment to compose
        return
    ranks = take_ranks_flag(sys.argv)
    passed = list(sys.argv[1:])
    if NEW_RUN_FLAG in sys.argv[1:]:
        sys.argv.remove(NEW_RUN_FLAG)
        NEW_RUN_ON_CHANGE = True
    if ZERO1_FLAG in sys.argv[1:]:  # the engine processes (rank 0's under its proxy) inherit it
        sys.argv.remove(ZERO1_FLAG)
        os.environ[ZERO1_ENV] = "1"
    problem = precheck(sys.argv[1:], ranks or launch_rank()[1])
    if problem is not None:
        print(f"andrea.train: config error: {problem}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if ranks is not None and ranks > 1:
        from .run.launch import launch

        sys.exit(launch(ranks, passed))  # every rank runs this command, without --ranks
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not _task_started:  # Hydra's own error exit, before any run
            sys.exit(EXIT_BAD_INPUT)
        raise


if __name__ == "__main__":
    cli()
