"""Train the byte-level BPE tokenizer of one vocabulary size on the megachat train split.

    python scripts/train-tokenizer.py --train data/synthetic/megachat/train.parquet \
        --vocab-size 512 --out data/synthetic/tok512/tokenizer.json

Only the train split is read, so nothing of the validation text leaks into the merges. The chat
special tokens take ids 0..5 (andrea/data/chat.py); the vocabulary is model.vocab_size.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq
from tqdm import tqdm

from andrea.data.tokenizer import describe, train_tokenizer


def texts(path: Path):
    pf = pq.ParquetFile(path)
    with tqdm(total=pf.metadata.num_rows, desc="tokenizer corpus", unit="conv", file=sys.stderr) as bar:
        for batch in pf.iter_batches(batch_size=10_000, columns=["text"]):
            yield from batch.column(0).to_pylist()
            bar.update(batch.num_rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", required=True, type=Path, help="megachat train split (parquet with 'text')")
    ap.add_argument("--vocab-size", required=True, type=int)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    n = pq.ParquetFile(a.train).metadata.num_rows
    # the tqdm bar over the corpus is the progress; the trainer's own bar would print a second one
    tok = train_tokenizer(texts(a.train), a.vocab_size, a.out, length=n, progress=False)
    info = describe(tok)
    print(f"train-tokenizer: {a.out}: {info['vocab_size']} tokens (asked {a.vocab_size}), "
          f"special ids {info['special_ids']}", file=sys.stderr)
    if info["vocab_size"] < a.vocab_size:
        print(f"train-tokenizer: WARNING: {a.out} has {info['vocab_size']} tokens, fewer than the {a.vocab_size} "
              "asked (the corpus is too small for more merges); the model keeps model.vocab_size rows, "
              "the report's uniform guess uses the real size", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
