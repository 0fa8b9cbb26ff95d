"""The proxy's record files: start-up checks of existing files, atomic writes, resume bookkeeping."""
import json
import os
import signal
import subprocess
import sys
import pytest

from andrea.util.atomic import atomic_write_json
from andrea.run.proxy import RecordError, RunRecords, supervise
from test_proxy import read, running_proxy, finish, state_step, wait_for, write_run

GOOD = {"format": "andrea-loss/1", "exp": "t", "total_steps": 12,
        "history": [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.9}]}


@pytest.mark.parametrize("kind,text,expect", [
    ("loss", json.dumps(GOOD)[:-17], "not valid JSON"),  # cut off mid-write
    ("loss", "", "not valid JSON"),
    ("loss", json.dumps({**GOOD, "history": [{"step": 2}, {"step": 2}]}), "history[1].step is 2"),
    ("loss", json.dumps({**GOOD, "history": [{"loss": 1.0}]}), "history[0].step is None"),
    ("loss", json.dumps({**GOOD, "exp": "other"}), "exp is 'other'"),
    ("loss", json.dumps([1, 2]), "expected a JSON object"),
    ("samples", '{"exp": "t", "samples": [{"step": 3}', "not valid JSON"),
    ("state", "\x00\x00\x00", "not valid JSON"),
])
def test_corrupt_record_stops_before_the_engine_starts(tiny_run, kind, text, expect):
    cfg, tmp = tiny_run
    c, run = write_run(cfg, tmp)
    bad = run / f"t.{kind}.json"
    bad.write_text(text)
    with pytest.raises(RecordError) as e:
        supervise(c, run, flush_s=0, progress=False)
    msg = str(e.value)
    assert str(bad) in msg and expect in msg, msg
    assert bad.read_text() == text  # reported, not reset
    assert not (run / "checkpoints").exists()  # the engine never ran


