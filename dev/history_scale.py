"""The proxy's history at scale: memory and flush cost at 10K, 100K and 1M steps.

    python dev/history_scale.py [--steps 10000,100000,1000000] [--flush-every 100]

Each size runs in a fresh process: synthetic step events (and a validation every 250 steps) go
through the proxy's real record path (Supervisor._handle, RunRecords, the journal), with an
unforced flush every --flush-every steps (1 s of a run at 100 steps/s). It prints one table row per
size: the process's resident memory after the last step (and its growth since the first), the
median time and the mean bytes of the last 50 flushes (a journal append and the state file, each
fsynced), the records held in memory after a flush, the time to write loss.json whole from the
journal and its size, the time a new proxy takes to open the records (the journal's check), and
the dashboard's first read of the journal (later reads take only what was appended) and the size
of what it serves. Timings are wall-clock on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EVAL_EVERY = 250


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def one(steps: int, flush_every: int) -> dict:
    from omegaconf import OmegaConf

    from andrea.run.proxy import RunRecords, Supervisor

    run = Path(tempfile.mkdtemp(prefix="history-scale-"))
    cfg = OmegaConf.create({"exp": "h", "train": {"steps": steps, "log_every": 1}})
    sup = Supervisor(cfg, run, max_restarts=0, backoff_s=0, backoff_max_s=0, flush_s=3600, progress=False,
                     on_event=None, engine_argv=["true"])
    rec = sup.rec
    life = {"resume": 0, "stepped": True, "ckpt": -1, "done": None, "error": None}
    base = rss_mib()
    flushes = []
    for s in range(1, steps + 1):
        ev = {"event": "step", "step": s, "phase": "pretrain", "loss": 4.0 / (1 + s) ** 0.1 + (s % 7) * 1e-3,
              "lr": 3e-4, "grad_norm": 0.5 + (s % 13) * 0.01, "loss_scale": 65536.0, "tokens_per_s": 512000.0 + s,
              "wall_s": s * 0.015, "skipped": False}
        rec._last_flush = time.time()  # the step event's own flush stays throttled; the timed one below is it
        sup._handle(ev, life)
        if s % EVAL_EVERY == 0:
            rec.add_val({"step": s, "val_loss": 3.0 / (1 + s) ** 0.1})
        if s % flush_every == 0:
            before = rec.journal.size
            rec._last_flush = 0.0
            t0 = time.perf_counter()
            rec.flush()
            flushes.append((time.perf_counter() - t0, rec.journal.size - before))
    rss = rss_mib()
    t0 = time.perf_counter()
    rec.flush(force=True, whole=True)
    whole_s = time.perf_counter() - t0
    loss_mb = rec.loss_path.stat().st_size / 2 ** 20
    t0 = time.perf_counter()
    again = RunRecords("h", run, steps)
    open_s = time.perf_counter() - t0
    assert again.n_records == steps and again.last_step() == steps
    from andrea.run.proxy.journal import HistoryView

    t0 = time.perf_counter()
    view = json.dumps(HistoryView().update(rec.journal_path), separators=(",", ":"))
    view_s = time.perf_counter() - t0
    with open(rec.loss_path) as f:  # the meaning: the full history, one record a step
        head = f.read(200)
    assert head.startswith('{"format":"andrea-loss/1"')
    last = sorted(flushes[-50:])
    out = {"steps": steps, "rss_mib": rss, "rss_growth_mib": rss - base,
           "flush_ms": 1e3 * last[len(last) // 2][0], "flush_kib": sum(b for _, b in last) / len(last) / 1024,
           "view_s": view_s, "view_kib": len(view) / 1024,
           "held_records": len(rec._pending), "whole_s": whole_s, "loss_json_mib": loss_mb, "open_s": open_s}
    for p in run.iterdir():
        p.unlink()
    run.rmdir()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="10000,100000,1000000")
    ap.add_argument("--flush-every", type=int, default=100)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one size, JSON out
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.flush_every)))
        return 0
    print("| steps | proxy RSS (MiB) | RSS growth over the run (MiB) | flush (ms) | bytes per flush (KiB) "
          "| records held | loss.json whole (s) | loss.json (MiB) | reopen (s) | dashboard first load (s) "
          "| dashboard response (KiB) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (int(x) for x in a.steps.split(",")):
        r = subprocess.run([sys.executable, __file__, "--one", str(n), "--flush-every", str(a.flush_every)],
                           capture_output=True, text=True, check=True)
        d = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"| {n:,} | {d['rss_mib']:.1f} | {d['rss_growth_mib']:.1f} | {d['flush_ms']:.2f} | {d['flush_kib']:.1f} "
              f"| {d['held_records']} | {d['whole_s']:.2f} | {d['loss_json_mib']:.1f} | {d['open_s']:.2f} "
              f"| {d['view_s']:.2f} | {d['view_kib']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
