"""Tokenise the megachat splits into token shards (llm.c's layout, andrea/data/shards.py) and a manifest.

    python scripts/tokenize-shards.py --tokenizer data/synthetic/tok512/tokenizer.json \
        --train data/synthetic/megachat/train.parquet --val data/synthetic/megachat/val.parquet \
        --out-dir data/synthetic/tok512 --manifest data/synthetic/tok512/shards.json

Each split becomes `<split>_000000.bin`, `<split>_000001.bin`, ... (the data.train_shards and
data.val_shards globs), each the concatenation of rendered conversations in split order, at most
--shard-tokens tokens per shard. Encoding runs in parallel in the tokenizer's Rust threads
(RAYON_NUM_THREADS, set from --threads). Old shards of a split are removed first, so the globs
never pick up a stale file. The manifest lists every shard with its token count and sha256.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from andrea.atomic import atomic_write_json, sha256_file as sha256

SHARD_TOKENS = 100_000_000  # as llm.c's FineWeb shards: 200 MB of uint16 per file
ENCODE_ROWS = 4096  # rows per encode_batch call: enough to keep every thread busy


def tokenize_split(tok, split: str, parquet: Path, out_dir: Path, shard_tokens: int) -> list:
    from andrea.data.shards import write_shard

    for old in out_dir.glob(f"{split}_*.bin"):
        old.unlink()
    pf = pq.ParquetFile(parquet)
    shards, pending, n_pending = [], [], 0

    def emit(tokens):
        path = write_shard(out_dir / f"{split}_{len(shards):06d}.bin", tokens)
        shards.append({"path": path.name, "tokens": int(tokens.size), "sha256": sha256(path)})

    with tqdm(total=pf.metadata.num_rows, desc=f"tokenize {split}", unit="conv", file=sys.stderr) as bar:
        for batch in pf.iter_batches(batch_size=ENCODE_ROWS, columns=["text"]):
            for ids in tok.encode_batch(batch.column(0).to_pylist()):
                pending.append(np.asarray(ids, dtype=np.uint16))
                n_pending += len(ids)
            while n_pending >= shard_tokens:
                flat = np.concatenate(pending)
                emit(flat[:shard_tokens])
                pending, n_pending = [flat[shard_tokens:]], flat.size - shard_tokens
            bar.update(batch.num_rows)
    if n_pending or not shards:
        emit(np.concatenate(pending) if pending else np.zeros(0, dtype=np.uint16))
    return shards


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, type=Path)
    ap.add_argument("--train", required=True, type=Path)
    ap.add_argument("--val", required=True, type=Path)
    ap.add_argument("--out-dir", required=True, type=Path)
    ap.add_argument("--manifest", required=True, type=Path)
    ap.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    ap.add_argument("--threads", type=int, default=0, help="encoding threads (0: all cores)")
    a = ap.parse_args(argv)
    if a.threads:
        os.environ["RAYON_NUM_THREADS"] = str(a.threads)  # read when the Rust pool first starts
    from andrea.data.tokenizer import load_tokenizer

    tok = load_tokenizer(a.tokenizer)
    if tok.vocab_size > 65536:
        raise SystemExit(f"tokenize-shards: {a.tokenizer} has {tok.vocab_size} tokens; shards hold uint16 ids")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"tokenizer": str(a.tokenizer), "tokenizer_sha256": sha256(a.tokenizer),
                "vocab_size": tok.vocab_size, "shard_tokens": a.shard_tokens}
    for split, src in (("train", a.train), ("val", a.val)):
        shards = tokenize_split(tok, split, src, a.out_dir, a.shard_tokens)
        manifest[split] = {"source": str(src), "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    atomic_write_json(a.manifest, manifest, indent=1)
    print(f"tokenize-shards: train {manifest['train']['tokens']:,} tokens in {len(manifest['train']['shards'])} "
          f"shard(s), val {manifest['val']['tokens']:,} tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
