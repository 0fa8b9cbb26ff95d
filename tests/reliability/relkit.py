"""Helpers of the reliability suite: tiny runs on random-token shards, run folders, processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the shared tests/conftest.py helpers

from conftest import make_shards, small_config, wait_for  # noqa: E402,F401

# randomized kill loops run this many trials by default; ANDREA_RELIABILITY_TRIALS raises it
TRIALS = int(os.environ.get("ANDREA_RELIABILITY_TRIALS", "2"))


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH", "")]))
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.setdefault("HF_DATASETS_OFFLINE", "1")
    return e


def write_run(tmp_path, name="t", run_dir=None, **train):
    """A run folder holding a tiny config.yaml (shards in tmp_path/shards); returns the folder."""
    cfg = small_config(tmp_path, **train)
    cfg["exp"] = name
    run = Path(run_dir) if run_dir else tmp_path / name
    run.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(cfg), run / "config.yaml")
    return run


def read(run: Path, kind: str, exp: str = None) -> dict:
    return json.loads((run / f"{exp or run.name}.{kind}.json").read_text())


def snapshot(folder: Path) -> dict:
    """{relative path: (bytes, mtime_ns)} of every file under folder: 'touches nothing' is equality."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


def proxy_cmd(run: Path, *extra: str):
    return [sys.executable, "-m", "andrea.run.proxy", str(run), "--no-progress", *extra]


def run_proxy(run: Path, *extra: str, timeout: float = 120):
    return subprocess.run(proxy_cmd(run, *extra), capture_output=True, text=True, timeout=timeout, env=env())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
    return True


def group_alive(pgid: int) -> list:
    """The pids of the live (not zombie) processes of process group pgid (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
            out.append(int(d.name))
    return out
