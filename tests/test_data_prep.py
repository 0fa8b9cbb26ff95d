"""scripts/prep-megachat.py and scripts/tokenize-shards.py: drops, duplicates, split, shards."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea.data.chat import render_conversation
from andrea.data.shards import read_shard

REPO = Path(__file__).resolve().parent.parent


def script(name, *args):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / name), *map(str, args)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def conv(q, a="ok", qrole="human"):
    return [{"from": qrole, "value": q}, {"from": "gpt", "value": a}]


@pytest.fixture
def prepped(tmp_path):
    rows = [{"conversations": conv(f"question {i}"), "task": None} for i in range(300)]
    rows += [{"conversations": conv("question 7"), "task": None},           # exact duplicate
             {"conversations": conv("x", qrole="alien"), "task": None},     # unknown role
             {"conversations": conv("   "), "task": None},                  # empty turn
             {"conversations": [], "task": None}]                          # empty conversation
    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.Table.from_pylist(rows), raw)
    (tmp_path / "prep.yaml").write_text("data:\n  val_fraction: 0.1\n")
    out = tmp_path / "m"
    script("prep-megachat.py", "--config", tmp_path / "prep.yaml", "--inputs", raw, "--train", out / "train.parquet",
           "--val", out / "val.parquet", "--report", out / "report.json")
    return out


def test_prep_counts_drops_and_duplicates(prepped):
    rep = json.loads((prepped / "report.json").read_text())
    assert rep["read"] == 304 and rep["duplicates"] == 1
    assert rep["dropped"] == {"unknown_role": 1, "empty": 2}
    assert rep["train"] + rep["val"] == rep["kept"] == 300


def test_prep_split_is_disjoint_rendered_and_by_hash(prepped):
    tr = pq.read_table(prepped / "train.parquet").to_pylist()
    va = pq.read_table(prepped / "val.parquet").to_pylist()
    assert not {r["text"] for r in tr} & {r["text"] for r in va}
    assert 10 <= len(va) <= 50  # 10% of 300 by hash; binomial spread is about +-5
    r = tr[0]
    assert r["text"] == render_conversation(r["conversations"]) and r["conversations"][0]["from"] == "user"


def test_tokenize_shards(prepped, tmp_path):
    tok = tmp_path / "tok" / "tokenizer.json"
    script("train-tokenizer.py", "--train", prepped / "train.parquet", "--vocab-size", 300, "--out", tok)
    stale = tmp_path / "tok" / "train_000009.bin"
    stale.write_bytes(b"old")
    script("tokenize-shards.py", "--tokenizer", tok, "--train", prepped / "train.parquet", "--val",
           prepped / "val.parquet", "--out-dir", tmp_path / "tok", "--manifest", tmp_path / "tok" / "shards.json",
           "--shard-tokens", 1000)
    man = json.loads((tmp_path / "tok" / "shards.json").read_text())
    assert not stale.exists()
    shards = sorted((tmp_path / "tok").glob("train_*.bin"))
    assert [s.name for s in shards] == [s["path"] for s in man["train"]["shards"]] and len(shards) > 1
    toks = [read_shard(s) for s in shards]
    assert all(len(t) == 1000 for t in toks[:-1])
    assert sum(map(len, toks)) == man["train"]["tokens"]
    from andrea.data.tokenizer import load_tokenizer
    t = load_tokenizer(tok)
    first = pq.read_table(prepped / "train.parquet").column("text")[0].as_py()
    ids = t.encode(first)
    assert list(toks[0][:len(ids)]) == ids and ids[0] == t.doc_id
