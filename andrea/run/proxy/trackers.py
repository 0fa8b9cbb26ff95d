"""Experiment trackers fed from the proxy's records: TensorBoard, MLflow, Weights & Biases.

Opt-in, any subset: `proxy.trackers=[tensorboard,mlflow,wandb]`. Each writes offline under
`<run>/trackers/`, nothing leaves the machine:

    tensorboard   event files in trackers/tensorboard/   (tensorboard --logdir results/<run>/trackers/tensorboard)
    mlflow        MLflow's file store in trackers/mlruns/ (MLflow 3 reads it with MLFLOW_ALLOW_FILE_STORE=true:
                  mlflow ui --backend-store-uri results/<run>/trackers/mlruns);
                  experiment = the experiment, run = the run name, params = the resolved config
    wandb         W&B offline mode in trackers/wandb/     (wandb sync results/<run>/trackers/wandb/offline-run-*)

Every logged step gives its numbers (loss, lr, grad_norm, loss_scale, tokens_per_s, wall_s; in a
run with data groups mix/<group> and group_loss/<group>) at its step; every validation its
val_loss (and group_val_loss/<group>). A step replayed after an engine restart is not logged twice.

A tracker never stops or slows a run. Its package is not a dependency of andrea: where it is
missing, one warning line says so and the run goes on without it. The proxy only puts each record
on a queue (never waits); one thread imports the packages and writes, off the record path. A
tracker that raises is reported once and dropped; the others go on. A tracker too slow for the
run loses records past MAX_PENDING (reported once). At the end the proxy waits CLOSE_WAIT_S at
most for the writes still pending.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from andrea.config import TRACKERS

MAX_PENDING = 100_000  # records waiting for the trackers' thread before new ones are dropped
CLOSE_WAIT_S = 30.0  # longest wait for pending writes when the run ends
STEP_NUMBERS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "wall_s")
STEP_MAPS = ("mix", "group_loss")
VAL_MAPS = ("group_val_loss",)
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}  # pip names
_DONE = object()


def _say(msg: str) -> None:
    print(f"andrea.run.proxy: {msg}", file=sys.stderr)


def metrics_of(ev: dict) -> Dict[str, float]:
    """The finite numbers of a step or val event, nested maps flattened to <field>/<key>."""
    out = {}
    numbers, maps = (STEP_NUMBERS, STEP_MAPS) if ev.get("event") == "step" else (("val_loss",), VAL_MAPS)
    for k in numbers:
        v = ev.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    for k in maps:
        for g, v in (ev.get(k) or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[f"{k}/{g}"] = float(v)
    return out


def flat_params(d: dict, prefix: str = "") -> Dict[str, str]:
    """A nested config dict as {dotted key: text}: MLflow params, W&B config."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_params(v, key + "."))
        else:
            out[key] = str(v)
    return out


class TensorBoard:
    """Scalars in TensorBoard event files (tensorboard's own writer; no TensorFlow, no torch)."""

    package = "tensorboard"

    def __init__(self, root: Path, exp: str, params: dict):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.Event, self.Summary = Event, Summary
        self.writer = EventFileWriter(str(root / "tensorboard"), flush_secs=5)

    def log(self, step: int, metrics: dict, t: float) -> None:
        values = [self.Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self.writer.add_event(self.Event(wall_time=t, step=step, summary=self.Summary(value=values)))

    def close(self, status: str) -> None:
        self.writer.close()


class MLflow:
    """An MLflow run in a local file store: experiment = the experiment, run = the run name; a
    resumed run goes on in the same MLflow run (its id is kept in mlruns/<exp>.run_id)."""

    package = "mlflow"

    def __init__(self, root: Path, exp: str, params: dict):
        # MLflow 3 keeps its file store only on request; this store is local to the run folder
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        store = root / "mlruns"
        store.mkdir(parents=True, exist_ok=True)
        self.client = c = MlflowClient(tracking_uri=store.resolve().as_uri())
        experiment = exp.split("+", 1)[0]
        found = c.get_experiment_by_name(experiment)
        eid = found.experiment_id if found is not None else c.create_experiment(experiment)
        id_file = store / f"{exp}.run_id"
        self.run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if self.run_id:
            c.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = c.create_run(eid, run_name=exp).info.run_id
            items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):  # MLflow takes 100 params per batch
                c.log_batch(self.run_id, params=items[i:i + 100])
            id_file.write_text(self.run_id)

    def log(self, step: int, metrics: dict, t: float) -> None:
        ms = int(t * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, ms, step) for k, v in metrics.items()])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status={"finished": "FINISHED", "failed": "FAILED"}.get(status, "KILLED"))


