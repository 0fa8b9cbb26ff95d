"""Archive a finished run: final checkpoint + sidecar, resolved config, tokenizer, loss history, manifest.

    python scripts/archive.py --config results/ANDREA-tiny/trained/config.yaml \
        --checkpoint results/ANDREA-tiny/trained/final.bin \
        --loss results/ANDREA-tiny/trained/ANDREA-tiny.loss.json --out results/ANDREA-tiny/archive/final \
        [--tokenizer data/synthetic/tok512/tokenizer.json]

The archive is self-contained: `andrea generate`, `chat` and `export` need nothing else. The
tokenizer is the config's data.tokenizer unless --tokenizer names it, and is archived as
tokenizer.json.

--checkpoint names the final checkpoint (its sidecar beside it, .json); --checkpoints a run's
checkpoints/ folder instead, whose newest valid one is taken. Either way it must be valid and at
train.steps (a run that stopped early is not archived as final); it is archived under its step
name, step_XXXXXXXX.bin and .json. manifest.json holds the sha256 and size of every archived file
and the software and hardware it was made with: Python, NumPy, CuPy, CUDA runtime and driver, GPU
name (null where there is none), the git commit of the checkout. The folder is assembled under a
temporary name and renamed into place, so it is either complete or absent.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from andrea.util.atomic import sha256_file as sha256
from andrea.core.checkpoint import bin_path, latest_checkpoint, sidecar_path, why_invalid
from andrea.config import load_run_config

REPO = Path(__file__).resolve().parent.parent


def _run(cmd) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def gpu_info() -> dict:
    """CuPy's view of CUDA when it imports; nvidia-smi's otherwise; nulls on a machine without GPU."""
    info = {"cupy": None, "cuda_runtime": None, "cuda_driver": None, "gpu": None, "nvidia_driver": None}
    try:
        import cupy

        info["cupy"] = cupy.__version__
        rt = cupy.cuda.runtime
        info["cuda_runtime"], info["cuda_driver"] = rt.runtimeGetVersion(), rt.driverGetVersion()
        name = rt.getDeviceProperties(0)["name"]
        info["gpu"] = name.decode() if isinstance(name, bytes) else name
    except Exception:  # no cupy, no driver or no device: recorded as null
        pass
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        name, _, driver = smi.splitlines()[0].partition(", ")
        info["gpu"] = info["gpu"] or name
        info["nvidia_driver"] = driver
    return info


def environment() -> dict:
    import numpy

    commit = _run(["git", "rev-parse", "HEAD"])
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"python": platform.python_version(), "numpy": numpy.__version__, **gpu_info(),
            "platform": platform.platform(), "machine": platform.machine(),
            "git_commit": commit, "git_dirty": bool(dirty) if dirty is not None else None}


def archive(config: Path, checkpoints: Path | None, loss: Path | None, out: Path, tokenizer: Path | None = None,
            checkpoint: Path | None = None) -> dict:
    cfg = load_run_config(config)
    tokenizer = Path(tokenizer or cfg.data.tokenizer)
    if not tokenizer.is_file():
        raise SystemExit(f"archive: tokenizer {tokenizer} (data.tokenizer of {config}): no such file; "
                         "an archive must hold its tokenizer (pass --tokenizer)")
    if checkpoint is not None:
        ckpt = checkpoint
        reason = why_invalid(ckpt)
        if reason is not None:
            raise SystemExit(f"archive: {ckpt}: not a valid checkpoint: {reason}")
    else:
        ckpt = latest_checkpoint(checkpoints.parent) if checkpoints.name == "checkpoints" else None
        if ckpt is None or ckpt.parent.resolve() != checkpoints.resolve():
            raise SystemExit(f"archive: {checkpoints}: no valid checkpoint (step_XXXXXXXX.bin with a matching sidecar)")
    step = int(json.loads(sidecar_path(ckpt).read_text())["step"])
    if step != cfg.train.steps:
        raise SystemExit(f"archive: checkpoint {ckpt.name} is step {step} but train.steps={cfg.train.steps}; "
                         "the run did not finish (see its <exp>.state.json)")
    name = bin_path(".", step).name
    files = [(ckpt, name), (sidecar_path(ckpt), sidecar_path(name).name), (config, config.name),
             (tokenizer, "tokenizer.json")] + ([(loss, loss.name)] if loss else [])
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    entries = []
    for src, name in files:
        dst = tmp / name
        shutil.copyfile(src, dst)
        entries.append({"file": name, "from": str(src), "bytes": dst.stat().st_size, "sha256": sha256(dst)})
    manifest = {"exp": cfg.exp, "step": step, "archived_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": entries, "environment": environment()}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=Path, help="resolved config.yaml of the run")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint", type=Path, help="the final checkpoint (its .json sidecar beside it)")
    where.add_argument("--checkpoints", type=Path, help="a run's checkpoints/ folder: its newest valid checkpoint")
    ap.add_argument("--loss", type=Path, help="<exp>.loss.json, archived beside the checkpoint")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json of the run (default: the config's data.tokenizer)")
    a = ap.parse_args(argv)
    m = archive(a.config, a.checkpoints, a.loss, a.out, a.tokenizer, a.checkpoint)
    env = m["environment"]
    print(f"archive: {m['exp']} step {m['step']} -> {a.out} ({len(m['files'])} files; python {env['python']}, "
          f"numpy {env['numpy']}, cupy {env['cupy']}, gpu {env['gpu']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
