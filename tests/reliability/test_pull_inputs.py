"""scripts/pull-hermes3.py on hostile input: a line nested too deeply for the JSON parser is a
skipped row, a whole file nested too deeply is a clear error, and no failure leaves a temporary
parquet behind."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]
PULL = REPO / "scripts" / "pull-hermes3.py"
GOOD = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
DEEP = "[" * 200_000 + "]" * 200_000


def pull(tmp_path, data):
    cfg = tmp_path / "pull.yaml"
    cfg.write_text(json.dumps({"data": data}))
    out, rep = tmp_path / "raw" / "c.parquet", tmp_path / "raw" / "report.json"
    r = subprocess.run([sys.executable, str(PULL), "--config", str(cfg), "--out", str(out), "--report", str(rep)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    return r, out, rep


def leftovers(tmp_path):
    return sorted(p.name for p in (tmp_path / "raw").iterdir() if p.name.endswith(".tmp"))


def test_deeply_nested_jsonl_line_is_skipped_and_counted(tmp_path):
    mirror = tmp_path / "m.jsonl"
    mirror.write_text("\n".join([json.dumps(GOOD), DEEP, "{" * 100_000, json.dumps(GOOD)]) + "\n")
    r, out, rep = pull(tmp_path, {"source": "local", "local_path": str(mirror), "max_conversations": 0})
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    report = json.loads(rep.read_text())
    assert report["rows"] == 2 == pq.read_table(out).num_rows
    assert report["skipped"] == 2
    assert report["skipped_by_reason"].get("nested too deeply to parse") == 1
    assert any(e.startswith(f"{mirror}:2:") for e in report["skipped_examples"])
    assert leftovers(tmp_path) == []


def test_deeply_nested_json_file_is_a_clear_error_without_leftovers(tmp_path):
    mirror = tmp_path / "m.json"
    mirror.write_text(DEEP)
    r, out, rep = pull(tmp_path, {"source": "local", "local_path": str(mirror), "max_conversations": 0})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and str(mirror) in r.stderr and "nested too deeply" in r.stderr
    assert not out.exists() and not rep.exists()
    assert leftovers(tmp_path) == []


def test_unexpected_failure_leaves_no_temporary_file(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps(GOOD) + "\n")
    r, out, _ = pull(tmp_path, {"source": "local", "local_path": str(good), "max_conversations": 0})
    assert r.returncode == 0 and out.exists()
    # a source that raises something other than PullError half-way through the write
    script = tmp_path / "crash.py"
    script.write_text(
        "import runpy, sys\n"
        f"sys.argv = [{str(PULL)!r}, '--config', {str(tmp_path / 'pull.yaml')!r}, '--out', "
        f"{str(tmp_path / 'raw' / 'd.parquet')!r}, '--report', {str(tmp_path / 'raw' / 'd.json')!r}]\n"
        "def boom(d, w, skips):\n"
        "    w.add([{'from': 'human', 'value': 'x'}])\n"
        "    w._flush()\n"
        "    raise KeyboardInterrupt\n"
        f"g = runpy.run_path({str(PULL)!r}, run_name='pull')\n"
        "g['SOURCES']['local'] = boom\n"
        "g['main']()\n")
    r2 = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r2.returncode != 0 and "KeyboardInterrupt" in r2.stderr
    assert leftovers(tmp_path) == []
    assert not (tmp_path / "raw" / "d.parquet").exists()
