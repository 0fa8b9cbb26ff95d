"""Checkpoints are never silently bad: non-finite weights are never written, every damaged
checkpoint is reported by name and reason (terminal and state.json) and skipped, and when
checkpoints exist but none is valid the run exits 2 and changes nothing."""
import json
import sys

import numpy as np
import pytest

from andrea.core import checkpoint as ck
from andrea.config import load_run_config
from relkit import make_shards, read, run_proxy, snapshot, write_run


def test_write_checkpoint_refuses_non_finite_state(tmp_path):
    n = 10
    good = np.ones(n, np.float32)
    for name, bad_index in (("params", 0), ("m", 1), ("v", 2)):
        arrays = [good.copy(), good.copy(), good.copy()]
        arrays[bad_index][3] = np.nan if bad_index != 2 else np.inf
        with pytest.raises(ck.NotFinite, match="non-finite"):
            ck.write_checkpoint(tmp_path, 5, *arrays, {})
    assert list(tmp_path.iterdir()) == []


def test_weights_going_non_finite_mid_run_never_reach_a_checkpoint(tmp_path, capsys):
    """The weights turn NaN at step 6 (as an overflowing update would make them): steps 6-8 are
    non-finite, the run aborts (exit 3) and the newest checkpoint is step 4's finite one."""
    from andrea.run.runner import EXIT_ABORTED, Run

    make_shards(tmp_path)
    run_dir = write_run(tmp_path, steps=12, ckpt_every=4, max_bad_steps=3)
    run = Run(load_run_config(run_dir / "config.yaml"), run_dir)
    step = run.eng.train_step

    def poisoned(n, batches):
        if n == 6:
            p, m, v = run.eng.host_state()
            run.eng.set_state(np.full_like(p, np.nan), m, v)
        return step(n, batches)

    run.eng.train_step = poisoned
    import signal
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        assert run.train() == EXIT_ABORTED
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert "not written" in err and "step_00000004.bin" in err
    names = [p.name for p in ck.list_checkpoints(run_dir / "checkpoints")]
    assert names == ["step_00000004.bin"]
    c = ck.read_checkpoint(run_dir / "checkpoints" / names[0], run.eng.layout.n_params)
    assert np.isfinite(c.params).all() and np.isfinite(c.m).all() and np.isfinite(c.v).all()


def _truncate(b, s):
    b.write_bytes(b.read_bytes()[: len(b.read_bytes()) // 2])


def _flip(b, s):
    raw = bytearray(b.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    b.write_bytes(bytes(raw))


def _n_params(b, s):
    raw = bytearray(b.read_bytes())
    raw[4:8] = np.array([123], "<i4").tobytes()
    b.write_bytes(bytes(raw))


def _no_sidecar(b, s):
    s.unlink()


def _garbage_sidecar(b, s):
    s.write_text("{garbage")


def _list_sidecar(b, s):
    s.write_text("[1, 2, 3]")


DAMAGE = {"truncated": (_truncate, "truncated"), "flipped byte": (_flip, "sha256"),
          "wrong n_params": (_n_params, "n_params"), "missing sidecar": (_no_sidecar, "missing"),
          "garbage sidecar": (_garbage_sidecar, "not valid JSON"), "sidecar not an object": (_list_sidecar, "object")}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_checkpoint_is_reported_skipped_and_replayed(tmp_path, kind):
    make_shards(tmp_path)
    run = write_run(tmp_path, steps=12, ckpt_every=4, keep_last=3)
    r = run_proxy(run)
    assert r.returncode == 0, r.stderr
    newest = ck.bin_path(run / "checkpoints", 12)
    original = newest.read_bytes()
    damage, reason = DAMAGE[kind]
    damage(newest, ck.sidecar_path(newest))

    r = run_proxy(run)
    assert r.returncode == 0, r.stderr
    assert "step_00000012.bin" in r.stderr and reason in r.stderr, r.stderr
    skipped = read(run, "state")["skipped_checkpoints"]
    assert [s["file"] for s in skipped] == ["step_00000012.bin"] and reason in skipped[0]["reason"]
    assert newest.read_bytes() == original  # resumed from step 8 and wrote the same step 12 again
    assert [h["step"] for h in read(run, "loss")["history"]] == list(range(1, 13))


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_no_valid_checkpoint_exits_2_and_touches_nothing(tmp_path, kind):
    make_shards(tmp_path)
    run = write_run(tmp_path, steps=6, ckpt_every=0)
    assert run_proxy(run).returncode == 0
    only = ck.bin_path(run / "checkpoints", 6)
    damage, reason = DAMAGE[kind]
    damage(only, ck.sidecar_path(only))
    before = snapshot(run)
    r = run_proxy(run)
    assert r.returncode == 2
    assert "step_00000006.bin" in r.stderr and reason in r.stderr and "none is valid" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert snapshot(run) == before


def test_engine_alone_reports_damage_and_refuses_when_none_is_valid(tmp_path):
    import subprocess
    from relkit import env

    make_shards(tmp_path)
    run = write_run(tmp_path, steps=6, ckpt_every=0)
    assert run_proxy(run).returncode == 0
    _flip(ck.bin_path(run / "checkpoints", 6), None)
    before = snapshot(run)
    r = subprocess.run([sys.executable, "-m", "andrea.cli", "engine", "--config", str(run / "config.yaml"),
                        "--run-dir", str(run), "--resume"], capture_output=True, text=True, timeout=120, env=env())
    assert r.returncode == 2
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert {"event": "bad_checkpoint", "checkpoint": str(ck.bin_path(run / "checkpoints", 6)),
            "reason": "sha256 differs from the sidecar's: the file changed after it was written"} in events
    assert events[-1]["event"] == "error" and "none is valid" in events[-1]["message"]
    assert snapshot(run) == before
