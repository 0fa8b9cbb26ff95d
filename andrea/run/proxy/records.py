"""The run's records: the files in the run folder, their formats, and the pivot archive.

The proxy (andrea.run.proxy.supervision) feeds the engine's events into RunRecords; readers such as the
dashboard and the report read the files. The history goes first to an append-only journal
(`<exp>.loss.jsonl`, journal.py): a flush appends only the new records, so its cost and the
proxy's memory do not grow with the history. `<exp>.loss.json` is streamed from the journal; it
and the other files are rewritten atomically (temporary file, fsync, os.replace), so a reader never
sees half a file. loss.json is rewritten at every flush while the history is under SMALL_HISTORY
records; past that at forced flushes (checkpoints, validations, restarts) at most 5% of the time,
and always when the proxy ends, so while a long run trains it may lag the journal.

`<exp>.loss.json`, the whole training history, never truncated and never archived:
    {"format": "andrea-loss/1", "exp": str, "total_steps": int, "log_every": int or null,
     "history": [record, ...]}
    one record per logged optimizer step, in increasing step order, each step once; every multiple
    of log_every up to the last record is there (log_every is the least common multiple of the
    train.log_every values the run used; null for a history older than the field):
      step          optimizer steps completed (from 1)
      phase         training phase of the step (train.phases[].name, "pretrain" without phases)
      loss          mean training loss of the step (null when not finite)
      val_loss      validation loss, only on steps where it was measured
      lr            learning rate used by the step
      grad_norm     global gradient norm before clipping (null when not finite)
      loss_scale    dynamic loss scale (1.0 in fp32)
      tokens_per_s  training throughput of the step
      wall_s        engine wall time since its run started, as the engine reports it
      skipped       true when the update was skipped (non-finite gradients)
      t             unix time the proxy received the record
      group, mix, group_loss, group_val_loss
                    only in runs with data groups (docs/FIREHOSE-BANDIT.md): the group the step
                    was drawn from, {group: probability} it was drawn with, {group: smoothed
                    training loss} after it (null: never drawn), {group: held-out loss} where
                    measured
    A record holding only step, phase and val_loss marks a validation at a step that was not logged.
    After an engine restart, records past the resume point are cut from the journal before the
    engine's replay of those steps is appended, so each step appears exactly once and the losses
    are the ones of the checkpointed trajectory. A history a checkpoint once backed is never cut
    back to nothing: an engine that starts from step 0 (its checkpoints gone) finds the records
    moved to previous/step<N>-<time>/ (set_aside) and a new history begun.

`<exp>.loss.jsonl`: the same records, one JSON object a line, "step" first; a line with the step
    of the line before replaces it (journal.py).

`<exp>.samples.json`: {"exp": str, "samples": [{"step", "phase", "t", "samples": [{"prompt",
    "completion"}]}]}, generations from fixed prompts at train.sample_every.

`<exp>.state.json`: {"exp", "status" (running | stopped | finished | failed), "step", "total_steps",
    "phase", "last_checkpoint" (path relative to the run folder), "last_checkpoint_step",
    "restarts" (engine restarts after a crash, counted over the run's whole life), "pid" (proxy),
    "engine_pid", "engine_exit" (last exit code), "n_params", "plan_bytes" (the engine's memory plan,
    bytes), "archives" (list of {"phase",
    "step", "dir"}), "skipped_checkpoints" (list of {"file", "reason"}: checkpoints the engine
    found damaged and did not resume from), "log_every" (the history's), "history_sha256" (the
    sha256 of the last loss.json files the proxy wrote, newest first), "message", "started_at",
    "updated_at"}.

Pivot archive: on the engine's `pivot` event (a checkpoint at a train.phases boundary),
archive_pivot (aside.py) copies `<exp>.samples.json`, `<exp>.state.json` and that checkpoint (.bin and its
.json sidecar) into `archive/<from-phase>-<step>/`; `<exp>.loss.json` stays whole in the run folder.

A history (journal or loss.json), samples or state file that does not parse, holds a field of the
wrong type or (history) misses a logged step raises RecordError at start-up, naming the file, the
entry and what was expected; it is never silently reset. So does a loss.json beside a journal that
the proxy did not write (its sha256 is not in the state and its records are not the journal's
first ones). A loss.json without a journal (a run from before the journal) is read once and the
journal made from it. A last journal line cut by a kill is dropped at start, and said so. A write
that fails (a full disk) is reported once and retried at the next flush; the old files stay whole,
a failed append is cut back, and the records not yet written are kept in memory.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

from andrea.util.atomic import atomic_write, atomic_write_json, sha256_file
from andrea.config import ProxyConfig

from .journal import Journal, encode as journal_line, scan as journal_scan, write_loss_json
from .aside import set_aside

LOSS_FORMAT = "andrea-loss/1"
JOURNAL_SUFFIX = "loss.jsonl"  # <exp>.loss.jsonl, the history journal (journal.py)
SMALL_HISTORY = 5_000  # records; a loss.json this long (about 1 MB) is rewritten in milliseconds
KEEP_SUMS = 4  # sha256 of the last loss.json files written, kept in the state
FLUSH_S = ProxyConfig.record_flush_s  # default when a config carries no proxy group
STEP_FIELDS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "wall_s")
MIX_FIELDS = ("mix", "group_loss")  # {group: number} maps, present only in runs with data groups


class RecordError(ValueError):
    """A run record file (history, samples, state) that is corrupt or does not match the run."""


def _finite(x) -> Optional[float]:
    """JSON has no NaN/Inf (and browsers refuse them), so a non-finite number is recorded as null."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _finite_map(d: dict) -> dict:
    return {str(k): _finite(v) for k, v in d.items()}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _num_or_null(x) -> bool:
    return x is None or _number(x)


