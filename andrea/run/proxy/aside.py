"""Records kept elsewhere in the run folder: a run set aside whole in previous/<label>-<time>/
(set_aside: a changed config's run, or a history whose checkpoints are gone), and the pivot
archive archive/<phase>-<step>/ (archive_pivot: samples, state and the checkpoint at a phase
boundary; records.py documents the files)."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from andrea.util.atomic import atomic_copy

SET_ASIDE_DIR = "previous"  # records (and more) of an earlier run, kept whole: set_aside


def set_aside(run_dir: Path, names, label: str) -> Path:
    """Move the named files and folders of run_dir (those that exist) to run_dir/previous/<label>-<time>/:
    renames in the same folder, nothing copied, nothing deleted. Returns that folder."""
    dest = Path(run_dir) / SET_ASIDE_DIR / f"{_safe_name(label)}-{time.strftime('%Y%m%dT%H%M%S')}"
    while dest.exists():
        dest = dest.with_name(dest.name + "+")
    dest.mkdir(parents=True)
    for name in names:
        if os.path.lexists(Path(run_dir) / name):
            os.replace(Path(run_dir) / name, dest / name)
    return dest


def _safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", str(s)) or "phase"


def archive_pivot(rec, ev: dict) -> Path:
    """Copy samples, state and the pivot checkpoint of rec (a records.RunRecords) into
    archive/<from>-<step>/ (never the history)."""
    step, src_phase = int(ev["step"]), ev.get("from") or rec.state["phase"] or "phase"
    ckpt = Path(ev["checkpoint"])
    if not ckpt.is_absolute() and not ckpt.exists():
        ckpt = rec.run_dir / ckpt
    rec.set_checkpoint(str(ckpt), step)
    rec.state.update(step=max(rec.state["step"] or 0, step), phase=src_phase)
    dest = rec.run_dir / "archive" / f"{_safe_name(src_phase)}-{step}"
    rec.state["archives"] = [a for a in rec.state["archives"] if a["dir"] != str(dest.relative_to(rec.run_dir))]
    rec.state["archives"].append({"phase": src_phase, "step": step, "dir": str(dest.relative_to(rec.run_dir))})
    rec.write_samples()
    rec.flush(force=True)
    dest.mkdir(parents=True, exist_ok=True)
    for src in (rec.samples_path, rec.state_path, ckpt, ckpt.with_suffix(".json")):
        if not src.is_file():
            raise FileNotFoundError(f"pivot at step {step}: {src} does not exist; cannot archive it")
        atomic_copy(src, dest / src.name)
    rec.state["phase"] = ev.get("to", rec.state["phase"])
    rec.flush(force=True)
    return dest

