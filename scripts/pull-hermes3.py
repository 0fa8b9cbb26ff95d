"""Pull the raw chat data of one experiment into a parquet file of conversations.

    python scripts/pull-hermes3.py --config data/synthetic/config/pull.yaml \
        --out data/synthetic/raw/conversations.parquet --report data/synthetic/raw/pull-report.json

--config is any YAML with a `data:` mapping (the workflow's stage file, or a run's resolved
config.yaml). data.source picks where conversations come from:

    hub        NousResearch/Hermes-3-Dataset (data.hub_repo) at the pinned data.revision, through
               `datasets`. Without network it fails within seconds with a hint, never hangs.
    local      a local mirror at data.local_path: a .parquet, .jsonl or .json file, or a folder of
               them. Rows that do not parse or lack the schema are counted and skipped.
    synthetic  data.n_synthetic tasks from andrea.data.synthetic, seeded by data.seed.

Every source ends in the same schema: `conversations: list<{from: str, value: str}>` plus `task`
(the synthetic task kind, null otherwise). data.max_conversations > 0 keeps only the first N.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf
from tqdm import tqdm

from andrea.util.atomic import ParquetStream, atomic_write_json

SCHEMA = pa.schema([
    ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
    ("task", pa.string()),
])
BATCH_ROWS = 10_000
MAX_EXAMPLES = 20  # skipped-row examples kept in the report
CONNECT_TIMEOUT_S = 5.0  # a reachable hub answers a TCP connect well within this
SWITCH_HINT = ("use data.source=synthetic (offline tasks) or data.source=local "
               "data.local_path=/path/to/mirror.parquet|.jsonl")


class PullError(RuntimeError):
    """The source cannot be read; the message says what to change."""


class Writer(ParquetStream):
    """The pulled conversations, up to a cap (data.max_conversations; 0 = all)."""

    def __init__(self, out: Path, cap: int):
        super().__init__(out, SCHEMA, BATCH_ROWS)
        self.cap = cap

    def full(self) -> bool:
        return self.cap > 0 and self.n >= self.cap

    def add(self, conversations, task=None) -> None:
        super().add({"conversations": conversations, "task": task})


class Skips:
    """Counts of skipped rows by reason, with a few examples for the report."""

    def __init__(self):
        self.counts, self.examples = {}, []

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def check_row(row):
    """The row's conversation as [{from, value}] of strings, or ValueError naming what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"row is {type(row).__name__}, expected an object")
    conv = row.get("conversations")
    if not isinstance(conv, (list, tuple)):
        raise ValueError("no 'conversations' list")
    out = []
    for i, t in enumerate(conv):
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
            raise ValueError(f"conversations[{i}] lacks string 'from' and 'value'")
        out.append({"from": t["from"], "value": t["value"]})
    return out


def add_checked(w: Writer, skips: Skips, row, where: str) -> None:
    try:
        conv = check_row(row)
    except ValueError as e:
        skips.add(str(e), where)
        return
    w.add(conv, row.get("task") if isinstance(row.get("task"), str) else None)


# ---------------------------------------------------------------------------------- sources
def pull_synthetic(d, w: Writer, skips: Skips) -> dict:
    from andrea.data.synthetic import generate

    n = d.n_synthetic if not d.max_conversations else min(d.n_synthetic, d.max_conversations)
    for row in tqdm(generate(n, d.seed), desc="synthetic", unit="conv", file=sys.stderr):
        w.add(row["conversations"], row["task"])
    return {"n_synthetic": n, "seed": d.seed}


def local_files(path: Path):
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".parquet", ".jsonl", ".json"))
        if not files:
            raise PullError(f"data.local_path={path}: the folder holds no .parquet, .jsonl or .json files")
        return files
    if not path.is_file():
        raise PullError(f"data.local_path={str(path)!r}: no such file or folder; point it at a parquet or "
                        "jsonl mirror of the dataset")
    if path.suffix not in (".parquet", ".jsonl", ".json"):
        raise PullError(f"data.local_path={path}: expected a .parquet, .jsonl or .json file")
    return [path]


def read_jsonl(path: Path, w: Writer, skips: Skips) -> None:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(tqdm(f, desc=path.name, unit="row", file=sys.stderr), 1):
            if w.full():
                return
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                skips.add("not valid JSON", f"{path}:{lineno}")
                continue
            except RecursionError:  # the parser recurses once per level of [ or {
                skips.add("nested too deeply to parse", f"{path}:{lineno}")
                continue
            add_checked(w, skips, row, f"{path}:{lineno}")


def read_parquet(path: Path, w: Writer, skips: Skips) -> None:
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise PullError(f"data.local_path: {path} is not a readable parquet file ({e})") from e
    if "conversations" not in pf.schema_arrow.names:
        raise PullError(f"{path}: no 'conversations' column (columns: {pf.schema_arrow.names}); expected the "
                        "Hermes 3 schema conversations: [{from, value}, ...]")
    cols = [c for c in ("conversations", "task") if c in pf.schema_arrow.names]
    row_no, groups = 0, pf.metadata.num_row_groups
    with tqdm(total=pf.metadata.num_rows, desc=path.name, unit="row", file=sys.stderr) as bar:
        for g in range(groups):  # one row group at a time, so a corrupt page is named by its group
            for batch in parquet_batches(pf, g, cols, path, row_no):
                for row in batch.to_pylist():
                    row_no += 1
                    if w.full():
                        return
                    add_checked(w, skips, row, f"{path}:row {row_no}")
                bar.update(batch.num_rows)


