"""The history journal `<exp>.loss.jsonl`: the loss history as the proxy keeps it while a run lives.

One JSON object per line, a history record of `<exp>.loss.json` (records.py documents its fields),
"step" first, in increasing step order. A line whose step equals the line before it replaces that
record (a validation loss joined to its step after the step was written). Each flush appends only
the new lines and fsyncs them; an append that fails (a full disk) is cut back to where it started,
so no half line stays behind. A line cut by a kill (the last one, without its newline or not JSON)
is dropped when the journal is opened, the lines before it kept. The only other change is a cut
from the end: a restarted engine replays the steps after its checkpoint, and their records go
first (`truncate_from`), so each step is there once.

`<exp>.loss.json` is derived from the journal by streaming (`write_loss_json`): the whole history
under a temporary name, fsynced, renamed; its memory does not grow with the history. The proxy
therefore holds a fixed number of records, and a flush writes bytes in proportion to the new
records only.

`HistoryView` reads a journal for the dashboard: the whole history up to MAX_POINTS records; past
that, steps are grouped in buckets of a power-of-two width (at most MAX_BUCKETS buckets), and each
bucket keeps its first and last records, those of its lowest and highest training loss and
validation loss, its first skipped step and every phase change, so spikes and pivots survive. It
reads only the lines appended since its last call.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

from andrea.util.atomic import NO_SPACE, NoSpace, free_bytes, tmp_path

STEP_RE = re.compile(rb'^\{"step":(\d+)[,}]')
BLOCK = 1 << 20  # bytes read at a time, forwards or backwards
MAX_POINTS = 5000  # a history up to this many records is served whole to the dashboard
MAX_BUCKETS = 1000  # beyond it, at most this many buckets of steps


def encode(rec: dict) -> bytes:
    """One journal line: strict JSON (no NaN), compact, "step" first (STEP_RE reads it back)."""
    return json.dumps({"step": rec["step"], **rec}, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def step_of(line: bytes) -> int:
    m = STEP_RE.match(line)
    if m is None:
        raise ValueError(f"not a history record line: {line[:80]!r}")
    return int(m.group(1))


class Journal:
    """An open journal file: its good size, appends, cuts from the end, and its lines."""

    def __init__(self, path: Path, size: Optional[int] = None):
        self.path = Path(path)
        self.size = size if size is not None else (self.path.stat().st_size if self.path.exists() else 0)

    def append(self, lines: List[bytes]) -> None:
        """Append whole lines and fsync; on any failure the file is cut back to its size before."""
        data = b"".join(lines)
        if not data:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            try:
                os.ftruncate(fd, self.size)  # whatever a failed append left past the good size goes
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError as e:
                try:
                    os.ftruncate(fd, self.size)
                except OSError:
                    pass  # the next append cuts it first
                if e.errno in NO_SPACE:
                    raise NoSpace(self.path, len(data), free_bytes(self.path.parent)) from None
                raise
        finally:
            os.close(fd)
        self.size += len(data)

    def lines(self, start: int = 0, end: Optional[int] = None) -> Iterator[bytes]:
        """The lines between byte offsets start and end (the good size), newline included."""
        end = self.size if end is None else end
        if end <= start:
            return
        with open(self.path, "rb") as f:
            f.seek(start)
            left, rest = end - start, b""
            while left > 0:
                block = f.read(min(BLOCK, left))
                if not block:
                    break
                left -= len(block)
                parts = (rest + block).split(b"\n")
                rest = parts.pop()
                for p in parts:
                    yield p + b"\n"
            if rest:
                yield rest

    def tail(self, step: int, keep: bool = True) -> Tuple[int, List[bytes], int]:
        """(offset, lines, steps): the lines at the end whose step is >= step, read backwards (kept
        only with keep, so a long cut holds no lines), where the first of them starts, and how
        many steps they hold."""
        out: List[bytes] = []
        steps, seen = 0, None
        with open(self.path, "rb") as f:
            pos, buf = self.size, b""  # buf: the bytes from pos up to the lines already passed
            while True:
                cut = buf.rfind(b"\n", 0, max(0, len(buf) - 1))  # the newline before buf's last line
                if cut < 0 and pos > 0:
                    n = min(BLOCK, pos)
                    pos -= n
                    f.seek(pos)
                    buf = f.read(n) + buf
                    continue
                if not buf:
                    return 0, out[::-1], steps
                line = buf[cut + 1:]
                s = step_of(line)
                if s < step:
                    return pos + cut + 1 + len(line), out[::-1], steps
                steps += s != seen
                seen = s
                if keep:
                    out.append(line)
                buf = buf[:cut + 1]

    def truncate_from(self, step: int) -> int:
        """Cut the records of steps >= step from the end; returns how many steps they held."""
        if self.size == 0:
            return 0
        offset, _, steps = self.tail(step, keep=False)
        if offset < self.size:
            os.truncate(self.path, offset)
            self.size = offset
        return steps

    def last(self) -> Optional[dict]:
        """The last record (None when the journal is empty)."""
        if self.size == 0:
            return None
        with open(self.path, "rb") as f:
            f.seek(max(0, self.size - BLOCK))
            block = f.read(min(self.size, BLOCK))
        return json.loads(block.rstrip(b"\n").rsplit(b"\n", 1)[-1])

    def records(self) -> Iterator[bytes]:
        """The history's lines in order, a replaced record only in its last form."""
        return collapse(self.lines())


