"""The history at scale, checked by structure rather than by time: a flush writes bytes in
proportion to the new records only, the proxy's memory does not grow with the history, loss.json
is the whole history and never half-written, a torn last journal line is dropped with the records
before it kept, and a loss.json someone changed is refused rather than overwritten."""
import gc
import json
import tracemalloc

import pytest

from andrea.run.proxy import RecordError, RunRecords

BATCH = 50  # records between two flushes


def step(n):
    return {"step": n, "phase": "pretrain", "loss": 2.5, "lr": 3e-4, "grad_norm": 0.5, "loss_scale": 1.0,
            "tokens_per_s": 1000.0, "wall_s": 1.0}


def written() -> int:
    """Bytes this process has passed to write(2) so far (Linux)."""
    with open("/proc/self/io") as f:
        return int(next(ln for ln in f if ln.startswith("wchar:")).split()[1])


def test_flush_cost_and_memory_do_not_grow_with_the_history(tmp_path, monkeypatch):
    from andrea.run.proxy import records

    # a history past the size whose loss.json every flush rewrites (a few hundred kilobytes)
    monkeypatch.setattr(records, "SMALL_HISTORY", 0, raising=False)
    rec = RunRecords("x", tmp_path, 10 ** 6, flush_s=0)
    n, per_flush = 1000, []  # steps 1000..: every record line has the same length
    tracemalloc.start()
    try:
        for rnd in range(120):
            for _ in range(BATCH):
                rec.add_step(step(n))
                n += 1
            before = written()
            rec.flush()
            per_flush.append(written() - before)
            if rnd == 20:
                gc.collect()
                early = tracemalloc.get_traced_memory()[0]
        gc.collect()
        late = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # 6,000 records of ~200 bytes: a history held in memory would add more than a megabyte
    assert late - early < 100_000, (early, late)
    assert max(per_flush[-10:]) < 1.2 * min(per_flush[:10]), per_flush  # the 120th flush writes what the 1st did
    rec.flush(force=True, whole=True)
    hist = json.loads(rec.loss_path.read_text())["history"]
    assert [h["step"] for h in hist] == list(range(1000, n)) and hist == rec.history


def flushed(folder, last: int) -> RunRecords:
    """The records of steps 1..last of run x in folder, flushed to its journal."""
    rec = RunRecords("x", folder, 100, flush_s=0)
    for s in range(1, last + 1):
        rec.add_step(step(s))
    rec.flush(force=True)
    return rec


def test_a_torn_last_journal_line_is_dropped_and_the_records_before_it_kept(tmp_path):
    rec = flushed(tmp_path, 10)
    whole = rec.journal_path.read_bytes()
    with open(rec.journal_path, "ab") as f:
        f.write(b'{"step":11,"phase":"pretrain","lo')  # a kill in the middle of an append
    again = RunRecords("x", tmp_path, 100, flush_s=0)
    assert again.last_step() == 10 and again.n_records == 10
    assert rec.journal_path.read_bytes() == whole
    assert any("last line" in note and "dropped" in note and "10 record(s) before it are kept" in note
               for note in again.notes), again.notes
    again.add_step(step(11))
    again.flush(force=True)
    assert [h["step"] for h in json.loads(again.loss_path.read_text())["history"]] == list(range(1, 12))


def test_a_garbled_line_inside_the_journal_is_refused_naming_it(tmp_path):
    rec = flushed(tmp_path, 5)
    lines = rec.journal_path.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"step":3,"loss":"high"}\n'
    rec.journal_path.write_bytes(b"".join(lines))
    with pytest.raises(RecordError) as e:
        RunRecords("x", tmp_path, 100)
    assert str(rec.journal_path) in str(e.value) and "line 3" in str(e.value) and "loss" in str(e.value)


def test_an_older_loss_json_is_the_proxy_s_own_and_a_changed_one_is_refused(tmp_path):
    rec = flushed(tmp_path, 5)
    older = rec.loss_path.read_bytes()
    for s in range(6, 11):
        rec.add_step(step(s))
    rec.flush(force=True)
    rec.loss_path.write_bytes(older)  # as a kill before the last rewrite would leave it
    assert RunRecords("x", tmp_path, 100).n_records == 10
    state = json.loads(rec.state_path.read_text())
    del state["history_sha256"]  # no sum to know it by: its records are the journal's first ones
    rec.state_path.write_text(json.dumps(state))
    assert RunRecords("x", tmp_path, 100).n_records == 10
    obj = json.loads(older)
    obj["history"][2]["loss"] = 0.1  # someone's edit
    rec.loss_path.write_text(json.dumps(obj))
    edited, journal = rec.loss_path.read_bytes(), rec.journal_path.read_bytes()
    with pytest.raises(RecordError) as e:
        RunRecords("x", tmp_path, 100)
    assert "history[2] (step 3) differs from the history journal" in str(e.value), str(e.value)
    assert rec.loss_path.read_bytes() == edited and rec.journal_path.read_bytes() == journal


