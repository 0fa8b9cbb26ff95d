"""A full disk (a small tmpfs; needs root, skipped otherwise): a checkpoint that does not fit is
refused before writing with the file and the bytes needed, status `failed`, no temporary file, the
previous checkpoint intact; with space again the run resumes to the same bytes. The proxy's own
record writes survive a full disk."""
import os
import re
import subprocess
import uuid

import numpy as np
import pytest

from andrea.core import checkpoint as ck
from andrea.util.atomic import NoSpace, atomic_write_json
from andrea.config import load_run_config
from andrea.core.model import ParamLayout
from relkit import make_shards, read, run_proxy, write_run

PAGE = 4096


def _mount(path, size):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a fresh tmpfs of that many bytes (unmounted afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mounted = []

    def mount(size):
        where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        if not _mount(where, size):
            pytest.skip("mount -t tmpfs is not permitted here")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(path, leave=0):
    """Fill the disk holding path to the last byte, then give back `leave` bytes."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * PAGE)
        except OSError:
            pass
    if leave:
        os.truncate(path, max(0, path.stat().st_size - leave))


def _pages(n):
    return -(-n // PAGE) * PAGE


def test_checkpoint_that_does_not_fit_fails_cleanly_then_resumes(tmp_path, small_disk):
    make_shards(tmp_path)
    straight = write_run(tmp_path, name="t", run_dir=tmp_path / "straight" / "t", steps=12, ckpt_every=4, keep_last=2)
    assert run_proxy(straight).returncode == 0
    n = ParamLayout.from_config(load_run_config(straight / "config.yaml").model).n_params
    ckpt = _pages(8 + 12 * n)
    disk = small_disk(2 * ckpt + ckpt // 2 + 64 * 1024)  # two checkpoints and the records fit, three do not
    run = write_run(tmp_path, name="t", run_dir=disk / "t", steps=12, ckpt_every=4, keep_last=2)

    r = run_proxy(run)
    assert r.returncode == 4, r.stderr
    state = read(run, "state")
    assert state["status"] == "failed" and state["engine_exit"] == 4 and state["engine_pid"] is None
    for text in (r.stderr, state["message"]):
        needed = re.search(r"step_00000012\.bin: not enough disk space: ([\d,]+) bytes needed", text)
        assert needed and 8 + 12 * n <= int(needed.group(1).replace(",", "")) < 8 + 12 * n + PAGE, text
    assert "Traceback" not in r.stderr
    files = [p.name for p in run.rglob("*")]
    assert not [f for f in files if f.endswith(".tmp")], files
    assert [p.name for p in ck.list_checkpoints(run / "checkpoints")] == ["step_00000004.bin", "step_00000008.bin"]
    assert ck.is_valid(run / "checkpoints" / "step_00000008.bin")

    subprocess.run(["mount", "-o", f"remount,size={4 * ckpt + 256 * 1024}", str(disk)], check=True)
    r = run_proxy(run)
    assert r.returncode == 0, r.stderr
    assert read(run, "state")["status"] == "finished"
    final = "checkpoints/step_00000012.bin"
    assert (run / final).read_bytes() == (straight / final).read_bytes()
    assert [h["step"] for h in read(run, "loss")["history"]] == list(range(1, 13))


def test_space_gone_during_the_write_leaves_nothing_half_written(small_disk, monkeypatch):
    """The free-space check passed, then another writer took the space: ENOSPC mid-write is a
    NoSpace naming the file and the bytes, with no temporary file and the old checkpoint whole."""
    disk = small_disk(256 * 1024)
    n = 4000  # 48 KB per checkpoint
    a = np.ones(n, np.float32)
    first = ck.write_checkpoint(disk, 1, a, a, a, {"x": 1})
    fill(disk / "filler", leave=4 * PAGE)  # 16 KB free: less than the 48 KB the write needs
    monkeypatch.setattr(ck, "check_space", lambda path, needed: None)  # the check saw room
    with pytest.raises(NoSpace) as e:
        ck.write_checkpoint(disk, 2, a, a, a, {"x": 2})
    assert "step_00000002.bin" in str(e.value) and f"{8 + 12 * n:,} bytes needed" in str(e.value), str(e.value)
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "step_00000001.bin", "step_00000001.json"]
    assert ck.is_valid(first)


def test_record_writes_survive_a_full_disk(small_disk, capsys):
    from andrea.run.proxy import RunRecords

    disk = small_disk(64 * 1024)
    run = disk / "t"
    run.mkdir()
    rec = RunRecords("t", run, total_steps=10, flush_s=0)
    rec.add_step({"step": 1, "loss": 1.0})
    rec.flush(force=True)
    good = (run / "t.loss.json").read_bytes()
    filler = disk / "filler"
    fill(filler)
    for i in range(2, 100):
        rec.add_step({"step": i, "loss": 1.0 / i})
    rec.flush(force=True)  # does not raise
    assert rec.write_error is not None and "not enough disk space" in rec.write_error
    assert (run / "t.loss.json").read_bytes() == good
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    assert "cannot rewrite the run records" in capsys.readouterr().err
    filler.unlink()
    rec.flush(force=True)
    assert rec.write_error is None and len(read(run, "loss")["history"]) == 99
