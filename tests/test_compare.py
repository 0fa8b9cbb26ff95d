"""python -m andrea.pipeline.compare: one table of runs (pandas), an overlay plot, clear errors."""
import json

import pytest
import yaml

from andrea.pipeline import compare
def make_run(root, name, overrides, history, metrics=None):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"exp": name, "overrides": overrides,
                                                   "train": {"steps": 4, "eval_batches": 4}}))
    (d / f"{name}.loss.json").write_text(json.dumps({"format": "andrea-loss/1", "exp": name, "history": history}))
    if metrics is not None:
        (d / "eval").mkdir()
        (d / "eval" / "metrics.json").write_text(json.dumps(metrics))
    return d


def hist(losses, val, tps):
    h = [{"step": i + 1, "loss": l, "tokens_per_s": t, "wall_s": 2.0 * (i + 1)} for i, (l, t) in enumerate(zip(losses, tps))]
    h[-1]["val_loss"] = val
    return h


@pytest.fixture
def two_runs(tmp_path):
    a = make_run(tmp_path, "E", [], hist([3.0, 2.5, 2.0], 2.2, [100.0, 300.0, 200.0]),
                 metrics={"val_loss": 2.1, "val_batches": 5, "tasks": {"accuracy": 0.25}})
    b = make_run(tmp_path, "E+train.lr=1e-3", ["train.lr=1e-3"], hist([3.0, 2.0, 1.5, 1.2], 1.4, [50.0] * 4))
    return a, b


def test_table_of_runs(two_runs, tmp_path, capsys):
    a, b = two_runs
    df = compare.summary([compare.read_run(a), compare.read_run(b)])
    assert list(df.columns) == compare.COLUMNS
    first, second = df.iloc[0], df.iloc[1]
    # one column per kind of validation loss, each beside its batch count: the evaluated run first
    # (evaluation 2.1 over 5 batches; training's 2.2 over 4), the other has training's 1.4 only
    assert list(df["run"]) == ["E", "E+train.lr=1e-3"]
    first, second = df.iloc[1], df.iloc[0]
    assert first["overrides"] == "train.lr=1e-3" and pd_isna(first["val_loss"]) and pd_isna(first["val_batches"])
    assert (first["train_val_loss"], first["train_val_batches"]) == (1.4, 4)
    assert first["steps"] == 4 and first["wall_s"] == 8.0 and first["tokens_per_s"] == 50.0
    assert pd_isna(first["task_accuracy"])
    assert second["overrides"] == "(pinned)" and (second["val_loss"], second["val_batches"]) == (2.1, 5)
    assert (second["train_val_loss"], second["train_val_batches"]) == (2.2, 4)
    assert second["task_accuracy"] == 0.25 and second["tokens_per_s"] == 200.0  # the median
    plot, csv = tmp_path / "cmp.png", tmp_path / "cmp.csv"
    assert compare.main([str(a), str(b), "--plot", str(plot), "--csv", str(csv), "--log-scale"]) == 0
    out = capsys.readouterr().out
    assert "train.lr=1e-3" in out and "(pinned)" in out and "1.4000" in out and "0.250" in out
    assert plot.stat().st_size > 1000 and csv.read_text().splitlines()[0] == ",".join(compare.COLUMNS)


def pd_isna(x):
    import pandas as pd
    return pd.isna(x)


def test_bad_run_folder_is_named(tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    assert compare.main([str(tmp_path / "nothing"), "--plot", str(tmp_path / "p.png")]) == 2
    assert "no config.yaml" in capsys.readouterr().err and not (tmp_path / "p.png").exists()
    d = make_run(tmp_path, "X", [], hist([1.0], 1.0, [1.0]))
    (d / "X.loss.json").write_text("{not json")
    assert compare.main([str(d), "--plot", str(tmp_path / "p.png")]) == 2
    assert "X.loss.json" in capsys.readouterr().err


def test_atomic_savefig_keeps_the_old_plot_when_saving_fails(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from andrea.util.atomic import atomic_savefig
    fig = plt.figure()
    plt.plot([1, 2, 3])
    path = atomic_savefig(fig, tmp_path / "sub" / "loss.png")
    old = path.read_bytes()
    assert old.startswith(b"\x89PNG") and len(old) > 1000

    class Broken:  # writes half a file, then fails, as a full disk would
        def savefig(self, f, **kw):
            with open(f, "wb") as fh:
                fh.write(b"\x89PNG half")
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_savefig(Broken(), path)
    assert path.read_bytes() == old and sorted(p.name for p in path.parent.iterdir()) == ["loss.png"]
    plt.close(fig)
