"""andrea.pipeline.evaluate and scripts/archive.py: metrics, baselines, published comparison, manifest."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from andrea.pipeline import evaluate as ev
from andrea.data.shards import write_shard

REPO = Path(__file__).resolve().parent.parent


def test_val_windows_are_consecutive_and_shifted(tmp_path):
    write_shard(tmp_path / "val_000.bin", np.arange(100) % 50)
    batches = ev.val_windows(str(tmp_path / "val_*.bin"), B=2, T=8, n_batches=3)
    assert len(batches) == 3
    x, y = batches[1]
    assert x.shape == y.shape == (2, 8) and x.dtype == np.int32
    assert list(x[0]) == list(range(16, 24)) and list(y[0]) == list(range(17, 25))
    assert len(ev.val_windows(str(tmp_path / "val_*.bin"), B=2, T=8, n_batches=100)) == 6  # 12 windows fit
    with pytest.raises(ValueError, match="fewer than one batch"):
        ev.val_windows(str(tmp_path / "val_*.bin"), B=20, T=8, n_batches=1)
    with pytest.raises(FileNotFoundError, match="no shard matches"):
        ev.val_windows(str(tmp_path / "none_*.bin"), B=2, T=8, n_batches=1)


def test_history_accepts_proxy_file_or_list():
    recs = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0, "val_loss": 2.5}]
    assert ev.history_of({"format": "andrea-loss/1", "history": recs}) == recs == ev.history_of(recs)
    assert ev.curves(recs) == {"train": [(1, 3.0), (2, 2.0)], "val": [(2, 2.5)]}
    with pytest.raises(ValueError, match="history"):
        ev.history_of({"steps": []})


@pytest.mark.parametrize("mine,verdict", [(1.70, "PASS"), (1.749, "PASS"), (1.6501, "PASS"), (1.751, "FAIL"), (1.60, "FAIL")])
def test_compare_with_published(mine, verdict):
    c = ev.compare({"val_loss": mine}, {"val_loss": 1.70}, 0.05, Path("p.json"))
    assert c["verdict"] == verdict and c["diff"] == pytest.approx(mine - 1.70)


def test_compare_rejects_bad_published():
    with pytest.raises(ValueError, match="val_loss"):
        ev.compare({"val_loss": 1.0}, {"loss": 1.0}, 0.05, Path("docs/published/x.json"))


def test_training_summary_leaves_out_start_up():
    hist = [{"step": s, "loss": 1.0, "tokens_per_s": 10.0 if s <= 2 else 100.0 + s % 3, "wall_s": 0.5 * s}
            for s in range(1, 21)] + [{"step": 20, "val_loss": 1.0}]
    t = ev.training_summary(hist, {"plan_bytes": 12345})
    assert t == {"tokens_per_s": 101.0, "train_wall_s": 10.0, "plan_bytes": 12345}
    assert ev.training_summary([], None) == {"tokens_per_s": None, "train_wall_s": None, "plan_bytes": None}


def test_same_losses_counts_bit_identical_steps():
    pub = {"history": [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}, {"step": 3, "loss": 2.0},
                       {"step": 3, "val_loss": 2.1}]}
    mine = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}, {"step": 3, "loss": 2.0}]
    assert ev.same_losses(mine, pub) == {"steps": 3, "identical": 3, "first_difference": None}
    mine[1]["loss"] = float(np.nextafter(2.25, 3.0))  # one ulp is a difference
    assert ev.same_losses(mine, pub) == {"steps": 3, "identical": 2, "first_difference": 2}
    c = ev.compare({"val_loss": 2.1}, {**pub, "val_loss": 2.1, "tokens_per_s": 5.0}, 0.05, Path("p.json"), mine)
    assert c["losses"]["identical"] == 2 and c["training"]["tokens_per_s"] == 5.0


def test_publish_freezes_metrics_and_history(tmp_path):
    from andrea.pipeline import publish
    res = tmp_path / "results" / "X"
    (res / "eval").mkdir(parents=True)
    (res / "trained").mkdir()
    m = {"exp": "X", "val_loss": 1.5, "perplexity": 4.48, "bits_per_byte": 0.5, "step": 30, "config_hash": "ab",
         "overrides": ["backend=cuda"], "tasks": {"accuracy": 0.25},
         "training": {"tokens_per_s": 1e6, "train_wall_s": 12.0, "plan_bytes": 99}}
    (res / "eval" / "metrics.json").write_text(json.dumps(m))
    with pytest.raises(FileNotFoundError, match="X.loss.json"):
        publish.publish(res, tmp_path / "p.json", "gpu", "abc")
    (res / "trained" / "X.loss.json").write_text(json.dumps({"history": [{"step": 30, "loss": 1.25, "lr": 0.1}]}))
    out = publish.publish(res, tmp_path / "p.json", "gpu", "abc")
    p = json.loads(out.read_text())
    assert (p["val_loss"], p["task_accuracy"], p["commit"], p["plan_bytes"]) == (1.5, 0.25, "abc", 99)
    assert p["history"] == [{"step": 30, "loss": 1.25}]
    m["overrides"].append("train.steps=3")  # not the pinned config: refused, naming the override
    (res / "eval" / "metrics.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="train.steps=3"):
        publish.publish(res, tmp_path / "p.json", "gpu", "abc")
    assert publish.main([str(res), "--machine", "gpu", "--out", str(tmp_path / "q.json")]) == 2


def sh(*args, cwd=REPO, env=None):
    r = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env=env or dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 20-step ANDREA-tiny run on real synthetic data, archived: the chain without Snakemake."""
    t = tmp_path_factory.mktemp("run")
    d, s = t / "data" / "synthetic", REPO / "scripts"
    (t / "stage.yaml").write_text("data:\n  source: synthetic\n  n_synthetic: 600\n  seed: 1\n"
                                  "  max_conversations: 0\n  val_fraction: 0.2\n")
    sh(s / "pull-hermes3.py", "--config", t / "stage.yaml", "--out", d / "raw.parquet", "--report", d / "pull.json")
    sh(s / "prep-megachat.py", "--config", t / "stage.yaml", "--inputs", d / "raw.parquet", "--train",
       d / "megachat" / "train.parquet", "--val", d / "megachat" / "val.parquet", "--report", d / "prep.json")
    sh(s / "train-tokenizer.py", "--train", d / "megachat" / "train.parquet", "--vocab-size", 512,
       "--out", d / "tok512" / "tokenizer.json")
    sh(s / "tokenize-shards.py", "--tokenizer", d / "tok512" / "tokenizer.json", "--train",
       d / "megachat" / "train.parquet", "--val", d / "megachat" / "val.parquet", "--out-dir", d / "tok512",
       "--manifest", d / "tok512" / "shards.json")
    sh("-m", "andrea.train", "experiment=ANDREA-tiny", f"data.dir={t / 'data'}", f"results_dir={t / 'results'}",
       "train.steps=20", "train.eval_every=10", "train.ckpt_every=10", "eval.n_tasks=12", "eval.batches=2",
       "exp=ANDREA-tiny")
    run = t / "results" / "ANDREA-tiny"
    sh(s / "archive.py", "--config", run / "config.yaml", "--checkpoints", run / "checkpoints",
       "--loss", run / "ANDREA-tiny.loss.json", "--out", run / "archive" / "final")
    return t, run, d