def test_a_restart_cuts_the_journal_back_to_the_resume_point(tmp_path):
    rec = RunRecords("x", tmp_path, 100, flush_s=0)
    for s in range(1, 21):
        rec.add_step(step(s))
        if s % 5 == 0:
            rec.add_val({"step": s, "val_loss": 1.0 + s})
            rec.flush(force=True)
    assert rec.drop_from(13) == 8  # resumed from the checkpoint of step 12
    for s in range(13, 16):
        rec.add_step(step(s))
    rec.add_val({"step": 15, "val_loss": 9.0})
    rec.flush(force=True)
    hist = json.loads(rec.loss_path.read_text())["history"]
    assert [h["step"] for h in hist] == list(range(1, 16))
    assert [(h["step"], h["val_loss"]) for h in hist if "val_loss" in h] == [(5, 6.0), (10, 11.0), (15, 9.0)]
    again = RunRecords("x", tmp_path, 100)
    assert again.history == hist and again.last_step() == 15


def test_a_late_validation_loses_no_record_to_a_kill_before_the_next_flush(tmp_path):
    """A validation of an earlier step takes the records after it back into memory; the journal
    keeps them on disk until the next flush rewrites them, so a kill in between loses none."""
    rec = flushed(tmp_path, 10)
    on_disk = rec.journal_path.read_bytes()
    rec.add_val({"step": 4, "val_loss": 3.5})  # out of order: steps 4..10 are back in memory
    assert rec.journal_path.read_bytes() == on_disk
    killed = RunRecords("x", tmp_path, 100)  # the proxy killed here: a new one opens the folder
    assert [h["step"] for h in killed.history] == list(range(1, 11))
    rec.flush(force=True)
    hist = RunRecords("x", tmp_path, 100).history
    assert [h["step"] for h in hist] == list(range(1, 11))
    assert [(h["step"], h["val_loss"]) for h in hist if "val_loss" in h] == [(4, 3.5)]


def test_the_dashboard_serves_a_long_history_downsampled_with_its_spikes(tmp_path):
    import threading
    import urllib.request

    from andrea.pipeline.dashboard import DashboardServer
    from andrea.run.proxy.journal import Journal, encode

    run = tmp_path / "x"
    run.mkdir()
    (run / "config.yaml").write_text("exp: x\n")
    j = Journal(run / "x.loss.jsonl")

    def rec(s):
        r = {**step(s), "loss": 50.0 if s == 12345 else 0.001 if s == 7777 else 2.0 + (s % 10) * 0.01,
             "phase": "pretrain" if s < 15000 else "sft"}
        return {**r, "val_loss": 1.5 + (s == 9000)} if s % 500 == 0 else r

    j.append([encode(rec(s)) for s in range(1, 20001)])
    srv = DashboardServer([run], "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def get(headers=None):
        req = urllib.request.Request(srv.url + "runs/0/x.loss.json", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers.get("ETag"), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("ETag"), None

    try:
        st, etag, obj = get()
        assert st == 200 and obj["downsampled"]["records"] == 20000, obj["downsampled"]
        steps = {h["step"]: h for h in obj["history"]}
        assert len(steps) <= 7 * 1000 and obj["downsampled"]["bucket_steps"] == 32
        assert steps[12345]["loss"] == 50.0 and steps[7777]["loss"] == 0.001  # the spike and the dip survive
        assert steps[9000]["val_loss"] == 2.5 and 14999 in steps and steps[15000]["phase"] == "sft"
        assert max(steps) == 20000 and sorted(steps) == [h["step"] for h in obj["history"]]
        assert get({"If-None-Match": etag})[0] == 304
        j.append([encode(rec(s)) for s in range(20001, 20101)])  # the run goes on: read from where it was
        st, _, obj = get({"If-None-Match": etag})
        assert st == 200 and obj["downsampled"]["records"] == 20100 and obj["history"][-1]["step"] == 20100
        j.truncate_from(101)  # a restart that resumed at step 100: read again from the start
        st, _, obj = get()
        assert obj["downsampled"] is None and [h["step"] for h in obj["history"]] == list(range(1, 101))
        assert obj["history"] == [json.loads(ln) for ln in j.records()]
    finally:
        srv.shutdown()
        srv.server_close()
