"""Checkpoints (a contract, docs/ARCHITECTURE.md): `<run>/checkpoints/step_XXXXXXXX.bin`, little-endian
`[int32 step][int32 n_params][n_params f32 weights][n_params f32 m][n_params f32 v]` (exactly
8 + 12 * n_params bytes), and beside it `step_XXXXXXXX.json`, the sidecar with everything else a
bit-exact resume needs (data position, loss scale, counters, config hash, sha256 of the .bin).

Both files are written to temporary names and fsynced, then renamed, the .bin first: a checkpoint
counts only when its sidecar exists and its sha256 matches, so a reader never sees half of one.
Before writing, the weights and moments are checked to be finite (a checkpoint never holds NaN or
Inf) and the folder to have room for both files (their size is known); either failure writes
nothing, so the previous checkpoint stays the newest. `scan` says why each checkpoint newer than
the newest valid one is not valid, so nothing is skipped without a word.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..util.atomic import atomic_write_many, check_space, sha256_file

NAME_RE = re.compile(r"^step_(\d{8})\.bin$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is."""


class NotFinite(CheckpointError):
    """The state to be checkpointed holds NaN or Inf: it is not written."""



@dataclass
class Checkpoint:
    path: Path
    step: int
    params: np.ndarray
    m: np.ndarray
    v: np.ndarray
    sidecar: dict


def bin_path(ckpt_dir, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}.bin"


def sidecar_path(bin_file) -> Path:
    return Path(bin_file).with_suffix(".json")


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(ckpt_dir, step: int, params, m, v, sidecar: dict) -> Path:
    """Write step_XXXXXXXX.bin and .json atomically; returns the .bin path."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    n = params.size
    path = bin_path(ckpt_dir, step)
    for name, a in (("params", params), ("m", m), ("v", v)):
        if a.size != n:
            raise CheckpointError(f"write_checkpoint: {name} has {a.size} elements, params {n}")
        bad = a.size - int(np.count_nonzero(np.isfinite(a)))
        if bad:
            raise NotFinite(f"checkpoint {path.name} not written: {'weights' if name == 'params' else 'Adam ' + name} "
                            f"hold {bad:,} non-finite values (NaN/Inf) of {n:,}; the newest checkpoint on disk "
                            "keeps the last finite state")
    header = np.array([step, n], dtype="<i4").tobytes()
    blocks = [np.ascontiguousarray(a, dtype="<f4").tobytes() for a in (params, m, v)]
    digest = hashlib.sha256()
    for c in [header] + blocks:
        digest.update(c)
    side = dict(sidecar, step=step, n_params=n, sha256=digest.hexdigest(), file=path.name)
    side_text = json.dumps(side, indent=1, sort_keys=True)
    check_space(path, 8 + 12 * n + len(side_text.encode()))
    atomic_write_many([(path, [header] + blocks), (sidecar_path(path), side_text)])
    _fsync_dir(ckpt_dir)
    return path


def read_sidecar(bin_file) -> dict:
    side = sidecar_path(bin_file)
    if not side.is_file():
        raise CheckpointError(f"checkpoint {bin_file}: sidecar {side.name} is missing; the write "
                              "did not finish, so this checkpoint is not valid")
    try:
        return json.loads(side.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint sidecar {side}: not valid JSON ({e})") from None


def read_checkpoint(path, n_params: int, config_hash: Optional[str] = None) -> Checkpoint:
    """Load and check a checkpoint: size, n_params, sha256, and the config hash when given."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    raw = path.read_bytes()
    expected = 8 + 12 * n_params
    if len(raw) < 8:
        raise CheckpointError(f"checkpoint {path.name}: {len(raw)} bytes, shorter than the 8-byte header")
    step, n = (int(x) for x in np.frombuffer(raw[:8], dtype="<i4"))
    if n != n_params:
        raise CheckpointError(f"checkpoint {path.name}: n_params is {n} but the model has {n_params}; "
                              "was it written for another config?")
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "oversized"
        raise CheckpointError(f"checkpoint {path.name}: {len(raw)} bytes but 8 + 12 * n_params = "
                              f"{expected} expected ({what})")
    side = read_sidecar(path)
    sha = hashlib.sha256(raw).hexdigest()
    if side.get("sha256") != sha:
        raise CheckpointError(f"checkpoint {path.name}: sha256 is {sha[:12]}… but the sidecar "
                              f"field sha256 says {str(side.get('sha256'))[:12]}…; the file changed")
    if side.get("step") != step:
        raise CheckpointError(f"checkpoint {path.name}: header step {step} but sidecar step {side.get('step')}")
    if config_hash is not None and side.get("config_hash") != config_hash:
        raise CheckpointError(f"checkpoint {path.name}: sidecar config_hash {side.get('config_hash')} "
                              f"does not match this run's config ({config_hash}); the model or "
                              "training settings changed since it was written")
    arr = np.frombuffer(raw, dtype="<f4", offset=8).reshape(3, n)
    return Checkpoint(path, step, arr[0].copy(), arr[1].copy(), arr[2].copy(), side)


