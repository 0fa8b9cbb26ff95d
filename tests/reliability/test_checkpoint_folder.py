"""The checkpoints folder at start: stale temporary files of dead writers are removed and named
(a live process's are kept), a resume says where it resumes from, a folder that is a symlink loop
is refused with one line (exit 2) and nothing is touched."""
import os
import subprocess
import sys

from andrea.core import checkpoint as ck
from relkit import make_shards, run_proxy, snapshot, write_run


def test_stale_tmp_removed_live_kept_and_resume_is_announced(tmp_path):
    make_shards(tmp_path)
    run = write_run(tmp_path, steps=6, ckpt_every=0)
    assert run_proxy(run).returncode == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = run / "checkpoints" / f".step_00000006.bin.{dead.pid}.tmp"
    live = run / "checkpoints" / f".step_00000006.bin.{os.getpid()}.tmp"
    stale.write_bytes(b"x" * 100)
    live.write_bytes(b"y")
    r = run_proxy(run)
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and live.exists()
    assert "removed 1 temporary file" in r.stderr and stale.name in r.stderr, r.stderr
    assert "resuming from step 6 (checkpoint" in r.stderr and "config hash" in r.stderr, r.stderr


def test_checkpoints_symlink_loop_is_refused_and_nothing_touched(tmp_path):
    make_shards(tmp_path)
    run = write_run(tmp_path, steps=6, ckpt_every=0)
    assert run_proxy(run).returncode == 0
    import shutil
    shutil.rmtree(run / "checkpoints")
    os.symlink("checkpoints", run / "checkpoints")
    before = snapshot(run)
    r = run_proxy(run)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and str(run / "checkpoints") in r.stderr and "cannot be listed" in r.stderr, r.stderr
    assert snapshot(run) == before
