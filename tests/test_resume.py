"""The engine process: bit-exact resume after SIGTERM, SIGUSR1, the abort policy, bad resume input.

Each test runs the real `python -m andrea.cli engine` on a tiny config with random-token shards.
"""
import json
import signal
import subprocess
import sys
import time

import numpy as np
from omegaconf import OmegaConf

from andrea.core import checkpoint as ck
from conftest import make_shards, small_config


def write_config(tmp_path, name, **train):
    run = tmp_path / name
    run.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(small_config(tmp_path, **train)), run / "config.yaml")
    return run


def start(run, resume=False):
    cmd = [sys.executable, "-m", "andrea.cli", "engine", "--config", str(run / "config.yaml"),
           "--run-dir", str(run)] + (["--resume"] if resume else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def events(proc, until=None):
    """Read JSON events; call until(event) for each and stop reading when it returns True."""
    out = []
    for line in proc.stdout:
        ev = json.loads(line)
        out.append(ev)
        if until and until(ev):
            break
    return out


def finish(proc):
    rest = [json.loads(line) for line in proc.stdout]
    return proc.wait(timeout=60), rest


STEPS = 300


def test_sigterm_then_resume_is_bit_exact(tmp_path):
    make_shards(tmp_path)
    straight = write_config(tmp_path, "straight", steps=STEPS, ckpt_every=50)
    rc, evs = finish(start(straight))
    assert rc == 0 and evs[-1] == {"event": "done", "step": STEPS, "status": "finished"}

    run = write_config(tmp_path, "interrupted", steps=STEPS, ckpt_every=50)
    p = start(run)
    events(p, until=lambda e: e["event"] == "step" and e["step"] >= 70)
    p.send_signal(signal.SIGTERM)
    rc, rest = finish(p)
    assert rc == 0
    stopped = rest[-1]
    assert stopped["event"] == "done" and stopped["status"] == "stopped"
    assert 70 <= stopped["step"] < STEPS, "the signal came too late to test a resume"
    assert any(e["event"] == "checkpoint" and e["reason"] == "signal" for e in rest)

    rc, evs = finish(start(run, resume=True))
    assert rc == 0
    assert evs[1] == {"event": "resume", "step": stopped["step"],
                      "checkpoint": str(ck.bin_path(run / "checkpoints", stopped["step"]))}
    steps = [e["step"] for e in evs if e["event"] == "step"]
    assert steps[0] == stopped["step"] + 1 and steps[-1] == STEPS
    a, b = ck.bin_path(straight / "checkpoints", STEPS), ck.bin_path(run / "checkpoints", STEPS)
    assert a.read_bytes() == b.read_bytes()
    # the sidecars too: data position, counters and loss scale all agree (and hold no timestamps)
    assert ck.sidecar_path(a).read_text() == ck.sidecar_path(b).read_text()


def test_sigusr1_checkpoints_and_goes_on(tmp_path):
    make_shards(tmp_path)
    run = write_config(tmp_path, "usr1", steps=STEPS, ckpt_every=0)
    p = start(run)
    events(p, until=lambda e: e["event"] == "step" and e["step"] >= 20)
    p.send_signal(signal.SIGUSR1)
    rc, rest = finish(p)
    assert rc == 0 and rest[-1]["status"] == "finished" and rest[-1]["step"] == STEPS
    sig = [e for e in rest if e["event"] == "checkpoint" and e["reason"] == "signal"]
    assert len(sig) == 1 and 20 <= sig[0]["step"] < STEPS
    assert ck.is_valid(sig[0]["path"])


def test_double_sigterm_while_saving_leaves_valid_checkpoint(tmp_path):
    make_shards(tmp_path)
    run = write_config(tmp_path, "double", steps=STEPS, ckpt_every=0)
    p = start(run)
    events(p, until=lambda e: e["event"] == "step" and e["step"] >= 30)
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    rc, rest = finish(p)
    assert rc == 0 and rest[-1]["status"] == "stopped"
    last = ck.latest_checkpoint(run)
    assert last is not None and ck.is_valid(last)
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_abort_after_max_bad_steps_keeps_last_good_state(tmp_path):
    """lr so large the weights overflow: steps go non-finite, are skipped, and the run aborts
    with exit 3 and a checkpoint whose weights are all finite."""
    make_shards(tmp_path)
    run = write_config(tmp_path, "nan", steps=200, lr=1e30, warmup_steps=0, grad_clip=0.0,
                       max_bad_steps=3, ckpt_every=0)
    rc, evs = finish(start(run))
    assert rc == 3 and evs[-1]["status"] == "aborted"
    skipped = [e for e in evs if e["event"] == "step" and e["skipped"]]
    assert len(skipped) >= 3
    c = ck.read_checkpoint(ck.latest_checkpoint(run), json.loads(
        ck.sidecar_path(ck.latest_checkpoint(run)).read_text())["n_params"])
    assert c.sidecar["reason"] == "abort" and c.sidecar["bad_streak"] == 3
    assert np.isfinite(c.params).all()


def test_resume_refuses_changed_config(tmp_path):
    make_shards(tmp_path)
    run = write_config(tmp_path, "changed", steps=8, ckpt_every=4)
    assert finish(start(run))[0] == 0
    write_config(tmp_path, "changed", steps=8, ckpt_every=4, lr=0.5)
    p = subprocess.run([sys.executable, "-m", "andrea.cli", "engine", "--config",
                        str(run / "config.yaml"), "--run-dir", str(run), "--resume"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2  # bad input: the proxy must not restart it
    assert "config_hash" in p.stderr and "step_00000008.bin" in p.stderr