def test_archive_manifest(trained):
    _, run, _ = trained
    final = run / "archive" / "final"
    man = json.loads((final / "manifest.json").read_text())
    names = {f["file"] for f in man["files"]}
    assert names == {"step_00000020.bin", "step_00000020.json", "config.yaml", "tokenizer.json",
                     "ANDREA-tiny.loss.json"}
    assert (final / "tokenizer.json").read_bytes() == (trained[2] / "tok512" / "tokenizer.json").read_bytes()
    import hashlib
    for f in man["files"]:
        assert hashlib.sha256((final / f["file"]).read_bytes()).hexdigest() == f["sha256"]
    env = man["environment"]
    assert env["python"] == ".".join(map(str, sys.version_info[:3])) and env["numpy"] == np.__version__
    assert {"cupy", "cuda_runtime", "cuda_driver", "gpu"} <= set(env)


def test_archive_refuses_unfinished_run(trained, tmp_path):
    _, run, _ = trained
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "archive.py"), "--config", str(run / "config.yaml"),
                        "--checkpoints", str(run / "checkpoints"), "--out", str(tmp_path / "a")],
                       capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       timeout=60)
    assert r.returncode == 0  # step 20 == train.steps: finished
    cfg = (run / "config.yaml").read_text().replace("steps: 20", "steps: 40")
    (tmp_path / "c.yaml").write_text(cfg)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "archive.py"), "--config", str(tmp_path / "c.yaml"),
                        "--checkpoints", str(run / "checkpoints"), "--out", str(tmp_path / "b")],
                       capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       timeout=60)
    assert r.returncode != 0 and "train.steps=40" in r.stderr and not (tmp_path / "b").exists()


