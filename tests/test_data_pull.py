"""scripts/pull-hermes3.py: synthetic and local sources, malformed rows, hub without network."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
PULL = REPO / "scripts" / "pull-hermes3.py"


def pull(tmp_path, data: dict, env=None, timeout=60):
    cfg = tmp_path / "pull.yaml"
    cfg.write_text(json.dumps({"data": data}))  # JSON is YAML
    out, rep = tmp_path / "raw" / "c.parquet", tmp_path / "raw" / "report.json"
    r = subprocess.run([sys.executable, str(PULL), "--config", str(cfg), "--out", str(out), "--report", str(rep)],
                       capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ))
    report = json.loads(rep.read_text()) if rep.exists() else None
    rows = pq.read_table(out).to_pylist() if out.exists() else None
    return r, report, rows


def test_synthetic(tmp_path):
    r, rep, rows = pull(tmp_path, {"source": "synthetic", "n_synthetic": 50, "seed": 4, "max_conversations": 0})
    assert r.returncode == 0, r.stderr
    assert rep["rows"] == 50 == len(rows) and rep["skipped"] == 0
    assert rows[0]["conversations"][0]["from"] == "human" and rows[0]["task"] in ("add", "sort", "count", "reverse")


def test_local_jsonl_malformed_rows_counted_and_skipped(tmp_path):
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"text": "no conversations"}),
             json.dumps({"conversations": [{"from": "human"}]}), "", json.dumps([1, 2]), json.dumps(good)]
    mirror = tmp_path / "mirror.jsonl"
    mirror.write_text("\n".join(lines) + "\n")
    r, rep, rows = pull(tmp_path, {"source": "local", "local_path": str(mirror), "max_conversations": 0})
    assert r.returncode == 0, r.stderr
    assert rep["rows"] == 2 == len(rows)
    assert rep["skipped"] == 4
    assert rep["skipped_by_reason"]["not valid JSON"] == 1
    assert any(e.startswith(f"{mirror}:2:") for e in rep["skipped_examples"])


def test_local_parquet_and_cap(tmp_path):
    import pyarrow as pa
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    r, rep, got = pull(tmp_path, {"source": "local", "local_path": str(tmp_path / "m.parquet"), "max_conversations": 4})
    assert r.returncode == 0, r.stderr
    assert [g["conversations"][0]["value"] for g in got] == ["q0", "q1", "q2", "q3"]


def test_local_missing_path_names_field(tmp_path):
    r, _, _ = pull(tmp_path, {"source": "local", "local_path": str(tmp_path / "nope.jsonl"), "max_conversations": 0})
    assert r.returncode == 2 and "data.local_path" in r.stderr and "nope.jsonl" in r.stderr


def test_hub_offline_fails_fast_with_hint(tmp_path):
    e = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    t0 = time.time()
    r, _, _ = pull(tmp_path, {"source": "hub", "hub_repo": "NousResearch/Hermes-3-Dataset",
                              "revision": "0" * 40, "max_conversations": 0}, env=e, timeout=120)
    dt = time.time() - t0
    assert r.returncode == 2
    assert "data.source=synthetic" in r.stderr and "data.source=local" in r.stderr
    assert dt < 60, f"took {dt:.0f} s"
    assert not (tmp_path / "raw" / "c.parquet").exists()


def test_hub_unreachable_fails_fast_with_hint(tmp_path):
    # nothing listens on port 9 of localhost: the connection is refused at once, as with no network
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")
    t0 = time.time()
    r, _, _ = pull(tmp_path, {"source": "hub", "hub_repo": "NousResearch/Hermes-3-Dataset",
                              "revision": "0" * 40, "max_conversations": 0}, env=env, timeout=120)
    assert r.returncode == 2 and "data.source=synthetic" in r.stderr
    assert "not reachable" in r.stderr
    assert time.time() - t0 < 60


def test_hub_path_reads_a_datasets_repo(tmp_path):
    """The hub code path after loading (column check, batch iteration, row checks) on a local
    `datasets` folder in the Hermes 3 layout; load_dataset reads a folder like a hub repo."""
    repo = tmp_path / "Hermes-3-Dataset"
    repo.mkdir()
    rows = [{"conversations": [{"from": "human", "value": f"q{i}", "weight": None},
                               {"from": "gpt", "value": f"a{i}", "weight": 1.0}]} for i in range(30)]
    (repo / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    e = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    r, rep, got = pull(tmp_path, {"source": "hub", "hub_repo": str(repo), "revision": "main",
                                  "max_conversations": 25}, env=e, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert rep["rows"] == 25 == len(got) and rep["skipped"] == 0
    assert got[3]["conversations"] == [{"from": "human", "value": "q3"}, {"from": "gpt", "value": "a3"}]