def parquet_batches(pf, g: int, cols, path: Path, first_row: int):
    """The batches of row group g; a page that does not decode (corrupt compressed data, a bad
    encoding: the footer read fine) is a PullError naming the file and the group. Only the reading
    is guarded: a failure to write the output (a full disk) is not reported as a damaged mirror."""
    it = pf.iter_batches(batch_size=BATCH_ROWS, columns=cols, row_groups=[g])
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as e:
            raise PullError(f"{path}: row group {g} of {pf.metadata.num_row_groups} (rows from {first_row + 1}) "
                            f"cannot be read: {type(e).__name__}: {str(e).strip().rstrip('.')[:300]}; the file is "
                            "damaged: fetch it again or remove it from data.local_path") from e
        yield batch


def pull_local(d, w: Writer, skips: Skips) -> dict:
    if not d.local_path:
        raise PullError("data.source=local needs data.local_path=/path/to/mirror (.parquet, .jsonl or a folder)")
    files = local_files(Path(d.local_path))
    for f in files:
        if w.full():
            break
        if f.suffix == ".parquet":
            read_parquet(f, w, skips)
        elif f.suffix == ".jsonl":
            read_jsonl(f, w, skips)
        else:  # .json: one array of rows
            try:
                rows = json.loads(f.read_bytes())
            except (ValueError, UnicodeDecodeError) as e:
                raise PullError(f"{f}: not valid JSON ({e}); expected an array of rows") from e
            except RecursionError:
                raise PullError(f"{f}: nested too deeply to parse; expected an array of rows, each "
                                "an object with a 'conversations' list") from None
            if not isinstance(rows, list):
                raise PullError(f"{f}: expected a JSON array of rows, got {type(rows).__name__}")
            for i, row in enumerate(rows):
                if w.full():
                    break
                add_checked(w, skips, row, f"{f}:[{i}]")
    return {"local_path": str(d.local_path), "files": [str(f) for f in files]}


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Can a TCP connection to the hub (or the HTTPS proxy in the way) open within timeout?"""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def pull_hub(d, w: Writer, skips: Skips) -> dict:
    # Decided before `datasets` is imported: huggingface_hub reads these once, at import.
    offline = _flag("HF_HUB_OFFLINE") or _flag("HF_DATASETS_OFFLINE")
    if offline:
        print(f"pull-hermes3: WARNING: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set: {d.hub_repo} comes from "
              "the local Hugging Face cache only; unset them to download it", file=sys.stderr)
    if not offline and not hub_reachable():
        print(f"pull-hermes3: WARNING: the hub is not reachable within {CONNECT_TIMEOUT_S:.0f} s; trying the local "
              "Hugging Face cache only", file=sys.stderr)
        offline = True
    if offline:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "60")
    try:
        from datasets import load_dataset
        ds = load_dataset(d.hub_repo, revision=d.revision, split="train")
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        where = "offline mode / no network" if offline else "the hub"
        raise PullError(f"data.source=hub: cannot load {d.hub_repo}@{d.revision} ({where}: "
                        f"{type(e).__name__}: {str(e)[:300]}). No network? Then {SWITCH_HINT}") from e
    if "conversations" not in ds.column_names:
        raise PullError(f"{d.hub_repo}@{d.revision}: no 'conversations' column (columns: {ds.column_names})")
    i = 0
    for batch in tqdm(ds.select_columns(["conversations"]).iter(batch_size=BATCH_ROWS), desc="hub",
                      unit="batch", total=-(-len(ds) // BATCH_ROWS), file=sys.stderr):
        if w.full():
            break
        for conv in batch["conversations"]:
            i += 1
            if w.full():
                break
            add_checked(w, skips, {"conversations": conv}, f"{d.hub_repo}:row {i}")
    return {"hub_repo": d.hub_repo, "revision": d.revision, "offline": offline}


SOURCES = {"synthetic": pull_synthetic, "local": pull_local, "hub": pull_hub}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=Path, help="YAML with a data: mapping")
    ap.add_argument("--out", required=True, type=Path, help="conversations parquet to write")
    ap.add_argument("--report", required=True, type=Path, help="JSON report to write")
    a = ap.parse_args(argv)
    d = OmegaConf.load(a.config).data
    if d.source not in SOURCES:
        print(f"pull-hermes3: {a.config}: data.source={d.source!r}; expected one of {sorted(SOURCES)}",
              file=sys.stderr)
        return 2
    t0 = time.time()
    w, skips = Writer(a.out, int(d.get("max_conversations", 0) or 0)), Skips()
    try:
        info = SOURCES[d.source](d, w, skips)
        w.close()
    except PullError as e:
        w.abort()
        print(f"pull-hermes3: {e}", file=sys.stderr)
        return 2
    except BaseException:  # anything else (a bug, Ctrl-C, a full disk): no half-written parquet left
        w.abort()
        raise
    report = {"source": d.source, **info, "rows": w.n, "skipped": skips.total, "skipped_by_reason": skips.counts,
              "skipped_examples": skips.examples, "wall_s": round(time.time() - t0, 3)}
    atomic_write_json(a.report, report, indent=1)
    print(f"pull-hermes3: {w.n} conversations from {d.source} -> {a.out} ({skips.total} rows skipped)",
          file=sys.stderr)
    if w.n == 0:
        print(f"pull-hermes3: no usable conversation in the source; see {a.report}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