def test_corrupt_history_cli_exits_2_naming_the_file(tiny_run):
    cfg, tmp = tiny_run
    _, run = write_run(cfg, tmp)
    (run / "t.loss.json").write_text('{"exp": "t", "history": [{"step": 1, "lo')
    r = subprocess.run([sys.executable, "-m", "andrea.run.proxy", str(run), "--no-progress"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert str(run / "t.loss.json") in r.stderr and "not valid JSON" in r.stderr


def test_existing_history_is_kept_and_continued(tiny_run):
    """A second proxy session on a stopped run appends to its history; it does not start over."""
    cfg, tmp = tiny_run
    # long enough that the engine, which may run ahead of the proxy by a few lines, is still going
    cfg["train"].update(steps=120, ckpt_every=0)
    c, run = write_run(cfg, tmp)

    def stop_at_7(ev, pid):
        if ev["event"] == "step" and ev["step"] == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # to the proxy itself, which forwards it

    assert supervise(c, run, flush_s=0, progress=False, on_event=stop_at_7) == 0
    first = read(run, "loss")["history"]
    assert read(run, "state")["status"] == "stopped" and 7 <= len(first) < 120
    assert supervise(c, run, flush_s=0, progress=False) == 0
    hist = read(run, "loss")["history"]
    assert [r["step"] for r in hist] == list(range(1, 121))
    assert hist[:len(first)] == first  # the first session's records, untouched (same times too)
    assert read(run, "state")["status"] == "finished"


def test_external_kill9_keeps_history_continuous(tiny_run):
    cfg, tmp = tiny_run
    cfg["train"].update(steps=100000, ckpt_every=5, keep_last=3)
    _, run = write_run(cfg, tmp)
    with running_proxy(run, "--backoff", "0.05") as proc:
        wait_for(lambda: state_step(run) >= 12, "step 12", proc=proc)
        os.kill(read(run, "state")["engine_pid"], signal.SIGKILL)
        wait_for(lambda: read(run, "state")["restarts"] == 1 and state_step(run) >= 25, "restart", proc=proc)
        proc.send_signal(signal.SIGTERM)
        rc, err = finish(proc)
    assert rc == 0, err
    state = read(run, "state")
    assert state["status"] == "stopped" and state["restarts"] == 1
    assert [r["step"] for r in read(run, "loss")["history"]] == list(range(1, state["step"] + 1))


def test_records_resume_bookkeeping(tmp_path):
    rec = RunRecords("x", tmp_path, 10, flush_s=0)
    for n in (1, 2, 3):
        rec.add_step({"step": n, "phase": "pretrain", "loss": 5.0 - n, "lr": 1e-3})
    rec.add_val({"step": 2, "val_loss": 2.5})
    rec.add_val({"step": 4, "val_loss": 2.4})  # validation before its step record
    rec.add_step({"step": 4, "phase": "pretrain", "loss": float("nan"), "lr": 1e-3, "skipped": True})
    rec.add_samples({"step": 4, "samples": [{"prompt": "a", "completion": "b"}]})
    assert [(r["step"], r.get("val_loss"), r["loss"]) for r in rec.history] == [
        (1, None, 4.0), (2, 2.5, 3.0), (3, None, 2.0), (4, 2.4, None)]
    assert rec.drop_from(3) == 2 and rec.samples == []
    rec.add_step({"step": 3, "phase": "pretrain", "loss": 2.0, "lr": 1e-3})
    rec.add_step({"step": 2, "phase": "pretrain", "loss": 3.0, "lr": 1e-3})  # replay without a resume
    assert [r["step"] for r in rec.history] == [1, 2]
    rec.flush(force=True)
    on_disk = json.loads((tmp_path / "x.loss.json").read_text())
    assert on_disk["history"] == rec.history and on_disk["exp"] == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.loss.json", "x.loss.jsonl", "x.samples.json", "x.state.json"]


def test_flush_is_throttled_but_forced_writes_happen(tmp_path):
    rec = RunRecords("x", tmp_path, 10, flush_s=3600)
    rec.add_step({"step": 1, "loss": 1.0})
    rec.flush(force=True)
    rec.add_step({"step": 2, "loss": 1.0})
    rec.flush()
    assert len(json.loads((tmp_path / "x.loss.json").read_text())["history"]) == 1
    rec.flush(force=True)
    assert len(json.loads((tmp_path / "x.loss.json").read_text())["history"]) == 2


def test_atomic_write_refuses_nan_and_leaves_old_file(tmp_path):
    p = tmp_path / "a.json"
    atomic_write_json(p, {"v": 1})
    with pytest.raises(ValueError):
        atomic_write_json(p, {"v": float("nan")})
    assert json.loads(p.read_text()) == {"v": 1}


def test_second_proxy_on_the_same_run_is_refused(tiny_run):
    cfg, tmp = tiny_run
    cfg["train"].update(steps=100000, ckpt_every=0)
    c, run = write_run(cfg, tmp)
    with running_proxy(run) as proc:
        wait_for(lambda: state_step(run) >= 2, "step 2", proc=proc)
        with pytest.raises(RuntimeError, match="another proxy"):
            supervise(c, run, flush_s=0, progress=False)
        proc.send_signal(signal.SIGTERM)
        rc, err = finish(proc)
    assert rc == 0, err


def test_proxy_error_stops_the_engine_and_says_failed(tiny_run):
    cfg, tmp = tiny_run
    cfg["train"].update(steps=100000, ckpt_every=0)
    c, run = write_run(cfg, tmp)
    pids = []

    def explode(ev, pid):
        pids.append(pid)
        if ev["event"] == "step" and ev["step"] == 3:
            raise RuntimeError("monitor failed")

    with pytest.raises(RuntimeError, match="monitor failed"):
        supervise(c, run, flush_s=0, progress=False, on_event=explode)
    state = read(run, "state")
    assert state["status"] == "failed" and "monitor failed" in state["message"]
    with pytest.raises(ProcessLookupError):
        os.kill(pids[-1], 0)  # the engine was stopped and reaped, not left training