def test_evaluate_writes_report_and_metrics(trained, tmp_path):
    t, run, d = trained
    pub = tmp_path / "published.json"
    out = tmp_path / "out"
    sh("-m", "andrea.pipeline.evaluate", "--config", run / "config.yaml", "--checkpoint-dir", run / "archive" / "final",
       "--loss", run / "ANDREA-tiny.loss.json", "--val-conversations", d / "megachat" / "val.parquet",
       "--train-conversations", d / "megachat" / "train.parquet", "--out-dir", out, "--write-published", pub,
       "--machine", "test")
    m = json.loads((out / "eval" / "metrics.json").read_text())
    assert m["step"] == 20 and m["val_batches"] == 2
    from andrea.data.tokenizer import load_tokenizer
    real = load_tokenizer(d / "tok512" / "tokenizer.json").vocab_size
    assert m["tokenizer_vocab"] == min(real, 512) and m["uniform_loss"] == pytest.approx(math.log(min(real, 512)))
    assert m["perplexity"] == pytest.approx(math.exp(m["val_loss"]))
    assert 0 < m["bits_per_byte"] < m["val_loss"] / math.log(2)  # more than one byte per token
    tasks = m["tasks"]
    assert tasks["n"] == 12 and 0 <= tasks["accuracy"] <= 1 and 0 < tasks["chance"] < 1
    rows = json.loads((out / "eval" / "synthetic.json").read_text())
    assert len(rows) == 12 and all(r["reference_matches"] for r in rows)
    assert len(m["samples"]) == 4 and (out / "eval" / "loss.png").stat().st_size > 1000
    # this run has overrides (train.steps=20, ...): listed, and never judged against the published run
    assert "train.steps=20" in m["overrides"]
    sh("-m", "andrea.pipeline.evaluate", "--config", run / "config.yaml", "--checkpoint-dir", run / "archive" / "final",
       "--loss", run / "ANDREA-tiny.loss.json", "--val-conversations", d / "megachat" / "val.parquet",
       "--out-dir", out, "--published", pub, "--log-scale")
    m1, report = json.loads((out / "eval" / "metrics.json").read_text()), (out / "report.md").read_text()
    assert "published" not in m1 and "train.steps=20" in m1["not_compared"]
    assert "Not compared: overrides" in report and "`train.steps=20`" in report and "PASS" not in report
    # the same run, as if of the pinned config, against itself as the published reference: PASS, difference 0
    pinned = yaml.safe_load((run / "config.yaml").read_text())
    pinned["overrides"] = ["backend=numpy", "eval.batches=2"]  # where it runs does not count; eval does
    (tmp_path / "pinned.yaml").write_text(yaml.safe_dump(pinned))
    sh("-m", "andrea.pipeline.evaluate", "--config", tmp_path / "pinned.yaml", "--checkpoint-dir", run / "archive" / "final",
       "--loss", run / "ANDREA-tiny.loss.json", "--val-conversations", d / "megachat" / "val.parquet",
       "--out-dir", out, "--published", pub)
    assert "eval.batches=2" in json.loads((out / "eval" / "metrics.json").read_text())["not_compared"]
    pinned["overrides"] = ["backend=numpy", f"data.dir={t / 'data'}"]
    (tmp_path / "pinned.yaml").write_text(yaml.safe_dump(pinned))
    sh("-m", "andrea.pipeline.evaluate", "--config", tmp_path / "pinned.yaml", "--checkpoint-dir", run / "archive" / "final",
       "--loss", run / "ANDREA-tiny.loss.json", "--val-conversations", d / "megachat" / "val.parquet",
       "--out-dir", out, "--published", pub)
    m2 = json.loads((out / "eval" / "metrics.json").read_text())
    assert m2["val_loss"] == m["val_loss"] and m2["published"]["verdict"] == "PASS"
    assert m2["tasks"]["majority_baseline"] is None and m2["tasks"]["accuracy"] == tasks["accuracy"]
    report = (out / "report.md").read_text()
    assert "**PASS**: validation loss" in report and "Bit for bit: **reproduced**, all " in report
    assert m2["provenance"]["kernels"] == ev.kernel_fingerprint() and m2["provenance"]["numpy"] == np.__version__
    assert "training's validation loss at step 20 (4 batches, train.eval_batches)" in report
    assert m2["published"]["losses"]["identical"] == m2["published"]["losses"]["steps"] > 0
    published = json.loads(pub.read_text())
    assert published["machine"] == "test" and published["tokens_per_s"] > 0 and published["train_wall_s"] > 0
    assert published["plan_bytes"] == json.loads((run / "ANDREA-tiny.state.json").read_text())["plan_bytes"] > 0