def list_checkpoints(ckpt_dir) -> List[Path]:
    """Every step_XXXXXXXX.bin in ckpt_dir, oldest first (by step)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if NAME_RE.match(p.name))


def why_invalid(bin_file, n_params: Optional[int] = None) -> Optional[str]:
    """None for a complete, consistent checkpoint; else the reason it cannot be used, in words
    (sidecar missing or garbage, header and size, sha256, step). Reads the file once, streaming."""
    bin_file = Path(bin_file)
    try:
        side = read_sidecar(bin_file)
        if not isinstance(side, dict):
            return f"sidecar {sidecar_path(bin_file).name} is not a JSON object"
        size = bin_file.stat().st_size
        with open(bin_file, "rb") as f:
            head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header"
        step, n = (int(x) for x in np.frombuffer(head, dtype="<i4"))
        if n_params is not None and n != n_params:
            return f"header n_params is {n} but the model has {n_params}"
        if side.get("n_params") != n:
            return f"header n_params is {n} but the sidecar says {side.get('n_params')!r}"
        if size != 8 + 12 * n:
            return (f"{size} bytes but 8 + 12 * n_params = {8 + 12 * n} expected "
                    f"({'truncated' if size < 8 + 12 * n else 'oversized'})")
        m = NAME_RE.match(bin_file.name)
        if side.get("step") != step or (m and int(m.group(1)) != step):
            return f"header step {step}, sidecar step {side.get('step')!r}, file name {bin_file.name} disagree"
        if side.get("sha256") != sha256_file(bin_file):
            return "sha256 differs from the sidecar's: the file changed after it was written"
    except CheckpointError as e:
        return str(e).split(": ", 1)[-1] if str(e).startswith("checkpoint") else str(e)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return None


def is_valid(bin_file) -> bool:
    """Complete: sidecar present, header, size and sha256 consistent with it."""
    return why_invalid(bin_file) is None


def step_of(bin_file) -> int:
    return int(NAME_RE.match(Path(bin_file).name).group(1))


def scan(run_dir, n_params: Optional[int] = None,
         max_step: Optional[int] = None) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
    """(the newest valid checkpoint in run_dir/checkpoints or None, [(path, reason)] of each newer
    one that is not valid), looking from the newest down; with max_step, only checkpoints of steps
    up to it are considered."""
    skipped = []
    for p in reversed(list_checkpoints(Path(run_dir) / "checkpoints")):
        if max_step is not None and step_of(p) > max_step:
            continue
        reason = why_invalid(p, n_params)
        if reason is None:
            return p, skipped
        skipped.append((p, reason))
    return None, skipped


def latest_checkpoint(run_dir) -> Optional[Path]:
    """The newest valid checkpoint in run_dir/checkpoints, or None."""
    return scan(run_dir)[0]


def prune(ckpt_dir, keep_last: int, protect=()) -> List[Path]:
    """Delete all but the newest keep_last valid checkpoints (and invalid leftovers older than the
    newest valid one). The newest valid checkpoint and `protect` are never deleted."""
    all_ = list_checkpoints(ckpt_dir)
    valid = [p for p in all_ if is_valid(p)]
    if not valid:
        return []
    keep = set(valid[-max(1, keep_last):]) | {Path(p) for p in protect}
    newest = valid[-1]
    removed = []
    for p in all_:
        if p in keep or p >= newest:
            continue
        for f in (p, sidecar_path(p)):
            if f.exists():
                f.unlink()
        removed.append(p)
    return removed


TMP_RE = re.compile(r"^\..+\.(\d+)\.tmp$")  # util.atomic.tmp_path: .<name>.<pid>.tmp


def check_folder(ckpt_dir) -> None:
    """CheckpointError (one line: the path and what was expected) when ckpt_dir exists but is not
    a folder this process can list and write (a file, a symlink loop, a dangling link, no
    permission). A folder that does not exist yet is fine: the first save makes it."""
    d = Path(ckpt_dir)
    if not os.path.lexists(d):
        return
    what = "a folder this user can list and write, holding step_XXXXXXXX.bin checkpoints"
    try:
        os.listdir(d)
    except NotADirectoryError:
        raise CheckpointError(f"{d}: not a folder; expected {what}. Nothing was started or changed") from None
    except OSError as e:
        raise CheckpointError(f"{d}: cannot be listed ({e.strerror or e}); expected {what}. "
                              "Nothing was started or changed") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise CheckpointError(f"{d}: cannot be written (permission); expected {what}. "
                              "Nothing was started or changed")


def remove_stale_tmp(ckpt_dir, names: Optional[Sequence[str]] = None) -> List[Path]:
    """Remove the temporary files (.<name>.<pid>.tmp) of checkpoint writes whose process is dead
    (a SIGKILL cannot run cleanup); a live process's are never touched. With names, only those of
    files of these names (the proxy's records in a run folder). Returns those removed."""
    d = Path(ckpt_dir)
    removed = []
    if not d.is_dir():
        return removed
    for p in sorted(d.iterdir()):
        m = TMP_RE.match(p.name)
        if not m or not p.is_file() or p.is_symlink():
            continue
        if names is not None and p.name[1:m.start(1) - 1] not in names:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:  # a zombie has finished writing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True
    return True


def move_obstacles(ckpt_dir) -> List[Tuple[Path, Path]]:
    """A step_XXXXXXXX.bin or .json that is not a plain file (a directory, say) would make the
    save at that step fail: rename each aside to <name>.obstacle-<time> and return (old, new)."""
    d = Path(ckpt_dir)
    moved = []
    if not d.is_dir():
        return moved
    import time
    for p in sorted(d.iterdir()):
        if not re.match(r"^step_\d{8}\.(bin|json)$", p.name) or p.is_symlink() or p.is_file():
            continue
        dest = p.with_name(f"{p.name}.obstacle-{time.strftime('%Y%m%dT%H%M%S')}")
        while os.path.lexists(dest):
            dest = dest.with_name(dest.name + "+")
        os.rename(p, dest)
        moved.append((p, dest))
    return moved
