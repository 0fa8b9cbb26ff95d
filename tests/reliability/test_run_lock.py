"""A second `andrea.train` on a live run folder is refused before it reads or writes anything:
the first run's config is never replaced, so a restarted engine keeps training the first run."""
import json
import os
import signal
import subprocess
import sys

from andrea.core import checkpoint as ck
from relkit import REPO, env, make_shards, pid_alive, wait_for


def overrides(tmp_path, steps):
    d = tmp_path / "shards"
    return [f"data.train_shards={d}/train_*.bin", f"data.val_shards={d}/val_*.bin",
            f"data.tokenizer={tmp_path}/none.json", f"train.steps={steps}", "train.eval_every=0",
            "train.sample_every=0", "train.ckpt_every=20", "train.seq_len=16", "train.batch_size=2",
            "backend=numpy", f"results_dir={tmp_path}/results", "proxy.restart_backoff_s=0.1",
            "exp=ANDREA-tiny"]  # named: the run stays in results/ANDREA-tiny whatever the overrides


def train_cmd(*args):
    return [sys.executable, "-m", "andrea.train", "experiment=ANDREA-tiny", *args]


def test_refused_second_run_touches_nothing_and_the_first_keeps_its_settings(tmp_path):
    make_shards(tmp_path, vocab=512)
    ov = overrides(tmp_path, 100000)
    run = tmp_path / "results" / "ANDREA-tiny"
    first = subprocess.Popen(train_cmd(*ov), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        state = run / "ANDREA-tiny.state.json"
        wait_for(lambda: state.exists() and json.loads(state.read_text()).get("engine_pid"), "the first run",
                 timeout=120, proc=first)
        config = run / "config.yaml"
        before = (config.read_bytes(), config.stat().st_mtime_ns)
        second = subprocess.run(train_cmd(*ov, "train.lr=1e-3"), cwd=REPO, env=env(), capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2
        assert ".proxy.lock" in second.stderr and "nothing was changed" in second.stderr
        assert "Traceback" not in second.stderr
        assert (config.read_bytes(), config.stat().st_mtime_ns) == before
        engine = json.loads(state.read_text())["engine_pid"]
        os.kill(engine, signal.SIGKILL)  # the first run's proxy restarts it from config.yaml
        wait_for(lambda: not pid_alive(engine), "the engine to die")
        wait_for(lambda: json.loads(state.read_text()).get("restarts") == 1 and
                 json.loads(state.read_text()).get("engine_pid") not in (None, engine), "the restart", proc=first)
        first.send_signal(signal.SIGTERM)
        err = first.communicate(timeout=300)[1]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 75, err[-3000:]  # stopped before its last step: the same command resumes it
    assert json.loads(state.read_text())["status"] == "stopped"
    assert (config.read_bytes(), config.stat().st_mtime_ns) == before
    from andrea.config import config_hash, load_run_config
    ours = config_hash(load_run_config(config))
    for p in ck.list_checkpoints(run / "checkpoints"):
        assert json.loads(ck.sidecar_path(p).read_text())["config_hash"] == ours