def test_task_accuracy_per_kind_against_hand_counts(tmp_path, monkeypatch):
    """The per-kind table from a decoder that answers right exactly on every third question."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from types import SimpleNamespace

    from andrea.data import synthetic
    val, train = synthetic.generate(13, seed=5), synthetic.generate(40, seed=6)
    for path, rows in ((tmp_path / "val.parquet", val), (tmp_path / "train.parquet", train)):
        pq.write_table(pa.table({"conversations": [r["conversations"] for r in rows]}), path)
    qs = [ev.read_exchanges(tmp_path / "val.parquet")[i][0] for i in range(13)]
    monkeypatch.setattr(ev, "complete", lambda dec, tok, q, *a: synthetic.answer(q) if qs.index(q) % 3 == 0 else "?")
    cfg = SimpleNamespace(eval=SimpleNamespace(n_tasks=0, max_new_tokens=32, seed=0))
    t = ev.task_accuracy(None, None, cfg, tmp_path / "val.parquet", tmp_path / "train.parquet")["summary"]
    kinds = [synthetic.kind_of(q) for q in qs]
    assert t["n"] == 13 and t["accuracy"] == 5 / 13  # questions 0, 3, 6, 9, 12
    for k in set(kinds):
        idx = [i for i, kk in enumerate(kinds) if kk == k]
        p = t["per_kind"][k]
        assert p["n"] == len(idx) and p["accuracy"] == sum(i % 3 == 0 for i in idx) / len(idx)
        assert p["chance"] == pytest.approx(sum(synthetic.chance(qs[i]) for i in idx) / len(idx))
        assert 0.0 <= p["majority_baseline"] <= 1.0
    assert t["chance"] == pytest.approx(sum(synthetic.chance(q) for q in qs) / 13)


# ---------------------------------------------------------------- what the report says (issue 38)
def report_metrics(**extra):
    """The metrics of a report of ANDREA-tiny's shape, as evaluate() writes them."""
    m = {"exp": "ANDREA-tiny", "checkpoint": "step_00001500.bin", "step": 1500, "config_hash": "ab" * 32,
         "overrides": [], "val_loss": 1.6198, "uniform_loss": 6.2, "tokenizer_vocab": 512, "model_vocab": 512,
         "perplexity": 5.05, "bits_per_byte": 0.47, "val_tokens": 2560, "val_batches": 5, "batch_size": 8,
         "seq_len": 64, "samples": [], "wall_s": 1.0, "backend": "numpy",
         "tasks": {"n": 185, "accuracy": 0.178, "chance": 0.2, "majority_baseline": 0.25, "per_kind": {
             "count": {"n": 44, "accuracy": 0.386, "chance": 0.2, "majority_baseline": 0.432},
             "reverse": {"n": 46, "accuracy": 0.0, "chance": 0.091, "majority_baseline": 0.0},
             "add": {"n": 47, "accuracy": 0.3, "chance": 0.01, "majority_baseline": 0.02}}}}
    m.update(extra)
    return m