def collapse(lines) -> Iterator[bytes]:
    """Lines with a step equal to the one before replace it: each step's last line, in order."""
    held, held_step = None, None
    for ln in lines:
        s = step_of(ln)
        if held is not None and s != held_step:
            yield held
        held, held_step = ln, s
    if held is not None:
        yield held


def scan(path: Path, check: Callable[[int, dict], None]) -> Tuple[int, int, Optional[dict], Optional[str]]:
    """Open an existing journal: (good size, records, last record, what was dropped or None).
    check(line number, record) raises for a record that is wrong; a last line cut by a kill (no
    newline, or not JSON) is cut from the file and reported instead."""
    size, n, last, last_step, dropped = 0, 0, None, None, None
    j = Journal(path)
    total = j.size
    for i, line in enumerate(j.lines(0, total), 1):
        at_end = size + len(line) >= total
        try:
            if not line.endswith(b"\n"):
                raise ValueError("no newline")
            rec = json.loads(line)
            if not isinstance(rec, dict) or step_of(line) != rec.get("step"):
                raise ValueError("not a record with its step first")
        except (ValueError, UnicodeDecodeError) as e:
            if not at_end:
                raise ValueError(f"line {i} is not a history record ({e})") from None
            dropped = f"its last line ({len(line)} bytes, cut by a kill: {e}) was dropped"
            break
        check(i, rec)
        if rec["step"] != last_step:
            n += 1
        last, last_step, size = rec, rec["step"], size + len(line)
    if size != total:
        os.truncate(path, size)
    return size, n, last, dropped


