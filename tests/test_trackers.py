"""Experiment trackers (proxy.trackers): what the proxy fed them, read back with their own readers
(tensorboard's EventAccumulator, MLflow's client); a missing package, a failing tracker and a slow
one never stop or hold up the run."""
import json
import sys
import threading
import types

import pytest
from omegaconf import OmegaConf

from andrea.config import load_run_config
from andrea.run.proxy import supervise, trackers
from conftest import small_config


def history(run):
    return json.loads((run / f"{run.name}.loss.json").read_text())["history"]


def test_tensorboard_and_mlflow_hold_the_history_and_a_missing_wandb_is_one_line(tiny_run, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it fails
    cfg, tmp = tiny_run
    cfg["train"].update(steps=8, eval_every=4, eval_batches=1)
    cfg["proxy"] = {"trackers": ["tensorboard", "mlflow", "wandb"]}
    run = tmp / "t"
    run.mkdir()
    OmegaConf.save(OmegaConf.create(cfg), run / "config.yaml")
    assert supervise(load_run_config(run / "config.yaml"), run, progress=False) == 0
    hist = history(run)
    losses = {r["step"]: r["loss"] for r in hist if r.get("loss") is not None}
    vals = {r["step"]: r["val_loss"] for r in hist if r.get("val_loss") is not None}
    assert sorted(losses) == list(range(1, 9)) and sorted(vals) == [4, 8]

    ea = EventAccumulator(str(run / "trackers" / "tensorboard"))
    ea.Reload()
    tb = {e.step: e.value for e in ea.Scalars("loss")}
    assert tb.keys() == losses.keys() and all(tb[s] == pytest.approx(losses[s], rel=1e-6) for s in tb)
    assert {e.step: e.value for e in ea.Scalars("val_loss")} == pytest.approx(vals, rel=1e-6)
    assert "lr" in ea.Tags()["scalars"]

    client = MlflowClient(tracking_uri=(run / "trackers" / "mlruns").resolve().as_uri())
    (mrun,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert {m.step: m.value for m in client.get_metric_history(mrun.info.run_id, "loss")} == losses
    assert {m.step: m.value for m in client.get_metric_history(mrun.info.run_id, "val_loss")} == vals
    assert mrun.info.status == "FINISHED" and mrun.data.params["train.steps"] == "8"

    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "wandb" in line]
    assert len(said) == 1 and "not installed" in said[0] and "goes on" in said[0], err


class Fake:
    """A tracker kind that records its calls; `gate` holds its start until set."""

    calls: list = []
    gate = None
    fail_on_log = False

    def __init__(self, root, exp, params):
        if Fake.gate is not None:
            Fake.gate.wait()
        Fake.calls.append(("open", exp))

    def log(self, step, metrics, t):
        if Fake.fail_on_log:
            raise OSError("disk full")
        Fake.calls.append(("log", step, metrics))

    def close(self, status):
        Fake.calls.append(("close", status))


@pytest.fixture
def fake(monkeypatch):
    Fake.calls, Fake.gate, Fake.fail_on_log = [], None, False
    return Fake


def step(n, loss=1.0):
    return {"event": "step", "step": n, "loss": loss, "lr": 0.1, "grad_norm": float("nan")}


def test_a_failing_tracker_is_reported_once_and_dropped(tmp_path, fake):
    said = []
    fake.fail_on_log = True
    tr = trackers.Trackers(["tensorboard"], tmp_path, "E", say=said.append, kinds={"tensorboard": fake})
    for n in range(1, 6):
        tr.feed(step(n))
    tr.close("finished")
    assert len(said) == 1 and "disk full" in said[0] and "goes on" in said[0]
    assert fake.calls == [("open", "E")]  # dropped after its first failure: not closed, not logged to again


def test_a_slow_tracker_never_holds_up_the_proxy(tmp_path, fake, monkeypatch):
    """The tracker's thread is held before it takes anything: feed() still returns at once for
    every record, keeps MAX_PENDING of them and says once that it dropped the rest."""
    monkeypatch.setattr(trackers, "MAX_PENDING", 3)
    said = []
    fake.gate = threading.Event()
    tr = trackers.Trackers(["mlflow"], tmp_path, "E", say=said.append, kinds={"mlflow": fake})
    for n in range(1, 11):
        tr.feed(step(n))
    tr.feed(step(4))  # a replay after a restart: not fed twice
    assert len(said) == 1 and "more than 3 records" in said[0]
    fake.gate.set()
    tr.close("stopped")
    assert fake.calls == [("open", "E"), *[("log", n, {"loss": 1.0, "lr": 0.1}) for n in (1, 2, 3)], ("close", "stopped")]


def test_a_trackers_folder_that_cannot_be_made_is_one_line(tmp_path, fake):
    (tmp_path / "run").write_text("a file where the run folder should be")
    said = []
    tr = trackers.Trackers(["tensorboard"], tmp_path / "run" / "trackers", "E", say=said.append,
                           kinds={"tensorboard": fake})
    tr.feed(step(1))
    tr.close("finished")
    assert tr.thread is None and fake.calls == []
    assert len(said) == 1 and said[0].startswith("tracker tensorboard: ") and "goes on" in said[0], said


def test_close_gives_up_on_a_tracker_that_hangs(tmp_path, fake):
    said = []
    fake.gate = threading.Event()
    tr = trackers.Trackers(["wandb"], tmp_path, "E", say=said.append, kinds={"wandb": fake})
    tr.close("finished", wait_s=0.2)  # the tracker never starts: the run ends anyway, and says so
    assert len(said) == 1 and "still writing" in said[0]
    fake.gate.set()


def test_wandb_runs_offline_in_the_run_folder(tmp_path, monkeypatch):
    seen = {}

    class Run:
        def log(self, metrics, step):
            seen.setdefault("log", []).append((step, metrics))

        def finish(self, exit_code):
            seen["exit_code"] = exit_code

    fake_wandb = types.ModuleType("wandb")
    fake_wandb.init = lambda **kw: seen.update(init=kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    tr = trackers.Trackers(["wandb"], tmp_path / "trackers", "E+train.lr=0.1", params={"train.lr": "0.1"})
    tr.feed(step(1, 2.5))
    tr.feed({"event": "val", "step": 1, "val_loss": 2.75})
    tr.close("failed")
    kw = seen["init"]
    assert kw["mode"] == "offline" and kw["dir"] == str(tmp_path / "trackers") and kw["project"] == "E"
    assert kw["name"] == "E+train.lr=0.1" and kw["config"] == {"train.lr": "0.1"}
    assert seen["log"] == [(1, {"loss": 2.5, "lr": 0.1}), (1, {"val_loss": 2.75})] and seen["exit_code"] == 1


def test_unknown_tracker_is_refused_with_its_name(tmp_path):
    cfg = small_config(tmp_path)
    cfg["proxy"] = {"trackers": ["tensorboard", "neptune"]}
    with pytest.raises(ValueError, match="'neptune' is no tracker; expected any of tensorboard, mlflow, wandb"):
        load_run_config(cfg)


def test_no_trackers_no_thread(tmp_path):
    tr = trackers.open_trackers(load_run_config(small_config(tmp_path)), tmp_path)
    tr.feed(step(1))
    tr.close()
    assert tr.thread is None and not (tmp_path / "trackers").exists()