def _str_or_null(x) -> bool:
    return x is None or isinstance(x, str)


def _int_or_null(x) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def _number_map(x) -> bool:
    return isinstance(x, dict) and all(_num_or_null(v) for v in x.values())


def _sample_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(s, dict) and isinstance(s.get("prompt"), str)
                                       and isinstance(s.get("completion"), str) for s in x)


def _archive(x) -> bool:
    return (isinstance(x, dict) and isinstance(x.get("phase"), str) and isinstance(x.get("dir"), str)
            and isinstance(x.get("step"), int))


# field -> (test, what is expected), for the fields a record may hold (absent is fine)
ENTRY_FIELDS = {
    "history": {"phase": (_str_or_null, "a string or null"), "skipped": (lambda x: isinstance(x, bool), "true or false"),
                **{k: (_num_or_null, "a number or null") for k in STEP_FIELDS + ("val_loss", "t")},
                "group": (_str_or_null, "a string"),
                **{k: (_number_map, "an object of numbers or nulls") for k in MIX_FIELDS + ("group_val_loss",)}},
    "samples": {"phase": (_str_or_null, "a string or null"), "t": (_num_or_null, "a number or null"),
                "samples": (_sample_list, "a list of {prompt, completion} strings")},
    "archives": {"phase": (lambda x: isinstance(x, str), "a string"), "dir": (lambda x: isinstance(x, str), "a string")},
}
STATE_FIELDS = {
    "status": (lambda x: x in ("running", "stopped", "finished", "failed"), "running, stopped, finished or failed"),
    "step": (_int_or_null, "an integer or null"), "total_steps": (_int_or_null, "an integer or null"),
    "phase": (_str_or_null, "a string or null"), "last_checkpoint": (_str_or_null, "a string or null"),
    "last_checkpoint_step": (_int_or_null, "an integer or null"),
    "restarts": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0, "an integer >= 0"),
    "n_params": (_int_or_null, "an integer or null"), "plan_bytes": (_int_or_null, "an integer or null"),
    "message": (_str_or_null, "a string"),
    "skipped_checkpoints": (lambda x: isinstance(x, list) and all(isinstance(e, dict) for e in x),
                            "a list of {file, reason}"),
    "log_every": (lambda x: x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 1),
                  "an integer >= 1 or null"),
    "history_sha256": (lambda x: isinstance(x, list) and all(isinstance(e, str) for e in x), "a list of strings"),
}