class Wandb:
    """A Weights & Biases run in offline mode (wandb sync uploads it later); a resumed run goes
    on under the same id."""

    package = "wandb"

    def __init__(self, root: Path, exp: str, params: dict):
        import wandb

        run_id = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
        (root / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(mode="offline", dir=str(root), project=exp.split("+", 1)[0], name=exp, id=run_id,
                              resume="allow", config=params)

    def log(self, step: int, metrics: dict, t: float) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


KINDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": Wandb}
assert tuple(KINDS) == TRACKERS


class Trackers:
    """The run's trackers behind one queue and one thread. feed() never waits; close() waits
    CLOSE_WAIT_S at most. With no trackers named, both do nothing."""

    def __init__(self, names: List[str], root: Path, exp: str, params: Optional[dict] = None,
                 say: Callable[[str], None] = _say, kinds: Optional[dict] = None):
        self.names, self.root, self.exp, self.params = list(names), Path(root), exp, params or {}
        self.say, self.kinds = say, kinds or KINDS
        self.q: "queue.Queue" = queue.Queue(maxsize=MAX_PENDING)
        self.last = {"step": 0, "val": 0}  # newest step fed of each kind: a replay is not fed again
        self.dropped = 0
        self.sinks: dict = {}
        self.thread: Optional[threading.Thread] = None
        if self.names:
            self.thread = threading.Thread(target=self._work, name="andrea-trackers", daemon=True)
            self.thread.start()

    # the proxy's side: never waits, never raises ------------------------------------------------
    def feed(self, ev: dict) -> None:
        """An engine event as the proxy recorded it: steps and validations go to the trackers."""
        try:
            kind = ev.get("event")
            if self.thread is None or kind not in self.last:
                return
            step = int(ev["step"])
            if step <= self.last[kind]:
                return
            self.last[kind] = step
            self.q.put_nowait((step, metrics_of(ev), float(ev.get("t") or time.time())))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                self.say(f"trackers: more than {MAX_PENDING} records waiting; later ones are not sent to "
                         f"{', '.join(self.names)} (the run's own records keep them all)")
        except Exception as e:  # noqa: BLE001 (a record this module does not understand: the run goes on)
            self._report("feed", e)

    def close(self, status: str = "finished", wait_s: float = CLOSE_WAIT_S) -> None:
        """Send what is pending, then close each tracker (status: the run's, finished | stopped |
        failed); gives up after wait_s, saying so."""
        if self.thread is None:
            return
        deadline = time.monotonic() + wait_s  # one wait in all: a full queue's and the writes'
        try:
            self.q.put((_DONE, status, None), timeout=wait_s)
        except queue.Full:
            pass
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            self.say(f"trackers: still writing after {wait_s:.0f} s; the run ends without waiting for them "
                     f"(their files may miss the last records)")
        self.thread = None

    # the thread's side ---------------------------------------------------------------------
    def _report(self, name: str, e: BaseException) -> None:
        self.say(f"tracker {name}: {type(e).__name__}: {e}; the run goes on without it")

    def _open(self) -> None:
        for name in self.names:
            try:
                self.sinks[name] = self.kinds[name](self.root, self.exp, self.params)
            except ImportError:
                self.say(f"tracker {name}: the {PACKAGES.get(name, name)} package is not installed "
                         f"(pip install {PACKAGES.get(name, name)}); the run goes on without it")
            except Exception as e:  # noqa: BLE001
                self._report(name, e)

    def _call(self, name: str, method: str, *args) -> None:
        try:
            getattr(self.sinks[name], method)(*args)
        except Exception as e:  # noqa: BLE001 (reported once, then that tracker is dropped)
            self._report(name, e)
            del self.sinks[name]

    def _work(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # no folder, no tracker: said once; the loop still takes the records
            self._report(", ".join(self.names), e)
        else:
            self._open()
        while True:
            step, payload, t = self.q.get()
            if step is _DONE:
                for name in list(self.sinks):
                    self._call(name, "close", payload)
                return
            if payload:
                for name in list(self.sinks):
                    self._call(name, "log", step, payload, t)


def open_trackers(cfg, run_dir: Path, say: Callable[[str], None] = _say) -> Trackers:
    """The trackers cfg.proxy.trackers names, writing under <run_dir>/trackers/."""
    names = list(getattr(getattr(cfg, "proxy", None), "trackers", None) or [])
    params = flat_params(dataclasses.asdict(cfg)) if names and dataclasses.is_dataclass(cfg) else {}
    return Trackers(names, Path(run_dir) / "trackers", str(cfg.exp), params, say)
