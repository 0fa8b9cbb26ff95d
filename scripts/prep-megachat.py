"""Merge pulled conversations into the megachat mix: normalised, rendered, deduplicated, split.

    python scripts/prep-megachat.py --config data/synthetic/config/prep.yaml \
        --inputs data/synthetic/raw/conversations.parquet \
        --train data/synthetic/megachat/train.parquet --val data/synthetic/megachat/val.parquet \
        --report data/synthetic/megachat/report.json

For each conversation of each input (in order): roles are mapped to system/user/assistant/tool,
the chat template of andrea/data/chat.py renders it with its special tokens; malformed, empty or
unknown-role conversations are dropped and counted by reason; exact duplicates (same rendered text)
are dropped after their first occurrence; the sha256 of the text puts it in val when its first 8
bytes, read as a fraction of 2^64, fall below data.val_fraction, so the split does not depend on
order, machine or seed. Output columns: id (sha256 prefix), text, conversations, task.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf
from tqdm import tqdm

from andrea.util.atomic import ParquetStream, atomic_write_json
from andrea.data.chat import ConversationError, normalize, render_conversation

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("text", pa.string()),
    ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
    ("task", pa.string()),
])
BATCH_ROWS = 10_000
MAX_EXAMPLES = 20


def in_val(digest: bytes, val_fraction: float) -> bool:
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < val_fraction


def iter_rows(path: Path):
    pf = pq.ParquetFile(path)
    cols = [c for c in ("conversations", "task") if c in pf.schema_arrow.names]
    if "conversations" not in cols:
        raise SystemExit(f"prep-megachat: {path}: no 'conversations' column; was it written by pull-hermes3.py?")
    with tqdm(total=pf.metadata.num_rows, desc=f"prep {path.name}", unit="conv", file=sys.stderr) as bar:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=cols):
            yield from batch.to_pylist()
            bar.update(batch.num_rows)


def prep(inputs, train_out: Path, val_out: Path, val_fraction: float) -> dict:
    if not 0.0 < val_fraction < 1.0:
        raise SystemExit(f"prep-megachat: data.val_fraction={val_fraction}: expected a fraction in (0, 1)")
    writers = {"train": ParquetStream(train_out, SCHEMA, BATCH_ROWS), "val": ParquetStream(val_out, SCHEMA, BATCH_ROWS)}
    seen = set()
    stats = {"read": 0, "dropped": {}, "duplicates": 0, "examples": []}
    for path in inputs:
        for i, row in enumerate(iter_rows(Path(path))):
            stats["read"] += 1
            try:
                turns = normalize(row["conversations"])
                text = render_conversation(turns)
            except ConversationError as e:
                stats["dropped"][e.reason] = stats["dropped"].get(e.reason, 0) + 1
                if len(stats["examples"]) < MAX_EXAMPLES:
                    stats["examples"].append(f"{path}:row {i + 1}: {e}")
                continue
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            if digest in seen:
                stats["duplicates"] += 1
                continue
            seen.add(digest)
            split = "val" if in_val(digest, val_fraction) else "train"
            writers[split].add({"id": digest.hex()[:16], "text": text, "conversations": turns,
                                "task": row.get("task")})
    for w in writers.values():
        w.close()
    stats.update(train=writers["train"].n, val=writers["val"].n, val_fraction=val_fraction,
                 kept=writers["train"].n + writers["val"].n, inputs=[str(p) for p in inputs])
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=Path, help="YAML with a data: mapping (val_fraction)")
    ap.add_argument("--inputs", required=True, nargs="+", type=Path, help="pulled conversation parquet files")
    ap.add_argument("--train", required=True, type=Path)
    ap.add_argument("--val", required=True, type=Path)
    ap.add_argument("--report", required=True, type=Path)
    a = ap.parse_args(argv)
    d = OmegaConf.load(a.config).data
    stats = prep(a.inputs, a.train, a.val, float(d.val_fraction))
    atomic_write_json(a.report, stats, indent=1)
    dropped = sum(stats["dropped"].values())
    print(f"prep-megachat: {stats['read']} read, {dropped} dropped {stats['dropped']}, {stats['duplicates']} "
          f"duplicates, {stats['train']} train, {stats['val']} val", file=sys.stderr)
    if stats["train"] == 0 or stats["val"] == 0:
        print(f"prep-megachat: an empty split (train {stats['train']}, val {stats['val']}); need more "
              "conversations or another data.val_fraction", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