def _load_record(path: Path, key: str, exp: str) -> Optional[dict]:
    """The parsed record file at path (None when absent), or a RecordError saying what is wrong:
    not JSON, another experiment, a step out of order, a field of the wrong type, or (history)
    a logged step missing."""
    if not path.exists():
        return None
    hint = "It was left untouched: repair it, or move it away to start a new record."
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise RecordError(f"{path}: not valid JSON ({e}); the file is corrupt or half-written. {hint}")
    if not isinstance(obj, dict) or not isinstance(obj.get(key, []), list):
        raise RecordError(f"{path}: expected a JSON object with a list under {key!r}. {hint}")
    if obj.get("exp", exp) != exp:
        raise RecordError(f"{path}: exp is {obj.get('exp')!r} but this run is {exp!r}; "
                          f"a record of another experiment? {hint}")
    prev = 0
    fields = ENTRY_FIELDS[key]
    for i, rec in enumerate(obj.get(key, [])):
        step = rec.get("step") if isinstance(rec, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step <= prev:
            raise RecordError(f"{path}: {key}[{i}].step is {step!r} but expected an integer > {prev} "
                              f"(steps strictly increasing). {hint}")
        _check_fields(rec, fields, f"{path}: {key}[{i}].", hint)
        if key == "archives" and not _archive(rec):
            raise RecordError(f"{path}: archives[{i}] is {rec!r} but expected {{phase, step, dir}}. {hint}")
        prev = step
    if key == "archives":  # the state file
        for name, (ok, expected) in STATE_FIELDS.items():
            if name in obj and not ok(obj[name]):
                raise RecordError(f"{path}: {name} is {obj[name]!r} but expected {expected}. {hint}")
    if key == "history":
        every = obj.get("log_every")
        if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
            raise RecordError(f"{path}: log_every is {every!r} but expected an integer >= 1. {hint}")
        logged = {r["step"] for r in obj["history"] if "loss" in r} if "history" in obj else set()
        if every and obj.get("history"):
            last = obj["history"][-1]["step"]
            missing = [s for s in range(every, last + 1, every) if s not in logged]
            if missing:
                some = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
                raise RecordError(f"{path}: {len(missing)} logged step(s) missing ({some}); every multiple of "
                                  f"log_every={every} up to step {last} is expected, each once. {hint}")
    return obj


def _check_fields(rec: dict, fields: dict, where: str, hint: str) -> None:
    """RecordError for the first field of rec that is not what fields expects, named after where
    (the file and the entry: a loss.json index or a journal line)."""
    for name, (ok, expected) in fields.items():
        if name in rec and not ok(rec[name]):
            raise RecordError(f"{where}{name} is {rec[name]!r} (step {rec.get('step')!r}) but expected "
                              f"{expected}. {hint}")


class _Gaps:
    """The logged-step check of a history read in order: every multiple of log_every up to the
    last record is logged (holds "loss"), each once."""

    def __init__(self, every: Optional[int]):
        self.every, self.next, self.last, self.count, self.some = every, every or 0, 0, 0, []

    def add(self, rec: dict) -> None:
        s = rec["step"]
        if self.every and "loss" in rec:
            self._miss_below(s)
            if self.next == s:
                self.next += self.every
        self.last = s

    def _miss_below(self, s: int) -> None:
        while self.next < s:
            self.count += 1
            if len(self.some) < 6:
                self.some.append(self.next)
            self.next += self.every

    def error(self, path: Path, hint: str) -> Optional[RecordError]:
        if self.every:
            self._miss_below(self.last + 1)
        if not self.count:
            return None
        some = ", ".join(map(str, self.some[:5])) + (", ..." if self.count > 5 else "")
        return RecordError(f"{path}: {self.count} logged step(s) missing ({some}); every multiple of "
                           f"log_every={self.every} up to step {self.last} is expected, each once. {hint}")


def _collapse_records(recs: list) -> list:
    """Records in step order where a record may repeat its predecessor's step: the later wins."""
    out: list = []
    for r in recs:
        if out and out[-1]["step"] == r["step"]:
            out[-1] = r
        else:
            out.append(r)
    return out


class RunRecords:
    """The record files of one run folder: the history journal (appended), loss.json derived
    from it, samples and state (rewritten atomically). Holds the records of one flush interval,
    never the whole history."""

    def __init__(self, exp: str, run_dir: Path, total_steps: int, flush_s: float = FLUSH_S, log_every: int = 1):
        self.run_dir, self.flush_s = run_dir, flush_s
        self.loss_path = run_dir / f"{exp}.loss.json"
        self.journal_path = run_dir / f"{exp}.{JOURNAL_SUFFIX}"
        self.samples_path = run_dir / f"{exp}.samples.json"
        self.state_path = run_dir / f"{exp}.state.json"
        samples = _load_record(self.samples_path, "samples", exp)
        state = _load_record(self.state_path, "archives", exp)
        self.state_loaded = state is not None
        self.notes: list = []  # what opening the records found and mended, for the proxy to say
        self._pending: list = []  # records not in the journal yet (one flush interval)
        self._migrating = False  # a loss.json without a journal: the first flush writes the journal
        old_every = self._open_history(exp, state)
        # a history without its state file: whether a checkpoint ever backed it is not known
        self.orphan = bool(self.n_records) and state is None
        self.samples: list = samples["samples"] if samples else []
        # the multiples of log_every are always logged; a resume may change train.log_every, and the
        # multiples of both the old and the new one are logged in both parts of the history
        every = math.lcm(old_every, log_every) if old_every else log_every
        if self.n_records and not old_every:
            every = None  # written before the field existed: which steps were logged is not known
        self.loss_meta = {"format": LOSS_FORMAT, "exp": exp, "total_steps": total_steps, "log_every": every}
        self.state = {"exp": exp, "status": "running", "step": self.last_step(), "total_steps": total_steps,
                      "phase": None, "last_checkpoint": None, "last_checkpoint_step": None,
                      "restarts": 0, "pid": os.getpid(), "engine_pid": None, "engine_exit": None,
                      "n_params": None, "plan_bytes": None, "archives": [], "message": ""}
        for k in ("phase", "last_checkpoint", "last_checkpoint_step", "restarts", "n_params", "plan_bytes", "archives",
                  "skipped_checkpoints", "history_sha256"):
            if state and k in state:
                self.state[k] = state[k]
        self.state["started_at"] = self.state["updated_at"] = time.time()
        self._last_flush = 0.0
        self._whole_at, self._whole_s = 0.0, 0.0  # when loss.json was last written, and how long it took
        self.write_error: Optional[str] = None  # the last failed rewrite, until one succeeds

    # opening -----------------------------------------------------------------------------------
    def _open_history(self, exp: str, state: Optional[dict]) -> Optional[int]:
        """Read the history (the journal, else a loss.json written before it), check it, and return
        its log_every; sets journal, n_records and the last record."""
        every = state.get("log_every") if state else None
        self.journal = Journal(self.journal_path, 0)
        self.n_records, self._last = 0, None
        if self.journal_path.exists():
            self._scan_journal(every)
            if self.loss_path.exists():
                every = self._check_loss_json(exp, state, every)
        elif self.loss_path.exists():
            loss = _load_record(self.loss_path, "history", exp)
            self._pending, self._migrating = list(loss["history"]), True
            self.n_records, self._last = len(self._pending), (self._pending or [None])[-1]
            every = loss.get("log_every")
        return every

    def _scan_journal(self, every: Optional[int]) -> None:
        path, hint = self.journal_path, "It was left untouched: repair it, or move it away to start a new record."
        fields, gaps = ENTRY_FIELDS["history"], _Gaps(every)
        held: list = []

        def check(i: int, rec: dict) -> None:
            step, prev = rec.get("step"), held[0]["step"] if held else 0
            if not isinstance(step, int) or isinstance(step, bool) or step < max(prev, 1):
                raise RecordError(f"{path}: line {i}: step is {step!r} but expected an integer >= {max(prev, 1)} "
                                  f"(steps increasing; a repeated step replaces the line before). {hint}")
            _check_fields(rec, fields, f"{path}: line {i}: ", hint)
            if held and held[0]["step"] != step:
                gaps.add(held[0])
            held[:] = [rec]

        try:
            size, self.n_records, self._last, dropped = journal_scan(path, check)
        except ValueError as e:
            if isinstance(e, RecordError):
                raise
            raise RecordError(f"{path}: {e}. {hint}") from None
        if held:
            gaps.add(held[0])
        err = gaps.error(path, hint)
        if err is not None:
            raise err
        self.journal = Journal(path, size)
        if dropped:
            self.notes.append(f"{path}: {dropped}; the {self.n_records} record(s) before it are kept")

    def _check_loss_json(self, exp: str, state: Optional[dict], every: Optional[int]) -> Optional[int]:
        """loss.json beside a journal is one the proxy derived from it (perhaps older): its sha256
        is one the state recorded, or its records are the journal's first ones. Anything else was
        changed by someone: RecordError, nothing touched."""
        sums = state.get("history_sha256") if state else None
        if isinstance(sums, list) and sha256_file(self.loss_path) in sums:
            return every
        loss = _load_record(self.loss_path, "history", exp)
        hist, why = loss["history"], "it was changed after the proxy wrote it. Nothing was changed: move"
        if len(hist) > self.n_records:
            raise RecordError(f"{self.loss_path}: {len(hist)} records but the history journal {self.journal_path.name} "
                              f"holds {self.n_records}; {why} one of them away to go on from the other")
        for k, line in zip(range(len(hist)), self.journal.records()):
            if json.loads(line) != hist[k]:
                raise RecordError(f"{self.loss_path}: history[{k}] (step {hist[k]['step']}) differs from the history "
                                  f"journal {self.journal_path.name}; {why} {self.loss_path.name} away to go on from "
                                  "the journal, or the journal away to go on from it")
        return every if every is not None else loss.get("log_every")

    # the history -------------------------------------------------------------------------------
    @property
    def history(self) -> list:
        """The whole history as a list, read from the journal: for tests and small runs; the proxy
        itself never holds it."""
        lines = [] if self._migrating else list(self.journal.lines())
        return _collapse_records([json.loads(ln) for ln in lines] + self._pending)

    def last_step(self) -> int:
        return self._last["step"] if self._last else 0

    def _push(self, rec: dict) -> None:
        self._pending.append(rec)
        self._last = rec
        self.n_records += 1

    def _replace_last(self, rec: dict) -> None:
        """rec replaces the last record (same step): in memory, or by a line that replaces it."""
        if self._pending and self._pending[-1]["step"] == rec["step"]:
            self._pending[-1] = rec
        else:
            self._pending.append(rec)
        self._last = rec

    def drop_from(self, step: int) -> int:
        """Forget records of steps >= step (a restarted engine replays them); returns how many."""
        gone = {r["step"] for r in self._pending if r["step"] >= step}
        self._pending = [r for r in self._pending if r["step"] < step]
        dropped = len(gone)
        if not self._pending and not self._migrating and self.journal.size:
            tail = self.journal.last()
            cut = self.journal.truncate_from(step)
            dropped += cut - (1 if cut and tail["step"] in gone else 0)
        self._last = self._pending[-1] if self._pending else (None if self._migrating else self.journal.last())
        self.n_records -= dropped
        self.samples = [s for s in self.samples if s["step"] < step]
        return dropped

    def _pull_from(self, step: int) -> None:
        """Move the journal's records of steps >= step back into memory (a rare out-of-order
        validation); the next flush appends them again. The file itself is not cut here: the next
        append cuts it to the journal's size first, so a kill before that flush finds those records
        still in the file (without the validation) instead of losing them."""
        if self._migrating or not self.journal.size or (self._pending and self._pending[0]["step"] <= step):
            return
        offset, lines, _ = self.journal.tail(step)
        if lines:
            self._pending = _collapse_records([json.loads(ln) for ln in lines] + self._pending)
            self.journal.size = offset

    def add_step(self, ev: dict) -> dict:
        n = int(ev["step"])
        rec = {"step": n, "phase": ev.get("phase", self.state["phase"])}
        rec.update({k: _finite(ev.get(k)) for k in STEP_FIELDS})
        rec["skipped"] = bool(ev.get("skipped", False))
        if "group" in ev:
            rec["group"] = str(ev["group"])
        for k in MIX_FIELDS:
            if isinstance(ev.get(k), dict):
                rec[k] = _finite_map(ev[k])
        rec["t"] = time.time()
        last = self._last
        if last is not None and last["step"] == n and "loss" not in last:
            rec["val_loss"] = last.get("val_loss")  # a validation arrived first
            if "group_val_loss" in last:
                rec["group_val_loss"] = last["group_val_loss"]
            self._replace_last(rec)
        else:
            if last is not None and last["step"] >= n:
                self.drop_from(n)  # a replay without a resume event: keep each step once
            self._push(rec)
        self.state.update(step=n, phase=rec["phase"])
        return rec

    def add_val(self, ev: dict) -> None:
        n, v = int(ev["step"]), _finite(ev.get("val_loss"))
        extra = {"group_val_loss": _finite_map(ev["group_val_loss"])} if isinstance(ev.get("group_val_loss"), dict) else {}
        if self._last is not None and self._last["step"] > n:
            self._pull_from(n)  # the engine validates the step it just logged; this is the rare other case
            i = bisect.bisect_left([r["step"] for r in self._pending], n)
            if i < len(self._pending) and self._pending[i]["step"] == n:
                self._pending[i] = {**self._pending[i], "val_loss": v, **extra}
            else:
                self._pending.insert(i, {"step": n, "phase": self.state["phase"], "val_loss": v, **extra})
                self.n_records += 1
        elif self._last is not None and self._last["step"] == n:
            self._replace_last({**self._last, "val_loss": v, **extra})
        else:
            self._push({"step": n, "phase": self.state["phase"], "val_loss": v, **extra})

    def add_samples(self, ev: dict) -> None:
        n = int(ev["step"])
        self.samples = [s for s in self.samples if s["step"] < n]
        self.samples.append({"step": n, "phase": self.state["phase"], "t": time.time(),
                             "samples": list(ev.get("samples", []))})
        self.write_samples()

    def set_checkpoint(self, path: str, step: int) -> None:
        p = Path(path)
        try:
            p = p.resolve().relative_to(self.run_dir.resolve())
        except ValueError:
            pass  # outside the run folder: keep it as the engine gave it
        self.state.update(last_checkpoint=str(p), last_checkpoint_step=int(step))

    def keep_aside(self, label: str) -> Path:
        """Move this run's record files, archive/ and trained/ to previous/<label>-<time>/ (set_aside)
        and go on with an empty history: the state keeps only what describes the process."""
        dest = set_aside(self.run_dir, record_names(self.loss_meta["exp"]) + ("archive", "trained"), label)
        self.journal, self._pending, self._migrating = Journal(self.journal_path, 0), [], False
        self.n_records, self._last, self.samples, self.orphan = 0, None, [], False
        self.state.update(step=0, phase=None, last_checkpoint=None, last_checkpoint_step=None, archives=[],
                          skipped_checkpoints=[], history_sha256=[])
        self.write_samples()
        self.flush(force=True, whole=True)
        return dest

    # writing -----------------------------------------------------------------------------------
    def write_samples(self) -> None:
        atomic_write_json(self.samples_path, {"exp": self.loss_meta["exp"], "samples": self.samples})

    def _append_pending(self) -> None:
        lines = [journal_line(r) for r in self._pending]
        if self._migrating:  # the journal made whole from a loss.json of before it, then renamed
            atomic_write(self.journal_path, lines)
            self.journal, self._migrating = Journal(self.journal_path, sum(map(len, lines))), False
        else:
            self.journal.append(lines)
        self._pending = []

    def _whole_due(self, force: bool) -> bool:
        """loss.json is rewritten at every flush while the history is small (milliseconds); past
        SMALL_HISTORY records, only at forced flushes (checkpoints, validations, restarts) and at
        most 5% of the time."""
        if self.n_records <= SMALL_HISTORY:
            return True
        return force and time.time() - self._whole_at >= 20 * self._whole_s

    def _write_whole(self) -> None:
        """loss.json streamed from the journal; its sha256 goes into the state first, so the next
        start knows it as the proxy's own whatever moment a kill comes."""
        t0 = time.time()
        sha, tmp = write_loss_json(self.journal, self.loss_path, self.loss_meta)
        try:
            self.state["history_sha256"] = [sha] + [s for s in self.state.get("history_sha256") or []
                                                    if s != sha][:KEEP_SUMS - 1]
            atomic_write_json(self.state_path, self.state)
            os.replace(tmp, self.loss_path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._whole_at = time.time()
        self._whole_s = self._whole_at - t0

    def flush(self, force: bool = False, whole: bool = False) -> None:
        """Append the new records to the journal and rewrite the state; unforced flushes at most
        once per flush_s seconds. loss.json is rewritten when _whole_due says so, and always with
        whole=True (the proxy's last flush)."""
        now = time.time()
        if not force and now - self._last_flush < self.flush_s:
            return
        self.state["updated_at"] = now
        self.state["log_every"] = self.loss_meta["log_every"]
        try:
            self._append_pending()
            if whole or self._whole_due(force) or (force and not self.loss_path.exists()):
                self._write_whole()
            else:
                atomic_write_json(self.state_path, self.state)
        except OSError as e:  # a full disk: the old files stay whole, the records stay in memory
            first = self.write_error is None
            self.write_error = str(e)
            self._last_flush = time.time()
            if first:
                print(f"andrea.run.proxy: cannot rewrite the run records: {e}; retrying at the next flush",
                      file=sys.stderr)
            return
        if self.write_error is not None:
            print("andrea.run.proxy: the run records are written again", file=sys.stderr)
        self.write_error = None
        self._last_flush = time.time()


def record_names(exp: str) -> tuple:
    """The names of a run's record files, as set_aside moves them."""
    return tuple(f"{exp}.{kind}.json" for kind in ("loss", "samples", "state")) + (f"{exp}.{JOURNAL_SUFFIX}",)
