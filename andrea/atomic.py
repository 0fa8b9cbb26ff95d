"""Atomic file writes (a reader sees the old file or the new one, never half of one), and the
sha256 of a file, which is how readers check what was written.

Every file a reader may open while it is being written (checkpoints, shards, run records, reports,
configs) goes through here: write to a temporary name in the same folder, flush, fsync, rename.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Union

Data = Union[bytes, str, Iterable[bytes]]


def tmp_path(path: Path) -> Path:
    """A temporary sibling of path, private to this process (a hidden name readers skip)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def replace_synced(tmp: Path, path: Path) -> Path:
    """fsync a finished temporary file (written by any writer), then rename it over path."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def atomic_write(path, data: Data) -> Path:
    """Write bytes, text or an iterable of byte chunks to path atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    chunks = [data.encode()] if isinstance(data, str) else [data] if isinstance(data, bytes) else data
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal, a bad chunk: the old file stays, no temporary one
        _drop(tmp)
        raise
    return path


def _drop(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass  # the original error is the one worth reporting


def atomic_write_json(path, obj, indent=None) -> Path:
    """obj as strict JSON (NaN and Inf refused: records are read by browsers and other languages)."""
    seps = (",", ":") if indent is None else None
    text = json.dumps(obj, indent=indent, separators=seps, allow_nan=False)
    return atomic_write(path, text + ("\n" if indent is not None else ""))


def atomic_copy(src, dst) -> Path:
    dst = Path(dst)
    tmp = tmp_path(dst)
    try:
        shutil.copyfile(src, tmp)
        return replace_synced(tmp, dst)
    except BaseException:
        _drop(tmp)
        raise


def sha256_file(path) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB blocks (checkpoints run to gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class ParquetStream:
    """Rows streamed into a parquet file under a temporary name, renamed into place by close():
    a reader never opens a half-written split. abort() drops the temporary file."""

    def __init__(self, out, schema, batch_rows: int = 10_000):
        import pyarrow.parquet as pq  # here, so the checkpoint and record writers need no pyarrow

        self.out, self.schema, self.batch_rows = Path(out), schema, batch_rows
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp_path(self.out)
        self.pw = pq.ParquetWriter(self.tmp, schema)
        self.rows, self.n = [], 0

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.n += 1
        if len(self.rows) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.rows:
            self.pw.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []

    def close(self) -> Path:
        try:
            self._flush()
            self.pw.close()
            return replace_synced(self.tmp, self.out)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        try:
            self.pw.close()
        except Exception:
            pass  # closing may fail the same way the write did; the file goes anyway
        finally:
            _drop(self.tmp)
