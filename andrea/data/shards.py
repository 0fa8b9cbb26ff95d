"""Token shards in llm.c's layout (a contract, docs/ARCHITECTURE.md): a 256 x int32 header, then uint16 tokens.

header[0] = 20240520 (magic), header[1] = 1 (version), header[2] = token count. Writes are atomic
(temporary file, fsync, rename); reads check the magic, version and that the file size matches.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..util.atomic import atomic_write

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


class ShardError(ValueError):
    """A token shard that does not follow the format."""


def write_shard(path, tokens) -> Path:
    """Write tokens (any int array, every value < 65536) as a shard at path, atomically."""
    path = Path(path)
    toks = np.asarray(tokens)
    if toks.size and (toks.min() < 0 or toks.max() > 65535):
        raise ShardError(f"shard {path}: tokens must lie in [0, 65535], got [{toks.min()}, {toks.max()}]")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, toks.size)
    return atomic_write(path, [header.tobytes(), toks.astype("<u2").tobytes()])


def read_shard(path) -> np.ndarray:
    """The tokens of a shard as a read-only uint16 memmap, after checking its header and size."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"shard {path}: no such file")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"shard {path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ShardError(f"shard {path}: magic is {header[0]} but expected {MAGIC}; not a token shard")
    if header[1] != VERSION:
        raise ShardError(f"shard {path}: version is {header[1]} but expected {VERSION}")
    n = int(header[2])
    expected = HEADER_BYTES + 2 * n
    if size != expected:
        raise ShardError(f"shard {path}: header says {n} tokens ({expected} bytes) but the file has "
                         f"{size} bytes; truncated or appended to?")
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))
