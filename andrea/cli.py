"""Command-line entry points of the engine.

    python -m andrea.cli engine --config RUN/config.yaml --run-dir RUN [--resume]
    python -m andrea.cli params [ANDREA-tiny ANDREA-12M ANDREA-120M]   # parameter counts
    python -m andrea.cli generate RUN --prompt "What is 12 + 7?"      # andrea/use/generate.py
    python -m andrea.cli chat RUN
    python -m andrea.cli serve RUN [--port 8000]                       # andrea/serve/: OpenAI's HTTP API
    python -m andrea.cli export RUN --format safetensors|hf            # andrea/use/export.py
    python -m andrea.cli import GPT2_FOLDER --config CONFIG.yaml       # andrea/use/importer.py
    python -m andrea.cli tasks RUN --tasks core --task-data DIR        # andrea/tasks/: ARC, PIQA, CORE, ...

`python -m andrea.train experiment=...` (Hydra, the proxy) is the usual way in; `engine` is the
process the proxy supervises, and can be run alone on a resolved config.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from .run.protocol import EXIT_BAD_INPUT, EXIT_NO_SPACE, PROXY_PID_ENV

# how long a starting engine waits for .engine.lock (an engine killed a moment ago is on its way out)
ENGINE_LOCK_WAIT_S = float(os.environ.get("ANDREA_ENGINE_LOCK_WAIT_S", "15"))


def _report(message: str) -> None:
    """A fatal error: on stderr for the terminal, and as an event for the proxy's state.json
    (rank 0's; the other ranks of a data-parallel run say nothing on stdout)."""
    from .core.comm import launch_rank
    from .run.protocol import emit

    rank, size = launch_rank()
    print(f"engine{f' (rank {rank} of {size})' if size > 1 else ''}: {message}", file=sys.stderr)
    if rank == 0:
        emit("error", message=message)


def cmd_engine(args) -> int:
    if os.environ.get(PROXY_PID_ENV):
        from .run.runner import die_with_parent

        die_with_parent(int(os.environ[PROXY_PID_ENV]))
    return run_engine(args.config, args.run_dir, args.resume, args.resume_at_most)


def run_engine(config, run_dir=None, resume=False, resume_at_most=None) -> int:
    """The engine on a resolved config (a config.yaml path, or the AndreaConfig itself); returns
    its exit code. Under a launcher of several ranks (andrea/core/comm.py) this process is one rank:
    rank 0 holds the run folder's engine lock and writes; the others only train."""
    import contextlib

    from omegaconf.errors import OmegaConfBaseException

    from .util.atomic import NoSpace
    from .core.checkpoint import CheckpointError
    from .core.comm import make_comm, select_gpu, zero1_requested
    from .config import load_run_config
    from .data.shards import ShardError
    from .util.lock import LockHeld, run_lock
    from .run.runner import Run

    try:
        cfg = load_run_config(config) if isinstance(config, (str, Path)) else config
        run_dir = Path(run_dir) if run_dir else Path(cfg.results_dir) / cfg.exp
        comm = make_comm()
        select_gpu(cfg.backend.name, comm)
        if comm.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            # one engine per run folder; an engine killed a moment ago may still be on its way out
            lock = run_lock(run_dir, "engine", wait_s=ENGINE_LOCK_WAIT_S)
        else:
            lock = contextlib.nullcontext()
        with lock:
            run = Run(cfg, run_dir, comm=comm, zero1=zero1_requested())
            rc = run.train(resume=resume, resume_at_most=resume_at_most)
    except LockHeld as e:
        _report(str(e))
        return EXIT_BAD_INPUT
    except NoSpace as e:
        _report(str(e))
        return EXIT_NO_SPACE
    except (CheckpointError, ShardError, FileNotFoundError, OmegaConfBaseException, ValueError) as e:
        _report(str(e))
        return EXIT_BAD_INPUT
    # The run's last checkpoint is on disk: further stop signals have nothing left to save, and
    # must not kill interpreter shutdown (which restores default handlers) with a non-zero status.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    return rc


def cmd_params(args) -> int:
    from omegaconf import OmegaConf

    from .config import ModelConfig
    from .core.model import count_params

    from .paths import model_config

    for name in args.models:
        path = model_config(name)
        if not path.is_file():
            print(f"{name}: no model config {path}", file=sys.stderr)
            return 2
        m = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))
        print(f"{name:<14}{count_params(m):>14,} parameters  (L={m.n_layer} C={m.d_model} "
              f"NH={m.n_head} context={m.context} V={m.vocab_size})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m andrea.cli", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine", help="train one run from a resolved config (JSON lines on stdout)")
    e.add_argument("--config", required=True, help="resolved config.yaml of the run")
    e.add_argument("--run-dir", help="run folder (default: <results_dir>/<exp>)")
    e.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    e.add_argument("--resume-at-most", type=int, metavar="STEP",
                   help="with --resume: the newest valid checkpoint of a step <= STEP (the proxy's records "
                        "reach that far)")
    e.set_defaults(fn=cmd_engine)
    p = sub.add_parser("params", help="print parameter counts of model configs")
    p.add_argument("models", nargs="*", default=["ANDREA-tiny", "ANDREA-12M", "ANDREA-120M"])
    p.set_defaults(fn=cmd_params)
    from .use import export, generate, importer
    generate.add_arguments(sub.add_parser("generate", help="answer one prompt from a trained model"), chat=False)
    generate.add_arguments(sub.add_parser("chat", help="talk to a trained model (REPL)"), chat=True)
    export.add_arguments(sub.add_parser("export", help="write safetensors or a Hugging Face GPT-2 folder"))
    importer.add_arguments(sub.add_parser("import", help="start a run from GPT-2-layout weights"))
    from .tasks.__main__ import add_arguments as task_arguments
    task_arguments(sub.add_parser("tasks", help="score a trained model on standard in-context tasks (ARC, CORE, ...)"))
    from .serve import command as serve
    serve.add_arguments(sub.add_parser("serve", help="serve a trained model over OpenAI's HTTP API, with a chat page"))
    args = ap.parse_args(argv)
    if args.cmd in ("engine", "params"):
        return args.fn(args)
    from .run.protocol import run_command
    return run_command(f"andrea {args.cmd}", args.fn, args)  # bad input: one line naming what is wrong, exit 2


if __name__ == "__main__":
    sys.exit(main())
