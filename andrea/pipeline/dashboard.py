"""Live loss dashboard: a small HTTP server for andrea/web/dashboard.html and the run records.

    python -m andrea.pipeline.dashboard results/ANDREA-tiny [more run folders] [--port 8765] [--host 127.0.0.1]

It binds 127.0.0.1 unless told otherwise, prints the address, and serves exactly:
    /  (and /index.html)              the page, which polls the records every 2 s
    /runs.json                        the runs given on the command line, the URLs of their files and
                                      the batches of their validation losses (train.eval_batches)
    /runs/<i>/<exp>.loss.json         the proxy's record files of run i (also .samples.json,
    /runs/<i>/<exp>.state.json        .state.json); <exp> is config.yaml's exp, else the folder's name
    /runs/<i>/tasks.json              its eval/tasks.json once evaluated (the standard tasks'
                                      scores: the runs table's suite column; andrea/tasks/results.py)
Requests are matched against this fixed table before any decoding, so no other path (`/../x`,
`/%2e%2e/x`, absolute paths, other files in a run folder) can be reached: everything else is 404. A
record file that is a symlink, a hard link (more than one link: the proxy's atomic writes always
leave exactly one), or resolves outside its run folder, is 404 as well. Record files carry an ETag,
so a poll of an unchanged file costs a 304 and no transfer. A connection that sends nothing for
IDLE_TIMEOUT_S seconds is closed, so stalled clients cannot hold the server's threads.

A run whose proxy keeps a history journal (<exp>.loss.jsonl) gets its loss history from there,
live: whole up to 5,000 records; past that, steps are grouped in at most 1,000 buckets and each
keeps its first and last records and those of its lowest and highest loss and validation loss
(so spikes survive), its first skipped step and its phase changes; "downsampled" then says how
many records there are, how many were kept and the bucket width in steps.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional, Sequence

from ..paths import DASHBOARD_PAGE
from ..run.proxy.journal import HistoryView
from ..run.proxy.records import LOSS_FORMAT

PAGE = DASHBOARD_PAGE
KINDS = ("loss", "samples", "state")
DEFAULT_PORT = 8765
IDLE_TIMEOUT_S = 20.0  # a connection silent this long is closed (the page polls every 2 s)
# The page needs nothing from outside this server; the browser enforces that too.
PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")


def _config(run_dir: Path) -> dict:
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        cfg = None  # no config yet, or not one we can read
    return cfg if isinstance(cfg, dict) else {}


def exp_of(run_dir: Path) -> str:
    """The run whose records a run folder holds: `exp` of its config.yaml when that is a plain name
    (letters, digits and ._=,+- as run names with overrides have, andrea/pipeline/runs.py), else the folder's
    name (results/<exp>)."""
    exp = _config(run_dir).get("exp")
    if isinstance(exp, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._=,+-]*", exp):
        return exp
    return run_dir.name


def label_of(run_dir: Path, exp: str) -> str:
    """The run's label on the page: its experiment and the overrides that changed what it trained
    (`ANDREA-tiny: train.lr=1e-3`), the folder's name in brackets when it differs from the run's."""
    from .runs import base_experiment, naming_overrides

    ov = _config(run_dir).get("overrides")
    ov = naming_overrides(str(o) for o in ov) if isinstance(ov, list) else []
    name = f"{base_experiment(exp) if ov else exp}: {' '.join(ov)}" if ov else exp
    return name if exp == run_dir.name else f"{name} ({run_dir.name})"


def build_routes(run_dirs: Sequence[Path]) -> tuple:
    """(index object, {url path: (run folder, file name)}) for the given run folders."""
    runs, files = [], {}
    for i, d in enumerate(run_dirs):
        d = Path(d)
        if not d.is_dir():
            raise FileNotFoundError(f"run folder {d}: no such directory")
        d = d.resolve()
        exp = exp_of(d)
        # the batches training's validation losses average (train.eval_batches; the report's own
        # figure uses eval.batches), for the page to print beside them
        train = _config(d).get("train")
        batches = train.get("eval_batches") if isinstance(train, dict) else None
        entry = {"id": i, "name": label_of(d, exp), "exp": exp, "dir": str(d),
                 "val_batches": batches if isinstance(batches, int) else None}
        for kind in KINDS:
            url = f"/runs/{i}/{exp}.{kind}.json"
            files[url] = (d, f"{exp}.{kind}.json")
            entry[kind] = url
        files[f"/runs/{i}/tasks.json"] = (d, "eval/tasks.json")
        entry["benchmarks"] = f"/runs/{i}/tasks.json"
        runs.append(entry)
    return {"runs": runs}, files


class DashboardHandler(BaseHTTPRequestHandler):
    server_version = "andrea-dashboard"
    sys_version = ""

    @property
    def timeout(self) -> float:  # read by StreamRequestHandler.setup(): a socket timeout per connection
        return self.server.idle_timeout

    def do_GET(self):
        self._serve(body=True)

    def do_HEAD(self):
        self._serve(body=False)

    def log_message(self, fmt, *args):
        if self.server.verbose:
            super().log_message(fmt, *args)

    def _serve(self, body: bool) -> None:
        path = self.path.split("?", 1)[0].split("#", 1)[0]  # raw path: never unquoted, never joined
        srv = self.server
        if path in ("/", "/index.html"):
            return self._send(srv.page_bytes(), "text/html; charset=utf-8", body, {"Content-Security-Policy": PAGE_CSP})
        if path == "/runs.json":
            return self._send(json.dumps(srv.index).encode(), "application/json", body)
        if path in srv.files:
            return self._send_record(*srv.files[path], body)
        self._not_found(body)

    def _send_record(self, run_dir: Path, name: str, body: bool) -> None:
        if name.endswith(".loss.json") and os.path.lexists(run_dir / (name + "l")):
            return self._send_history(run_dir, run_dir / (name + "l"), body)  # <exp>.loss.jsonl
        target = run_dir / name
        try:
            if target.is_symlink() or not target.resolve().is_relative_to(run_dir):
                return self._not_found(body)
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # not written yet (the run has not started) or vanished
            return self._not_found(body)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_nlink != 1:  # a hard link to some other file, made after the proxy wrote it
                return self._not_found(body)
            etag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
            if self._not_modified(etag):
                return
            data = f.read()
        self._send(data, "application/json", body, {"ETag": etag})

    def _send_history(self, run_dir: Path, journal: Path, body: bool) -> None:
        """The loss history from the proxy's journal: live, whole up to MAX_POINTS records, past
        that the records per bucket of steps that keep its spikes (journal.HistoryView)."""
        try:
            if journal.is_symlink() or not journal.resolve().is_relative_to(run_dir):
                return self._not_found(body)
            st = os.stat(journal, follow_symlinks=False)
        except OSError:
            return self._not_found(body)
        if st.st_nlink != 1:
            return self._not_found(body)
        etag = f'"j{st.st_mtime_ns:x}-{st.st_size:x}"'
        if self._not_modified(etag):
            return
        try:
            data = self.server.history_of(journal)
        except (OSError, ValueError):  # vanished, or cut back by a restart while read: the next poll
            return self._not_found(body)
        self._send(data, "application/json", body, {"ETag": etag})

    def _not_modified(self, etag: str) -> bool:
        """Answer 304 when the client holds this version already (its If-None-Match is etag)."""
        if self.headers.get("If-None-Match") != etag:
            return False
        self.send_response(HTTPStatus.NOT_MODIFIED)
        self.send_header("ETag", etag)
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        return True

    def _send(self, data: bytes, ctype: str, body: bool, extra: Optional[dict] = None) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache")  # always revalidate: the files change live
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _not_found(self, body: bool) -> None:
        data = b"not found\n"
        self.send_response(HTTPStatus.NOT_FOUND)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, run_dirs: Sequence[Path], host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 page: Path = PAGE, verbose: bool = False, idle_timeout: float = IDLE_TIMEOUT_S):
        if not Path(page).is_file():
            raise FileNotFoundError(f"dashboard page {page}: no such file")
        self.page, self.verbose, self.idle_timeout = Path(page), verbose, idle_timeout
        self.index, self.files = build_routes(run_dirs)
        self.views, self.views_lock = {}, threading.Lock()  # journal -> (HistoryView, its lock)
        super().__init__((host, port), DashboardHandler)

    def history_of(self, journal: Path) -> bytes:
        """The history of a journal as the page reads loss.json, with "downsampled" added; each
        journal's view reads only what was appended since the last request."""
        with self.views_lock:
            view, lock = self.views.setdefault(journal, (HistoryView(), threading.Lock()))
        with lock:
            hist = view.update(journal)
            exp = journal.name[:-len(".loss.jsonl")]
            return json.dumps({"format": LOSS_FORMAT, "exp": exp, **hist}, separators=(",", ":"),
                              allow_nan=False).encode()

    def page_bytes(self) -> bytes:
        return self.page.read_bytes()  # read per request, so an edited page shows on reload

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m andrea.pipeline.dashboard", description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path, help="run folders, e.g. results/ANDREA-tiny")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    ap.add_argument("--verbose", action="store_true", help="log every request on stderr")
    a = ap.parse_args(argv)
    try:
        srv = DashboardServer(a.run_dirs, a.host, a.port, verbose=a.verbose)
    except FileNotFoundError as e:
        print(f"andrea.pipeline.dashboard: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the port is taken, or the address is not this machine's
        print(f"andrea.pipeline.dashboard: cannot listen on {a.host}:{a.port}: {e.strerror or e}; "
              f"choose another --port (0 = any free one)", file=sys.stderr)
        return 2
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"andrea.pipeline.dashboard: bound to {a.host}: other machines can read these runs' records", file=sys.stderr)
    names = ", ".join(r["name"] for r in srv.index["runs"])
    print(f"andrea.pipeline.dashboard: {names} at {srv.url}  (Ctrl-C to stop)", flush=True)
    # Set explicitly: a process started in the background by a non-interactive shell inherits
    # SIGINT ignored, and Python then never turns Ctrl-C into KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
