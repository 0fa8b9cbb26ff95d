"""Atomic file writes (a reader sees the old file or the new one, never half of one), and the
sha256 of a file, which is how readers check what was written.

Every file a reader may open while it is being written (checkpoints, shards, run records, reports,
configs) goes through here: write to a temporary name in the same folder, flush, fsync, rename.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple, Union

Data = Union[bytes, str, Iterable[bytes]]
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class NoSpace(OSError):
    """Not enough free space for a write: names the file, the bytes it needs and what is free."""

    def __init__(self, path, needed: int, free: int):
        super().__init__(errno.ENOSPC, "no space left on device", str(path))
        self.path, self.needed, self.free = Path(path), int(needed), int(free)

    def __str__(self) -> str:
        return (f"{self.path}: not enough disk space: {self.needed:,} bytes needed, {self.free:,} free in "
                f"{self.path.parent}; free some space (the previous file, if any, is intact)")


def free_bytes(folder) -> int:
    return shutil.disk_usage(folder).free


def check_space(path, needed: int) -> None:
    """Raise NoSpace when path's folder has fewer than needed bytes free (a write of known size)."""
    free = free_bytes(Path(path).parent)
    if needed > free:
        raise NoSpace(path, needed, free)


def tmp_path(path: Path) -> Path:
    """A temporary sibling of path, private to this process (a hidden name readers skip)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def replace_synced(tmp: Path, path: Path) -> Path:
    """fsync a finished temporary file (written by any writer), then rename it over path."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _chunks(data: Data) -> List[bytes]:
    return [data.encode()] if isinstance(data, str) else [data] if isinstance(data, bytes) else list(data)


def atomic_write(path, data: Data) -> Path:
    """Write bytes, text or an iterable of byte chunks to path atomically."""
    return atomic_write_many([(path, data)])[0]


def atomic_write_many(items: Sequence[Tuple[object, Data]]) -> List[Path]:
    """Write several files atomically: every temporary file is written and fsynced first, then they
    are renamed in the given order, so a full disk or a signal during the writes changes none of
    them. A full disk raises NoSpace naming the file and the bytes it needed; no temporary file
    is left behind, whatever the failure."""
    pending = [(Path(p), _chunks(d)) for p, d in items]
    written: List[Path] = []
    try:
        for path, chunks in pending:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = tmp_path(path)
            written.append(tmp)
            try:
                with open(tmp, "wb") as f:
                    for c in chunks:
                        f.write(c)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                if e.errno not in NO_SPACE:
                    raise
                _drop(tmp)
                raise NoSpace(path, sum(len(c) for c in chunks), free_bytes(path.parent)) from None
        for (path, _), tmp in zip(pending, written):
            os.replace(tmp, path)
    except BaseException:  # a full disk, a signal, a bad chunk: the old files stay, no temporary one
        for tmp in written:
            _drop(tmp)
        raise
    return [p for p, _ in pending]


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


def atomic_savefig(fig, path, **savefig_kw) -> Path:
    """A matplotlib figure saved to path atomically (the format from path's suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **savefig_kw)
        return replace_synced(tmp, path)
    except BaseException:
        _drop(tmp)
        raise


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


RENAME_EXCHANGE = 2  # linux/fs.h: renameat2 swaps the two paths in one step


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one rename (Linux renameat2 RENAME_EXCHANGE); False where the
    system or file system has no such rename (nothing changed then)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_in_folder(new: Path, dst: Path) -> None:
    """Put the finished folder new at dst (a sibling in the same file system). When dst exists,
    it is exchanged with new in one rename where the system allows (a reader sees the old folder or
    the new one), else moved aside and back on failure; either way the previous dst ends at new's
    path, for the caller to remove. Nothing is deleted here."""
    new, dst = Path(new), Path(dst)
    if not os.path.lexists(dst):
        os.rename(new, dst)
        return
    if _exchange(new, dst):
        return
    aside = dst.with_name(f".{dst.name}.{os.getpid()}.old")
    os.rename(dst, aside)
    try:
        os.rename(new, dst)
    except BaseException:
        os.rename(aside, dst)
        raise
    os.rename(aside, new)