def test_verdict_says_what_it_compared():
    m = report_metrics()
    m["published"] = ev.compare(m, {"val_loss": 1.6035, "machine": "a CPU"}, 0.05, Path("docs/published/x.json"))
    report = ev.report_md(m)
    assert ("**PASS**: validation loss 1.6198 (5 batches of 8 x 64 tokens) within 0.05 of the published 1.6035 "
            "(difference +0.0163)") in report
    assert "The verdict compares this one figure: not the task accuracy, the samples or the bits." in report
    m["published"] = ev.compare({**m, "val_loss": 1.7}, {"val_loss": 1.6035}, 0.05, Path("x.json"))
    assert "**FAIL**: validation loss 1.6198 (5 batches of 8 x 64 tokens) not within 0.05" in ev.report_md(m)


def test_tasks_under_their_baselines_are_marked():
    report = ev.report_md(report_metrics())
    rows = {line.split(" | ")[0].strip("| "): line for line in report.splitlines() if line.startswith("| ")}
    assert rows["count"].endswith("| **not above the constant answer (0.432)** |")
    assert rows["reverse"].endswith("| **not above chance (0.091); not above the constant answer (0.000)** |")
    assert rows["add"].endswith("| above both |")
    assert "| task exact match | 0.178 of 185 (**not above chance (0.200); not above the constant answer (0.250)**) |" \
        in report


def test_bitwise_line_says_whether_and_why_not():
    ls = {"steps": 1500, "identical": 1, "first_difference": 2}
    here = {"commit": "abc", "numpy": "2.2.6", "python": "3.11.2", "gpu": None, "backend": "numpy", "kernels": "k1"}
    line = ev.bitwise_line(ls, here, ev.published_provenance({"commit": "abc", "machine": "x"}))
    assert line.startswith("Bit for bit: **not reproduced**, 1 of 1500 logged training losses equal the published "
                           "run's (first difference at step 2).")
    assert "does not record its numpy, python, gpu, backend, kernels, so the cause cannot be named" in line
    there = {**here, "numpy": "1.26.4", "kernels": "k0"}
    line = ev.bitwise_line(ls, here, ev.published_provenance({"provenance": there}))
    assert "What differs: numpy `2.2.6` here, `1.26.4` there; kernels `k1` here, `k0` there." in line
    assert "does not record its gpu" in line  # a CPU run records no GPU
    assert ev.bitwise_line({"steps": 9, "identical": 9, "first_difference": None}, here, here) == \
        "Bit for bit: **reproduced**, all 9 logged training losses equal the published run's."
    old = ev.published_provenance({"commit": "0123456789abcdef", "environment": {"numpy": "1.26.4"}})
    assert old["commit"] == "0123456789ab" and old["numpy"] == "1.26.4" and old["kernels"] is None


def test_both_validation_figures_carry_their_batch_counts():
    """The report's validation loss (eval.batches) and training's at the same checkpoint
    (train.eval_batches) each name their batches."""
    hist = [{"step": 1500, "loss": 1.6}, {"step": 1500, "val_loss": 1.6550}]
    tv = ev.training_val(hist, 1500)
    assert tv == 1.6550 and ev.training_val(hist, 1000) is None
    report = ev.report_md(report_metrics(training_val={"val_loss": tv, "batches": 4}))
    assert "| validation loss (nats; 5 batches of 8 x 64 tokens, eval.batches) | 1.6198 |" in report
    assert "| training's validation loss at step 1500 (4 batches, train.eval_batches) | 1.6550 |" in report


def test_kernel_fingerprint_follows_the_sources(tmp_path, monkeypatch):
    import andrea.paths
    a = ev.kernel_fingerprint()
    assert a == ev.kernel_fingerprint() and len(a) == 16
    k = tmp_path / "kernels"
    k.mkdir()
    (k / "loss.cu").write_text("// one kernel")
    monkeypatch.setattr(andrea.paths, "KERNEL_DIR", k)
    b = ev.kernel_fingerprint()
    (k / "loss.cu").write_text("// another kernel")
    assert len({a, b, ev.kernel_fingerprint()}) == 3
