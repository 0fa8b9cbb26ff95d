"""Kills at random moments of the proxy and of the engine: after a restart the final checkpoint is
bit-identical to an uninterrupted run's and the history has every step exactly once, with its
validation loss and samples. The engine never outlives its proxy, stops on a closed pipe without
writing a checkpoint, and holds its own lock.

The randomized loops run relkit.TRIALS trials each (2 by default; ANDREA_RELIABILITY_TRIALS=10 for
more); each prints one line with its tally (pytest -s shows them).
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from andrea.core import checkpoint as ck
from relkit import TRIALS, env, make_shards, pid_alive, proxy_cmd, read, run_proxy, wait_for, write_run

STEPS, EVAL, SAMPLE = 100, 4, 6
SETTINGS = dict(steps=STEPS, ckpt_every=5, keep_last=3, eval_every=EVAL, sample_every=SAMPLE)
FINAL = f"checkpoints/step_{STEPS:08d}.bin"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run of the same config: the bytes every interrupted run must end with."""
    tmp = tmp_path_factory.mktemp("straight")
    make_shards(tmp)
    run = write_run(tmp, **SETTINGS)
    r = run_proxy(run)
    assert r.returncode == 0, r.stderr
    return tmp, run


def check_whole(run, straight_run):
    """Same final bytes; each step once, val_loss at every eval step, samples at every sample step."""
    assert (run / FINAL).read_bytes() == (straight_run / FINAL).read_bytes()
    hist = read(run, "loss")["history"]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    assert [h["step"] for h in hist if h.get("val_loss") is not None] == \
        [s for s in range(1, STEPS + 1) if s % EVAL == 0 or s == STEPS]
    ref = {h["step"]: h for h in read(straight_run, "loss")["history"]}
    for h in hist:  # the numbers of the checkpointed trajectory, not of a lost branch
        assert h["loss"] == ref[h["step"]]["loss"] and h.get("val_loss") == ref[h["step"]].get("val_loss")
    assert [s["step"] for s in read(run, "samples")["samples"]] == \
        [s for s in range(1, STEPS + 1) if s % SAMPLE == 0 or s == STEPS]


def start_proxy(run):
    return subprocess.Popen(proxy_cmd(run), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())


def engine_pid(run, proc):
    wait_for(lambda: (run / "t.state.json").exists() and read(run, "state").get("engine_pid"), "the engine",
             proc=proc)
    return read(run, "state")["engine_pid"]


def test_kill9_of_the_proxy_at_random_moments(straight, tmp_path):
    shards_home, ref = straight
    rng = random.Random(int(os.environ.get("ANDREA_RELIABILITY_SEED", "9")))
    exact = kills = 0
    for trial in range(TRIALS):
        run = write_run(shards_home, run_dir=tmp_path / f"k{trial}" / "t", **SETTINGS)
        for _ in range(2):  # two kills per trial, then a clean finish
            proc = start_proxy(run)
            eng = engine_pid(run, proc)
            time.sleep(rng.uniform(0.0, 0.8))
            if proc.poll() is None:
                proc.kill()
                kills += 1
            proc.wait()
            proc.stderr.close()
            wait_for(lambda: not pid_alive(eng), "the orphaned engine to die", timeout=10)
        r = run_proxy(run)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr
        check_whole(run, ref)
        exact += 1
    print(f"\nproxy kill -9: {TRIALS} trials ({kills} kills), resumed bit-exact with a whole history: {exact}")


