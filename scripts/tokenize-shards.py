"""Tokenise the megachat splits into token shards (llm.c's layout, andrea/data/shards.py) and a manifest.

    python scripts/tokenize-shards.py --tokenizer data/synthetic/tok512/tokenizer.json \
        --train data/synthetic/megachat/train.parquet --val data/synthetic/megachat/val.parquet \
        --out-dir data/synthetic/tok512 --manifest data/synthetic/tok512/shards.json

Each split becomes `<split>_000000.bin`, `<split>_000001.bin`, ... (the data.train_shards and
data.val_shards globs), each the concatenation of rendered conversations in split order, at most
--shard-tokens tokens per shard. Encoding runs in parallel in the tokenizer's Rust threads
(RAYON_NUM_THREADS, set from --threads). Old shards of a split are removed first, so the globs
never pick up a stale file. The manifest lists every shard with its token count and sha256.

Data groups for the mixer (docs/FIREHOSE-BANDIT.md): `--group-by field:<column>` (e.g.
field:task, the synthetic task kind) also writes each split once per value of that column, as
`<out-dir>/groups/<value>/<split>_000000.bin`, ...; `--noise-group NAME --noise-tokens N` adds a
group of N uniformly random token ids per split (seeded by --noise-seed), a deliberately
unlearnable group. The ungrouped shards are written as without these options.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from andrea.util.atomic import atomic_write_json, sha256_file as sha256

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


def group_dir(out_dir: Path, name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(name))
    if not safe or safe.startswith("."):
        raise SystemExit(f"tokenize-shards: group name {name!r} does not make a folder name")
    return out_dir / "groups" / safe


def tokenize_groups(tok, split: str, parquet: Path, out_dir: Path, shard_tokens: int, column: str) -> dict:
    """Each row's tokens go to the group named by its column value; per group, shards as above."""
    from andrea.data.shards import write_shard

    pf = pq.ParquetFile(parquet)
    if column not in pf.schema_arrow.names:
        raise SystemExit(f"tokenize-shards: {parquet}: no column {column!r} to group by "
                         f"(columns: {pf.schema_arrow.names})")
    pending, n_pending, shards = {}, {}, {}

    def emit(name, tokens):
        d = group_dir(out_dir, name)
        path = write_shard(d / f"{split}_{len(shards[name]):06d}.bin", tokens)
        shards[name].append({"path": str(path.relative_to(out_dir)), "tokens": int(tokens.size),
                             "sha256": sha256(path)})

    for batch in pf.iter_batches(batch_size=ENCODE_ROWS, columns=["text", column]):
        names = ["" if v is None else str(v) for v in batch.column(1).to_pylist()]
        for name, ids in zip(names, tok.encode_batch(batch.column(0).to_pylist())):
            if name not in pending:
                d = group_dir(out_dir, name)
                d.mkdir(parents=True, exist_ok=True)
                for old in d.glob(f"{split}_*.bin"):
                    old.unlink()
                pending[name], n_pending[name], shards[name] = [], 0, []
            pending[name].append(np.asarray(ids, dtype=np.uint16))
            n_pending[name] += len(ids)
            if n_pending[name] >= shard_tokens:
                flat = np.concatenate(pending[name])
                while flat.size >= shard_tokens:
                    emit(name, flat[:shard_tokens])
                    flat = flat[shard_tokens:]
                pending[name], n_pending[name] = [flat], flat.size
    for name, parts in pending.items():
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
        if flat.size or not shards[name]:
            emit(name, flat)
    return {name: {"tokens": sum(x["tokens"] for x in v), "shards": v} for name, v in sorted(shards.items())}


def noise_group(split: str, out_dir: Path, name: str, n_tokens: int, vocab_size: int, seed: int) -> dict:
    """n_tokens uniformly random ids in [0, vocab_size): nothing in them can be learnt."""
    from andrea.data.shards import write_shard

    d = group_dir(out_dir, name)
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob(f"{split}_*.bin"):
        old.unlink()
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    path = write_shard(d / f"{split}_000000.bin", rng.integers(0, vocab_size, n_tokens, dtype=np.int64))
    return {"tokens": n_tokens, "shards": [{"path": str(path.relative_to(out_dir)), "tokens": n_tokens,
                                            "sha256": sha256(path)}]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, type=Path)
    ap.add_argument("--train", required=True, type=Path)
    ap.add_argument("--val", required=True, type=Path)
    ap.add_argument("--out-dir", required=True, type=Path)
    ap.add_argument("--manifest", required=True, type=Path)
    ap.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    ap.add_argument("--threads", type=int, default=0, help="encoding threads (0: all cores)")
    ap.add_argument("--group-by", default="", help="field:<column>: also write shards per value of it")
    ap.add_argument("--noise-group", default="", help="name of a group of random tokens")
    ap.add_argument("--noise-tokens", type=int, default=0, help="random tokens per split of the noise group")
    ap.add_argument("--noise-seed", type=int, default=0)
    a = ap.parse_args(argv)
    column = ""
    if a.group_by:
        kind, _, column = a.group_by.partition(":")
        if kind != "field" or not column:
            raise SystemExit(f"tokenize-shards: --group-by {a.group_by!r}: expected field:<column> "
                             "(group by source: give each source's shards their own data.groups glob)")
    if a.noise_group and a.noise_tokens < 1:
        raise SystemExit(f"tokenize-shards: --noise-group {a.noise_group}: --noise-tokens must be positive")
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
        groups = tokenize_groups(tok, split, src, a.out_dir, a.shard_tokens, column) if column else {}
        if a.noise_group:
            if a.noise_group in groups:
                raise SystemExit(f"tokenize-shards: --noise-group {a.noise_group!r} is also a value of {column}")
            groups[a.noise_group] = noise_group(split, a.out_dir, a.noise_group, a.noise_tokens,
                                                tok.vocab_size, a.noise_seed)
        for name, g in groups.items():
            manifest.setdefault("groups", {}).setdefault(name, {})[split] = g
    atomic_write_json(a.manifest, manifest, indent=1)
    print(f"tokenize-shards: train {manifest['train']['tokens']:,} tokens in {len(manifest['train']['shards'])} "
          f"shard(s), val {manifest['val']['tokens']:,} tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