def write_loss_json(journal: Journal, path: Path, meta: dict) -> Tuple[str, Path]:
    """Write {**meta, "history": [the journal's records]} for path, streaming, one record a line,
    to a temporary file, fsynced: (its sha256, the temporary file), which the caller renames over
    path. Nothing temporary stays on failure."""
    path = Path(path)
    tmp = tmp_path(path)
    h = hashlib.sha256()
    head = json.dumps(meta, separators=(",", ":"), allow_nan=False)[:-1].encode() + b',"history":['
    try:
        with open(tmp, "wb") as f:
            def put(b: bytes) -> None:
                f.write(b)
                h.update(b)
            put(head)
            sep = b"\n"
            for line in journal.records():
                put(sep + line.rstrip(b"\n"))
                sep = b",\n"
            put(b"\n]}\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            raise NoSpace(path, journal.size, free_bytes(path.parent)) from None
        raise
    return h.hexdigest(), tmp


# ------------------------------------------------------------------ the dashboard's view
ROLES = ("first", "last", "loss_min", "loss_max", "val_min", "val_max", "skipped")


def _pick(recs: List[dict]) -> List[dict]:
    """The records a bucket keeps of recs (in step order): see the module docstring."""
    keep = {"first": recs[0], "last": recs[-1]}
    losses = [r for r in recs if isinstance(r.get("loss"), (int, float))]
    vals = [r for r in recs if isinstance(r.get("val_loss"), (int, float))]
    if losses:
        keep["loss_min"], keep["loss_max"] = min(losses, key=lambda r: r["loss"]), max(losses, key=lambda r: r["loss"])
    if vals:
        keep["val_min"], keep["val_max"] = min(vals, key=lambda r: r["val_loss"]), max(vals, key=lambda r: r["val_loss"])
    skipped = [r for r in recs if r.get("skipped")]
    if skipped:
        keep["skipped"] = skipped[0]
    out = {r["step"]: r for r in keep.values()}
    for a, b in zip(recs, recs[1:]):  # phase changes: the dashboard marks each pivot
        if a.get("phase") != b.get("phase"):
            out[a["step"]], out[b["step"]] = a, b
    return [out[s] for s in sorted(out)]


class HistoryView:
    """A journal's history for the dashboard, read incrementally (see the module docstring)."""

    def __init__(self, max_points: int = MAX_POINTS, max_buckets: int = MAX_BUCKETS):
        self.max_points, self.max_buckets = max_points, max_buckets
        self._reset(None)

    def _reset(self, ident) -> None:
        self.ident, self.offset, self.n = ident, 0, 0
        self.whole: Optional[List[dict]] = []  # every record, until there are more than max_points
        self.width, self.buckets = 1, {}
        self.held: Optional[dict] = None  # the last record read: a later line may replace it

    def update(self, path: Path) -> dict:
        """{"history": [...], "downsampled": null or {records, kept, bucket_steps, rule}}, after
        reading what was appended to the journal at path since the last call."""
        st = os.stat(path)
        if (st.st_dev, st.st_ino) != self.ident or st.st_size < self.offset:
            self._reset((st.st_dev, st.st_ino))  # a new file, or cut back by a restart: read it again
        j = Journal(path, st.st_size)
        for line in j.lines(self.offset):
            if not line.endswith(b"\n"):
                break  # being appended: next time
            try:
                rec = json.loads(line)
                step = step_of(line)
            except ValueError:  # cut back and written again past where this view was: read it all again
                if self.offset == 0:
                    raise
                self._reset(None)
                return self.update(path)
            if self.held is not None and step < self.held["step"]:
                self._reset(None)
                return self.update(path)
            self.offset += len(line)
            if self.held is not None and rec["step"] != self.held["step"]:
                self._add(self.held)
            self.held = rec
        return self.result()

    def _add(self, rec: dict) -> None:
        self.n += 1
        if self.whole is not None:
            self.whole.append(rec)
            if len(self.whole) <= self.max_points:
                return
            recs, self.whole = self.whole, None
            for r in recs:
                self._bucket(r)
            return
        self._bucket(rec)

    def _bucket(self, rec: dict) -> None:
        while rec["step"] // self.width >= self.max_buckets:  # too many buckets: twice as wide
            self.width *= 2
            merged: dict = {}
            for i, recs in sorted(self.buckets.items()):
                merged.setdefault(i // 2, []).extend(recs)
            self.buckets = {i: _pick(recs) for i, recs in merged.items()}
        i = rec["step"] // self.width
        self.buckets[i] = _pick(self.buckets.get(i, []) + [rec])

    def result(self) -> dict:
        tail = [self.held] if self.held is not None else []
        if self.whole is not None:
            return {"history": self.whole + tail, "downsampled": None}
        hist = [r for i in sorted(self.buckets) for r in self.buckets[i]] + tail
        return {"history": hist, "downsampled": {
            "records": self.n + len(tail), "kept": len(hist), "bucket_steps": self.width,
            "rule": "per bucket of steps: first, last, lowest and highest loss and val_loss, "
                    "first skipped step, phase changes"}}
