"""The proxy around the real engine (`python -m andrea.cli engine`) on tiny random-token runs.

kill -9 recovery (bit-identical final checkpoint, each step once), SIGTERM / SIGINT / SIGUSR1 to a
proxy process, the polish pivot archive, aborts and bounded restarts.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from andrea.config import load_run_config
from andrea.run.proxy import supervise
from conftest import wait_for


def write_run(cfg: dict, parent: Path):
    """Save cfg as <parent>/<exp>/config.yaml; returns (AndreaConfig, run folder)."""
    run = parent / cfg["exp"]
    run.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "results_dir": str(parent)}
    OmegaConf.save(OmegaConf.create(cfg), run / "config.yaml")
    return load_run_config(run / "config.yaml"), run


def read(run: Path, kind: str) -> dict:
    return json.loads((run / f"{run.name}.{kind}.json").read_text())


def steps_of(run: Path) -> list:
    return [r["step"] for r in read(run, "loss")["history"]]


def state_step(run: Path) -> int:
    p = run / f"{run.name}.state.json"
    return read(run, "state")["step"] if p.exists() else -1


@contextmanager
def running_proxy(run: Path, *extra: str):
    """`python -m andrea.run.proxy run` as a process; killed on the way out if a test left it running."""
    proc = subprocess.Popen([sys.executable, "-m", "andrea.run.proxy", str(run), "--no-progress", "--flush", "0",
                             *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finish(proc: subprocess.Popen, timeout: float = 60.0):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_kill9_engine_resumes_bit_identically(tiny_run):
    cfg, tmp = tiny_run
    cfg["train"].update(steps=60, ckpt_every=5, keep_last=3, eval_every=8)
    cfg_a, run_a = write_run(cfg, tmp / "a")
    assert supervise(cfg_a, run_a, flush_s=0, progress=False) == 0

    cfg_b, run_b = write_run(cfg, tmp / "b")
    seen = []

    def kill_at_23(ev, pid):
        seen.append(ev)
        if ev.get("event") == "step" and ev["step"] == 23 and not any(e.get("event") == "resume" for e in seen):
            os.kill(pid, signal.SIGKILL)

    assert supervise(cfg_b, run_b, flush_s=0, progress=False, backoff_s=0.05, on_event=kill_at_23) == 0
    state = read(run_b, "state")
    assert state["status"] == "finished" and state["restarts"] == 1
    resumes = [i for i, e in enumerate(seen) if e["event"] == "resume"]
    assert len(resumes) == 1, resumes
    # the engine may have run some steps ahead of the proxy before the kill landed (its lines wait in
    # the pipe); it resumed from a cadence checkpoint at or after 20, one the first life reached
    resumed_at = seen[resumes[0]]["step"]
    assert resumed_at % 5 == 0 and 20 <= resumed_at < 60
    first_life = [e["step"] for e in seen[:resumes[0]] if e["event"] == "step"]
    assert first_life == list(range(1, max(first_life) + 1)) and max(first_life) >= resumed_at
    assert steps_of(run_b) == list(range(1, 61))
    hist_a, hist_b = read(run_a, "loss")["history"], read(run_b, "loss")["history"]
    assert [r["loss"] for r in hist_b] == [r["loss"] for r in hist_a]
    assert [r.get("val_loss") for r in hist_b] == [r.get("val_loss") for r in hist_a]
    assert sum("val_loss" in r for r in hist_b) == 8  # steps 8, 16, ..., 56 and the last, 60
    final_a = (run_a / "checkpoints" / "step_00000060.bin").read_bytes()
    final_b = (run_b / "checkpoints" / "step_00000060.bin").read_bytes()
    assert final_a == final_b


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_stop_with_checkpoint(tiny_run, sig):
    cfg, tmp = tiny_run
    cfg["train"].update(steps=100000, ckpt_every=0, keep_last=3)
    _, run = write_run(cfg, tmp)
    with running_proxy(run) as proc:
        wait_for(lambda: state_step(run) >= 5, "step 5", proc=proc)
        engine_pid = read(run, "state")["engine_pid"]
        proc.send_signal(sig)
        rc, err = finish(proc)
    assert rc == 0, err
    state = read(run, "state")
    assert state["status"] == "stopped" and state["engine_exit"] == 0 and state["restarts"] == 0
    n = state["last_checkpoint_step"]
    assert 5 <= n < 100000 and state["step"] == n
    assert (run / state["last_checkpoint"]).is_file()
    side = json.loads((run / state["last_checkpoint"]).with_suffix(".json").read_text())
    assert side["reason"] == "signal"
    assert steps_of(run) == list(range(1, n + 1))
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)


def test_sigusr1_checkpoints_and_training_goes_on(tiny_run):
    cfg, tmp = tiny_run
    cfg["train"].update(steps=100000, ckpt_every=0, keep_last=5)
    _, run = write_run(cfg, tmp)
    ckpts = lambda: sorted((run / "checkpoints").glob("step_*.bin")) if (run / "checkpoints").exists() else []
    with running_proxy(run) as proc:
        wait_for(lambda: state_step(run) >= 5, "step 5", proc=proc)
        assert ckpts() == []
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: read(run, "state")["last_checkpoint_step"] is not None, "the SIGUSR1 checkpoint", proc=proc)
        usr1 = read(run, "state")["last_checkpoint_step"]
        wait_for(lambda: state_step(run) >= usr1 + 5, "five more steps", proc=proc)
        assert read(run, "state")["status"] == "running"
        proc.send_signal(signal.SIGTERM)
        rc, err = finish(proc)
    assert rc == 0, err
    names = [p.name for p in ckpts()]
    assert names[0] == f"step_{usr1:08d}.bin" and len(names) == 2, names
    side = json.loads((run / "checkpoints" / f"step_{usr1:08d}.json").read_text())
    assert side["reason"] == "signal"
    state = read(run, "state")
    assert state["status"] == "stopped" and state["last_checkpoint_step"] >= usr1 + 5


def test_pivot_archives_samples_state_and_checkpoint(tiny_run):
    cfg, tmp = tiny_run
    cfg["train"].update(steps=30, ckpt_every=7, keep_last=10,
                        phases=[{"name": "pretrain", "start_step": 0},
                                {"name": "polish", "start_step": 20, "lr": 1e-3}])
    c, run = write_run(cfg, tmp)
    pivots = []
    assert supervise(c, run, flush_s=0, progress=False,
                     on_event=lambda ev, pid: pivots.append(ev) if ev["event"] == "pivot" else None) == 0
    assert len(pivots) == 1 and pivots[0]["from"] == "pretrain" and pivots[0]["to"] == "polish"
    s = pivots[0]["step"]
    arch = run / "archive" / f"pretrain-{s}"
    assert sorted(p.name for p in arch.iterdir()) == sorted(
        ["t.samples.json", "t.state.json", f"step_{s:08d}.bin", f"step_{s:08d}.json"])
    assert not list((run / "archive").rglob("*.loss.json"))
    ckpt = run / "checkpoints" / f"step_{s:08d}.bin"
    assert (arch / ckpt.name).read_bytes() == ckpt.read_bytes()
    assert (arch / ckpt.with_suffix(".json").name).read_bytes() == ckpt.with_suffix(".json").read_bytes()
    archived = json.loads((arch / "t.state.json").read_text())
    assert archived["phase"] == "pretrain" and archived["step"] == s
    assert archived["last_checkpoint"] == f"checkpoints/step_{s:08d}.bin"
    # training went on into the new phase; the history was neither archived nor cut
    hist = read(run, "loss")["history"]
    assert [r["step"] for r in hist] == list(range(1, 31))
    assert {r["phase"] for r in hist if r["step"] <= s} == {"pretrain"}
    assert {r["phase"] for r in hist if r["step"] > s} == {"polish"}
    state = read(run, "state")
    assert state["status"] == "finished" and state["phase"] == "polish"
    assert state["archives"] == [{"phase": "pretrain", "step": s, "dir": f"archive/pretrain-{s}"}]


def test_abort_exit_3_is_failed_without_restart(tiny_run):
    cfg, tmp = tiny_run
    # an absurd learning rate makes every step non-finite after the first updates
    cfg["train"].update(steps=40, lr=1e38, warmup_steps=0, grad_clip=0.0, max_bad_steps=3)
    c, run = write_run(cfg, tmp)
    assert supervise(c, run, flush_s=0, progress=False, backoff_s=0.01) == 3
    state = read(run, "state")
    assert state["status"] == "failed" and state["engine_exit"] == 3 and state["restarts"] == 0
    hist = read(run, "loss")["history"]
    assert hist[-1]["skipped"] is True and hist[-1]["loss"] is None  # NaN is stored as null


@pytest.fixture
def crashing_engine(tmp_path, monkeypatch):
    """Every engine process started from here on exits 1 at once (a sitecustomize on PYTHONPATH that
    ends `python -m andrea.cli engine ...` before it imports anything): an engine that keeps crashing.
    (A checkpoints path that is a file no longer serves: the engine refuses it at start with exit 2.)"""
    site = tmp_path / "crash-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os, sys\nif sys.argv[1:2] == ['engine']:\n    os._exit(1)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return site


def test_crashing_engine_gives_up_after_bounded_restarts(tiny_run, crashing_engine):
    cfg, tmp = tiny_run
    c, run = write_run(cfg, tmp)
    t0 = time.monotonic()
    assert supervise(c, run, flush_s=0, progress=False, max_restarts=2, backoff_s=0.05) == 1
    state = read(run, "state")
    assert state["status"] == "failed" and state["restarts"] == 2
    assert state["engine_exit"] not in (0, 2, 3)
    assert "gave up after 2 restarts" in state["message"]
    assert time.monotonic() - t0 >= 0.05 + 0.1  # back-off doubles: 0.05 s then 0.1 s


def test_sigterm_during_restart_backoff_stops_at_once(tiny_run, crashing_engine):
    cfg, tmp = tiny_run
    _, run = write_run(cfg, tmp)
    with running_proxy(run, "--backoff", "60") as proc:
        wait_for(lambda: (run / "t.state.json").exists() and "restart 1 in 60.0 s" in read(run, "state")["message"],
                 "the first back-off", proc=proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc, err = finish(proc, timeout=20)
    assert rc == 0, err
    assert time.monotonic() - t0 < 10  # not the 60 s back-off
    state = read(run, "state")
    assert state["status"] == "stopped" and state["restarts"] == 0  # the restart never happened


def test_progress_bar_on_stderr(tiny_run):
    cfg, tmp = tiny_run
    cfg["train"].update(steps=20)
    _, run = write_run(cfg, tmp)
    r = subprocess.run([sys.executable, "-m", "andrea.run.proxy", str(run)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    final = r.stderr.replace("\r", "\n").splitlines()
    bars = [ln for ln in final if ln.startswith("t: ") and "20/20" in ln]
    assert bars, r.stderr[-2000:]
    # step count, elapsed<remaining (the ETA), loss, tokens/s and phase
    assert re.search(r"20/20 \[\d\d:\d\d<\d\d:\d\d.*loss=\d+\.\d{4}.*phase=pretrain.*tok_s=[\d,]+", bars[-1]), bars[-1]
    assert r.stdout == ""  # stdout stays free for whoever runs the proxy


def test_bad_input_exit_2_is_failed_without_restart(tiny_run):
    """Missing shards (or a config the checkpoint does not match) fail at once: no back-off."""
    cfg, tmp = tiny_run
    cfg["data"]["train_shards"] = str(tmp / "missing" / "train_*.bin")
    c, run = write_run(cfg, tmp)
    t0 = time.monotonic()
    assert supervise(c, run, flush_s=0, progress=False, backoff_s=5.0) == 2
    state = read(run, "state")
    assert state["status"] == "failed" and state["engine_exit"] == 2 and state["restarts"] == 0
    assert time.monotonic() - t0 < 5.0  # never waited for a restart
