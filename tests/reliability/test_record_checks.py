"""The proxy's start-up check of the run records: wrong field types and missing logged steps are
refused with the file, the entry and what was expected, and the file is left as it was."""
import json

import pytest

from andrea.run.proxy import RecordError, RunRecords
from relkit import make_shards, run_proxy, write_run


def history(records, log_every=1):
    return {"format": "andrea-loss/1", "exp": "x", "total_steps": 10, "log_every": log_every, "history": records}


def rec(step, **kw):
    return {"step": step, "phase": "pretrain", "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "loss_scale": 1.0,
            "tokens_per_s": 5.0, "wall_s": 0.1, "skipped": False, "t": 1.0, **kw}


BAD_HISTORY = {
    "loss is a string": ([rec(1), rec(2, loss="0.5")], "history[1].loss"),
    "lr is a list": ([rec(1, lr=[1])], "history[0].lr"),
    "skipped is a number": ([rec(1, skipped=0)], "history[0].skipped"),
    "phase is a number": ([rec(1, phase=3)], "history[0].phase"),
    "val_loss is a string": ([rec(1, val_loss="nan")], "history[0].val_loss"),
    "step is a bool": ([{"step": True, "loss": 1.0}], "history[0].step"),
    "step is a float": ([rec(1), rec(2.0)], "history[1].step"),
    "a record is a list": ([rec(1), [2, 1.0]], "history[1].step"),
    "steps repeat": ([rec(1), rec(2), rec(2)], "history[2].step"),
    "step 3 missing": ([rec(1), rec(2), rec(4)], "missing (3)"),
    "steps 1-2 missing": ([rec(3)], "missing (1, 2)"),
}


@pytest.mark.parametrize("case", sorted(BAD_HISTORY))
def test_bad_history_is_refused_naming_the_entry(tmp_path, case):
    records, where = BAD_HISTORY[case]
    path = tmp_path / "x.loss.json"
    path.write_text(json.dumps(history(records)))
    before = path.read_bytes()
    with pytest.raises(RecordError) as e:
        RunRecords("x", tmp_path, 10)
    assert str(path) in str(e.value) and where in str(e.value) and "expected" in str(e.value), str(e.value)
    assert path.read_bytes() == before


def test_gaps_follow_log_every_and_validation_only_records_are_fine(tmp_path):
    path = tmp_path / "x.loss.json"
    ok = [rec(5), {"step": 8, "phase": "pretrain", "val_loss": 2.0}, rec(10), rec(13, skipped=True, loss=None)]
    path.write_text(json.dumps(history(ok, log_every=5)))
    assert [r["step"] for r in RunRecords("x", tmp_path, 20, log_every=5).history] == [5, 8, 10, 13]
    path.write_text(json.dumps(history([rec(5), rec(15)], log_every=5)))
    with pytest.raises(RecordError, match=r"missing \(10\)"):
        RunRecords("x", tmp_path, 20, log_every=5)


def test_a_changed_log_every_keeps_a_checkable_history(tmp_path):
    path = tmp_path / "x.loss.json"
    path.write_text(json.dumps(history([rec(s) for s in (2, 4, 6)], log_every=2)))
    r = RunRecords("x", tmp_path, 20, flush_s=0, log_every=3)
    for s in (7, 9, 12):
        r.add_step({"step": s, "loss": 1.0})
    r.flush(force=True)
    assert json.loads(path.read_text())["log_every"] == 6  # multiples of 6 are in both parts
    RunRecords("x", tmp_path, 20, log_every=3)


BAD_STATE = {"restarts": -1, "status": "done", "last_checkpoint_step": "8", "archives": [{"phase": "p"}],
             "skipped_checkpoints": "none"}


@pytest.mark.parametrize("field", sorted(BAD_STATE))
def test_bad_state_field_is_refused(tmp_path, field):
    (tmp_path / "x.state.json").write_text(json.dumps({"exp": "x", field: BAD_STATE[field]}))
    with pytest.raises(RecordError) as e:
        RunRecords("x", tmp_path, 10)
    assert field in str(e.value) and "expected" in str(e.value)


def test_bad_samples_are_refused(tmp_path):
    (tmp_path / "x.samples.json").write_text(json.dumps(
        {"exp": "x", "samples": [{"step": 4, "samples": [{"prompt": "q", "completion": 7}]}]}))
    with pytest.raises(RecordError, match=r"samples\[0\]\.samples"):
        RunRecords("x", tmp_path, 10)


def test_proxy_cli_refuses_a_history_with_a_gap_and_changes_nothing(tmp_path):
    make_shards(tmp_path)
    run = write_run(tmp_path, steps=6, ckpt_every=3)
    assert run_proxy(run).returncode == 0
    path = run / "t.loss.json"
    obj = json.loads(path.read_text())
    obj["history"] = [r for r in obj["history"] if r["step"] != 2]
    path.write_text(json.dumps(obj))
    before = path.read_bytes()
    r = run_proxy(run)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "t.loss.json" in r.stderr and "missing (2)" in r.stderr
    assert path.read_bytes() == before