def test_kill9_of_the_engine_at_random_moments(straight, tmp_path):
    shards_home, ref = straight
    rng = random.Random(int(os.environ.get("ANDREA_RELIABILITY_SEED", "9")) + 1)
    exact = killed = 0
    for trial in range(TRIALS):
        run = write_run(shards_home, run_dir=tmp_path / f"e{trial}" / "t", **SETTINGS)
        proc = subprocess.Popen(proxy_cmd(run, "--backoff", "0.05"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=env())
        try:
            for _ in range(2):
                eng = engine_pid(run, proc)
                time.sleep(rng.uniform(0.0, 0.6))
                try:
                    os.kill(eng, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    break
                wait_for(lambda: read(run, "state").get("engine_pid") not in (None, eng) or proc.poll() is not None,
                         "the restarted engine", proc=None)
            err = proc.communicate(timeout=120)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, err
        check_whole(run, ref)
        exact += 1
    print(f"\nengine kill -9: {TRIALS} trials ({killed} kills), resumed bit-exact with a whole history: {exact}")


def test_sigterm_to_the_proxy_at_random_moments(straight, tmp_path):
    shards_home, ref = straight
    rng = random.Random(int(os.environ.get("ANDREA_RELIABILITY_SEED", "9")) + 2)
    exact = 0
    for trial in range(TRIALS):
        run = write_run(shards_home, run_dir=tmp_path / f"s{trial}" / "t", **SETTINGS)
        proc = start_proxy(run)
        engine_pid(run, proc)
        time.sleep(rng.uniform(0.0, 0.8))
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
        assert proc.returncode == 0, err
        assert read(run, "state")["status"] in ("stopped", "finished")
        r = run_proxy(run)
        assert r.returncode == 0, r.stderr
        check_whole(run, ref)
        exact += 1
    print(f"\nproxy SIGTERM: {TRIALS} trials, resumed bit-exact with a whole history: {exact}")


def test_the_engine_dies_with_its_proxy(tmp_path):
    make_shards(tmp_path)
    run = write_run(tmp_path, steps=100000, ckpt_every=50)
    proc = start_proxy(run)
    try:
        eng = engine_pid(run, proc)
        wait_for(lambda: read(run, "state").get("step", 0) >= 3, "a few steps", proc=proc)
        proc.kill()
        proc.wait()
        wait_for(lambda: not pid_alive(eng), "the engine to die with its proxy", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.mark.parametrize("noticed_by", ["the next event", "a checkpoint request"])
def test_a_closed_pipe_stops_the_engine_without_a_checkpoint(tmp_path, noticed_by):
    """The proxy's end of the pipe closes; the engine stops at the next event it would print, or
    at the next checkpoint it would write (SIGUSR1 asks for one; it logs rarely), writing none."""
    make_shards(tmp_path)
    log_every = 1 if noticed_by == "the next event" else 10 ** 6
    run = write_run(tmp_path, steps=10 ** 6, ckpt_every=0, log_every=log_every)
    p = subprocess.Popen([sys.executable, "-m", "andrea.cli", "engine", "--config", str(run / "config.yaml"),
                          "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        assert json.loads(p.stdout.readline())["event"] == "plan"
        p.stdout.close()
        if noticed_by == "a checkpoint request":
            time.sleep(0.3)
            p.send_signal(signal.SIGUSR1)
        p.wait(timeout=60)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()
    assert p.returncode == 5, err
    assert "stdout is closed" in err and "Traceback" not in err, err
    assert not (run / "checkpoints").exists() or list((run / "checkpoints").iterdir()) == []


def test_a_second_engine_on_the_same_run_is_refused(tmp_path):
    make_shards(tmp_path)
    run = write_run(tmp_path, steps=100000, ckpt_every=0)
    cmd = [sys.executable, "-m", "andrea.cli", "engine", "--config", str(run / "config.yaml"), "--run-dir", str(run)]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env())
    try:
        first.stdout.readline()  # the plan: it holds the lock
        second = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=60,
                                env={**env(), "ANDREA_ENGINE_LOCK_WAIT_S": "0.5"})
        assert second.returncode == 2
        assert ".engine.lock" in second.stderr and "Traceback" not in second.stderr
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()
        first.stdout.close()
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())


def test_progress_rate_is_never_negative_after_a_resume(tmp_path, capsys):
    import re

    from tqdm import tqdm

    from andrea.config import load_run_config
    from andrea.run.proxy import Supervisor

    make_shards(tmp_path)
    run = write_run(tmp_path, steps=200)
    (run / "t.loss.json").write_text(json.dumps({"exp": "t", "history": [{"step": s, "loss": 1.0} for s in range(1, 51)]}))
    sup = Supervisor(load_run_config(run / "config.yaml"), run, max_restarts=0, backoff_s=0, backoff_max_s=0,
                     flush_s=3600, progress=True, on_event=None, engine_argv=["true"])
    try:
        time.sleep(0.2)
        sup._progress(None, reset_to=40)  # resumed from the checkpoint of step 40
        rates = []
        for s in range(41, 46):
            time.sleep(0.02)
            sup._progress({"step": s, "loss": 1.0, "tokens_per_s": 1.0, "phase": "pretrain"})
            line = tqdm.format_meter(**sup.bar.format_dict)
            rates += [float(x) for x in re.findall(r"(-?[\d.]+)(?:step/s|s/step)", line)]
        assert sup.bar.n == 45
    finally:
        sup.bar.close()
    shown = capsys.readouterr().err  # every refresh the bar drew, the resume's included
    rates += [float(x) for x in re.findall(r"(-?[\d.]+)(?:step/s|s/step)", shown)]
    assert rates and min(rates) >= 0, rates
    assert "<-" not in shown, shown
