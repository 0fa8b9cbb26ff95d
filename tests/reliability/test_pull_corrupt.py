"""scripts/pull-hermes3.py on a parquet mirror whose data page is corrupt (its footer intact, so
the file opens and its schema reads): one line naming the file and the row group, exit 2, no
traceback, and the output folder's files left as they were (no parquet, no report, no temporary
file)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
PULL = REPO / "scripts" / "pull-hermes3.py"
ROWS_PER_GROUP, GROUPS, BAD_GROUP = 100, 3, 1


def corrupt_mirror(path: Path) -> Path:
    """A snappy parquet of GROUPS row groups whose BAD_GROUP has a data page overwritten in the
    middle of its compressed bytes; the footer (and so the schema and metadata) stays valid."""
    rows = [{"conversations": [{"from": "human", "value": f"question {i} " + "x" * (i % 50)},
                               {"from": "gpt", "value": "answer " * 20 + str(i)}]}
            for i in range(ROWS_PER_GROUP * GROUPS)]
    pq.write_table(pa.Table.from_pylist(rows), path, compression="snappy", row_group_size=ROWS_PER_GROUP,
                   use_dictionary=False)
    md = pq.ParquetFile(path).metadata
    assert md.num_row_groups == GROUPS
    col = md.row_group(BAD_GROUP).column(1)  # conversations.list.element.value
    assert col.compression == "SNAPPY" and col.dictionary_page_offset is None
    mid = col.data_page_offset + col.total_compressed_size // 2
    b = bytearray(path.read_bytes())
    b[mid:mid + 16] = b"\xff" * 16
    path.write_bytes(bytes(b))
    pf = pq.ParquetFile(path)  # the footer still reads
    assert pf.metadata.num_rows == ROWS_PER_GROUP * GROUPS
    pf.read_row_group(0)
    with pytest.raises(OSError, match="(?i)corrupt"):
        pf.read_row_group(BAD_GROUP)
    return path


def folder(p: Path) -> dict:
    return {str(f.relative_to(p)): (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(p.rglob("*")) if f.is_file()}


def pull(tmp_path, mirror, out_dir):
    cfg = tmp_path / "pull.yaml"
    cfg.write_text(json.dumps({"data": {"source": "local", "local_path": str(mirror), "max_conversations": 0}}))
    return subprocess.run([sys.executable, str(PULL), "--config", str(cfg), "--out", str(out_dir / "c.parquet"),
                           "--report", str(out_dir / "report.json")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))


def assert_one_clear_line(r, mirror):
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("pull-hermes3:")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert str(mirror) in lines[0] and f"row group {BAD_GROUP}" in lines[0], lines[0]


def test_corrupt_data_page_is_one_line_exit_2_and_the_old_output_stays(tmp_path):
    mirror = corrupt_mirror(tmp_path / "mirror.parquet")
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.Table.from_pylist([{"conversations": [{"from": "human", "value": "old"}], "task": None}]),
                   raw / "c.parquet")
    (raw / "report.json").write_text('{"rows": 1}')
    before = folder(raw)
    r = pull(tmp_path, mirror, raw)
    assert_one_clear_line(r, mirror)
    assert folder(raw) == before  # the earlier pull's output untouched, no temporary file left


def test_corrupt_data_page_of_a_first_pull_leaves_no_file(tmp_path):
    mirror = corrupt_mirror(tmp_path / "mirror.parquet")
    r = pull(tmp_path, mirror, tmp_path / "raw")
    assert_one_clear_line(r, mirror)
    assert list((tmp_path / "raw").iterdir()) == []  # no parquet, no report, no temporary file
