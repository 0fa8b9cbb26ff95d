"""Data groups and the mixer in the run: config, loader, tokenize per group, records, resume."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from andrea.core import checkpoint as ck
from andrea.config import config_hash, load_run_config
from andrea.data.loader import MixedLoader, ShardLoader, train_loader
from andrea.data.mixer import make_mixer
from andrea.data.shards import read_shard, write_shard
from andrea.run.proxy.records import RunRecords
from andrea.train import ConfigError, compose_config
from conftest import load_script, make_shards, small_config

REPO = Path(__file__).resolve().parent.parent
V = 61


def make_groups(tmp_path, n=6000):
    """Three groups: two repeating patterns (learnable) and one of random tokens."""
    rng = np.random.default_rng(1)
    d = tmp_path / "groups"
    write_shard(d / "count" / "train_000.bin", np.arange(n) % 20)
    write_shard(d / "pairs" / "train_000.bin", np.repeat(np.arange(n // 2) % 30 + 20, 2))
    write_shard(d / "noise" / "train_000.bin", rng.integers(0, V, n))
    for g in ("count", "pairs", "noise"):
        write_shard(d / g / "val_000.bin", rng.integers(0, V, 400))
    return [{"name": g, "train_shards": str(d / g / "train_*.bin"), "val_shards": str(d / g / "val_*.bin")}
            for g in ("count", "pairs", "noise")]


def mix_config(tmp_path, kind="bandit", reward="progress", **train):
    make_shards(tmp_path)
    c = small_config(tmp_path, **train)
    c["data"]["groups"] = make_groups(tmp_path)
    c["data"]["mixer"] = {"kind": kind, "reward": reward, "reward_scale": 10.0}
    return c


# ---------------------------------------------------------------- config
def test_mixer_group_composes_and_sweeps_by_name():
    assert compose_config("ANDREA-tiny").data.mixer.kind == "uniform"
    cfg = compose_config("ANDREA-tiny", ["mixer=bandit", "data.mixer.reward=progress",
                                         "data.groups=[{name: a, train_shards: x}]"])
    assert (cfg.data.mixer.kind, cfg.data.mixer.reward, cfg.data.groups[0].name) == ("bandit", "progress", "a")
    cfg = compose_config("ANDREA-firehose", ["mixer=fixed", "data.mixer.weights=[1,1,1,1,0]"])
    assert cfg.data.mixer.weights == [1, 1, 1, 1, 0] and len(cfg.data.groups) == 5


@pytest.mark.parametrize("overrides, message", [
    (["mixer=bandit"], "data.mixer.kind=bandit needs data.groups"),
    (["data.mixer.kind=greedy"], "data.mixer.kind='greedy'"),
    (["data.mixer.reward=gain"], "data.mixer.reward='gain'"),
    (["mixer=fixed", "data.groups=[{name: a, train_shards: x}]"], "data.mixer.weights=[]"),
    (["data.groups=[{name: a, train_shards: x},{name: a, train_shards: y}]"], "repeat"),
    (["data.groups=[{name: a}]"], "data.groups[0]"),
    (["data.mixer.alpha=0"], "data.mixer.alpha=0"),
])
def test_bad_mix_settings_are_named(overrides, message):
    with pytest.raises(ConfigError) as e:
        compose_config("ANDREA-tiny", overrides)
    assert message in str(e.value)


def test_config_hash_covers_the_mix_only_when_there_are_groups(tmp_path):
    plain = load_run_config(small_config(tmp_path))
    uniform = load_run_config({**small_config(tmp_path), "data": {**small_config(tmp_path)["data"],
                                                                   "mixer": {"beta": 0.5}}})
    assert config_hash(plain) == config_hash(uniform)  # no groups: the mixer is not used
    a = load_run_config(mix_config(tmp_path, reward="loss"))
    b = load_run_config(mix_config(tmp_path, reward="progress"))
    assert config_hash(a) != config_hash(b) != config_hash(plain)


# ---------------------------------------------------------------- loader
def test_one_group_gives_exactly_the_ungrouped_batches(tmp_path):
    make_shards(tmp_path)
    pattern = str(tmp_path / "shards" / "train_*.bin")
    plain = ShardLoader(pattern, 3, 16, seed=7, vocab_size=V)
    mixed = MixedLoader([("all", pattern)], 3, 16, 7, V, make_mixer("uniform", 1, 7))
    for _ in range(120):  # past an epoch (5000 tokens / 17 = 294 windows / 3 per batch)
        a = plain.next_step(2)
        b = mixed.next_step(2)
        for (xa, ya), (xb, yb) in zip(a, b):
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
        mixed.feedback({"loss": 1.0, "skipped": False})


def test_each_group_keeps_its_own_position(tmp_path):
    c = mix_config(tmp_path)
    c["data"]["mixer"] = {"kind": "fixed", "weights": [1, 1, 1]}
    cfg = load_run_config(c)
    ld = train_loader(cfg)
    seen = {n: [] for n in ld.names}
    for _ in range(60):
        (x, _), = ld.next_step(1)
        name = ld.names[ld.group]
        seen[name].append(x.copy())
        ld.feedback({"loss": 2.0, "skipped": False})
    for i, name in enumerate(ld.names):
        # group i's batches, in the order it was drawn, are its own loader's batches read alone
        alone = ShardLoader(cfg.data.groups[i].train_shards, 2, 16, 3, V, stream=i)
        for x in seen[name]:
            assert np.array_equal(x, alone.next_batch()[0])
    assert all(len(v) > 5 for v in seen.values())
    st = json.loads(json.dumps(ld.state()))
    other = train_loader(cfg)
    other.load_state(st)
    for _ in range(30):
        a, b = ld.next_step(2), other.next_step(2)
        assert ld.group == other.group and all(np.array_equal(p[0], q[0]) for p, q in zip(a, b))
        ld.feedback({"loss": 1.5, "skipped": False}); other.feedback({"loss": 1.5, "skipped": False})
    st["groups"] = st["groups"][:1]
    with pytest.raises(ValueError, match="side.json: data.groups is"):
        train_loader(cfg).load_state(st, "side.json")


def test_skipped_step_teaches_the_mixer_nothing(tmp_path):
    ld = train_loader(load_run_config(mix_config(tmp_path, reward="loss")))
    ld.next_step(1)
    fields = ld.feedback({"loss": float("nan"), "skipped": True})
    assert ld.mixer.n.sum() == 0 and not ld.mixer.w.any()
    assert set(fields) == {"group", "mix", "group_loss"} and sum(fields["mix"].values()) == pytest.approx(1)


# ---------------------------------------------------------------- tokenize per group
def test_tokenize_writes_shards_per_group_and_a_noise_group(tmp_path):
    from andrea.data.chat import normalize, render_conversation
    from andrea.data.synthetic import generate

    rows = generate(200, seed=3)
    texts = [render_conversation(normalize(r["conversations"])) for r in rows]
    tasks = [r["task"] for r in rows]
    for split in ("train", "val"):
        pq.write_table(pa.table({"text": texts, "task": tasks}), tmp_path / f"{split}.parquet")
    tok = tmp_path / "tok" / "tokenizer.json"

    def script(name, *args):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / name), *map(str, args)],
                           capture_output=True, text=True, timeout=300,
                           env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr
    script("train-tokenizer.py", "--train", tmp_path / "train.parquet", "--vocab-size", 300, "--out", tok)
    common = ["--tokenizer", tok, "--train", tmp_path / "train.parquet", "--val", tmp_path / "val.parquet",
              "--shard-tokens", 700]
    script("tokenize-shards.py", *common, "--out-dir", tmp_path / "plain", "--manifest", tmp_path / "plain.json")
    script("tokenize-shards.py", *common, "--out-dir", tmp_path / "tok", "--manifest", tmp_path / "m.json",
           "--group-by", "field:task", "--noise-group", "noise", "--noise-tokens", 999)
    # the ungrouped shards are the same bytes with or without groups
    plain = sorted(p.name for p in (tmp_path / "plain").glob("*_*.bin"))
    assert plain == sorted(p.name for p in (tmp_path / "tok").glob("*_*.bin"))
    for name in plain:
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "tok" / name).read_bytes()
    man = json.loads((tmp_path / "m.json").read_text())
    assert sorted(man["groups"]) == ["add", "count", "noise", "reverse", "sort"]
    from andrea.data.tokenizer import load_tokenizer
    t = load_tokenizer(tok)
    for kind in ("add", "sort"):
        files = sorted((tmp_path / "tok" / "groups" / kind).glob("train_*.bin"))
        got = np.concatenate([read_shard(f) for f in files])
        want = np.concatenate([t.encode(x) for x, k in zip(texts, tasks) if k == kind])
        assert np.array_equal(got, want)
        assert all(len(read_shard(f)) == 700 for f in files[:-1])
        assert man["groups"][kind]["train"]["tokens"] == len(want)
    noise = read_shard(tmp_path / "tok" / "groups" / "noise" / "train_000000.bin")
    assert len(noise) == 999 and noise.max() < t.vocab_size and len(np.unique(noise)) > 250


# ---------------------------------------------------------------- records
def test_records_keep_the_mix_per_step(tmp_path):
    rec = RunRecords("t", tmp_path, 10)
    rec.add_step({"step": 1, "loss": 3.1, "group": "a", "mix": {"a": 0.5, "b": 0.5},
                  "group_loss": {"a": 3.1, "b": None}})
    rec.add_val({"step": 2, "val_loss": 3.0, "group_val_loss": {"a": 2.0, "b": float("inf")}})
    rec.add_step({"step": 2, "loss": 3.0, "group": "b", "mix": {"a": 0.4, "b": 0.6},
                  "group_loss": {"a": 3.1, "b": 3.0}})
    rec.flush(force=True)
    h = json.loads((tmp_path / "t.loss.json").read_text())["history"]
    assert h[0]["group"] == "a" and h[0]["group_loss"] == {"a": 3.1, "b": None}
    assert h[1]["mix"] == {"a": 0.4, "b": 0.6} and h[1]["group_val_loss"] == {"a": 2.0, "b": None}
    assert h[1]["val_loss"] == 3.0
    rec.add_step({"step": 3, "loss": 2.0})
    assert "mix" not in rec.history[-1] and "group" not in rec.history[-1]


# ---------------------------------------------------------------- resume
def start(run, resume=False):
    cmd = [sys.executable, "-m", "andrea.cli", "engine", "--config", str(run / "config.yaml"),
           "--run-dir", str(run)] + (["--resume"] if resume else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def finish(proc):
    rest = [json.loads(line) for line in proc.stdout]
    return proc.wait(timeout=120), rest


def test_bandit_run_resumes_bit_exactly_after_sigterm_at_a_random_step(tmp_path):
    steps = 90
    stop_at = int(np.random.default_rng().integers(10, 70))
    cfg = mix_config(tmp_path, steps=steps, ckpt_every=25, eval_every=30, grad_accum=2)
    runs = {}
    for name in ("straight", "interrupted"):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        OmegaConf.save(OmegaConf.create(cfg), runs[name] / "config.yaml")
    rc, straight = finish(start(runs["straight"]))
    assert rc == 0 and straight[-1]["status"] == "finished"

    p = start(runs["interrupted"])
    for line in p.stdout:
        ev = json.loads(line)
        if ev["event"] == "step" and ev["step"] >= stop_at:
            break
    p.send_signal(signal.SIGTERM)
    rc, rest = finish(p)
    stopped = rest[-1]
    assert rc == 0 and stopped["status"] == "stopped" and stop_at <= stopped["step"] < steps, stop_at
    rc, resumed = finish(start(runs["interrupted"], resume=True))
    assert rc == 0 and resumed[1]["event"] == "resume"

    def steps_of(evs):
        return {e["step"]: e for e in evs if e["event"] == "step"}
    a, b = steps_of(straight), steps_of(resumed)
    assert min(b) == stopped["step"] + 1, stop_at
    for s in b:  # the same group, probabilities and losses at every replayed step
        assert {k: a[s][k] for k in ("group", "mix", "group_loss", "loss")} == \
               {k: b[s][k] for k in ("group", "mix", "group_loss", "loss")}, (stop_at, s)
    ca, cb = ck.bin_path(runs["straight"] / "checkpoints", steps), ck.bin_path(runs["interrupted"] / "checkpoints", steps)
    assert ca.read_bytes() == cb.read_bytes(), stop_at
    assert ck.sidecar_path(ca).read_text() == ck.sidecar_path(cb).read_text(), stop_at
    side = json.loads(ck.sidecar_path(cb).read_text())
    assert side["data"]["mixer"]["kind"] == "bandit" and sum(side["data"]["mixer"]["n"]) == steps
    assert [g["name"] for g in side["data"]["groups"]] == ["count", "pairs", "noise"]
    vals = [e for e in straight if e["event"] == "val"]
    assert vals and set(vals[0]["group_val_loss"]) == {"count", "pairs", "noise"}


# ---------------------------------------------------------------- dashboard
@pytest.mark.skipif(not __import__("shutil").which("node"), reason="needs node to run the page's script")
def test_dashboard_stacks_the_mix_to_one(tmp_path):
    import re
    page = (REPO / "andrea" / "web" / "dashboard.html").read_text()
    fn = re.search(r"\nfunction stackMix\(history\) \{.*?\n\}\n", page, re.S).group(0)
    history = [{"step": 1, "loss": 3.0}, {"step": 2, "val_loss": 2.9},
               {"step": 3, "mix": {"a": 0.2, "b": 0.5, "c": 0.3}},
               {"step": 4, "mix": {"a": 0.1, "b": 0.1, "c": 0.8}}]
    js = tmp_path / "t.js"
    js.write_text(fn + f"\nconsole.log(JSON.stringify(stackMix({json.dumps(history)})));\n")
    out = json.loads(subprocess.run(["node", str(js)], capture_output=True, text=True, check=True).stdout)
    assert out["names"] == ["a", "b", "c"] and out["steps"] == [3, 4]
    lo = np.array([L["lo"] for L in out["layers"]])
    hi = np.array([L["hi"] for L in out["layers"]])
    np.testing.assert_allclose(hi - lo, [[0.2, 0.1], [0.5, 0.1], [0.3, 0.8]])
    np.testing.assert_allclose(hi[-1], [1.0, 1.0])
    np.testing.assert_allclose(lo[1:], hi[:-1])


# ---------------------------------------------------------------- workflow
def test_firehose_target_tokenizes_the_groups(tmp_path):
    from test_workflow import copy_repo, job_stats, smk
    r = smk(copy_repo(tmp_path), "-n", "--cores", "1", "results/ANDREA-firehose")
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = job_stats(r.stdout + r.stderr)
    assert jobs["tokenize_groups"] == jobs["tokenize"] == jobs["train"] == jobs["evaluate"] == 1
    r = smk(tmp_path, "-n", "--cores", "1", "results/ANDREA-tiny")
    assert "tokenize_groups" not in job_stats(r.stdout + r.stderr)


# ---------------------------------------------------------------- comparison table
def test_firehose_report_tabulates_arms_at_equal_steps(tmp_path):
    rep = load_script(REPO / "scripts" / "firehose-report.py", "firehose_report")
    groups = ["a", "noise"]
    for arm, kind, reward, seed, noise_steps, val_a in [("u1", "uniform", "loss", 1, 2, 2.0), ("u2", "uniform", "loss", 2, 1, 3.0),
                                                        ("p1", "bandit", "progress", 1, 0, 1.0)]:
        run = tmp_path / "sweep" / arm
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(
            f"exp: X\ndata:\n  mixer: {{kind: {kind}, reward: {reward}}}\ntrain:\n  seed: {seed}\n")
        hist = [{"step": s, "loss": 1.0, "group": "noise" if s <= noise_steps else "a",
                 "mix": {"a": 0.5, "noise": 0.5}} for s in range(1, 5)]
        hist[-1]["group_val_loss"] = {"a": val_a, "noise": 6.0}
        (run / "X.loss.json").write_text(json.dumps({"history": hist}))
    runs, mixes = rep.load_runs(tmp_path / "sweep")
    t = rep.summary(runs, "noise")
    assert t.loc["uniform", "seeds"] == 2 and t.loc["uniform", "steps"] == 4
    assert t.loc["uniform", "val_learnable_mean"] == 2.5 and t.loc["uniform", "val_learnable_spread"] == 1.0
    assert t.loc["uniform", "share_noise"] == pytest.approx((0.5 + 0.25) / 2)
    assert t.loc["bandit-progress", "share_noise"] == 0.0 and t.loc["bandit-progress", "val_a"] == 1.0
    assert len(mixes) == 3 * 4 * len(groups)
    rep.plot(mixes, tmp_path / "mix.png", "noise")
    assert (tmp_path / "mix.png").stat().st_size > 1000
    assert "| bandit-progress |" in rep.markdown(t)
    # a finished run's trained/ copy is not a second run; an evaluated run gets its task exact match
    (tmp_path / "sweep" / "p1" / "trained").mkdir()
    for f in ("config.yaml", "X.loss.json"):
        (tmp_path / "sweep" / "p1" / "trained" / f).write_text((tmp_path / "sweep" / "p1" / f).read_text())
    (tmp_path / "sweep" / "p1" / "eval").mkdir()
    (tmp_path / "sweep" / "p1" / "eval" / "metrics.json").write_text(json.dumps({"tasks": {"accuracy": 0.5}}))
    t = rep.summary(rep.load_runs(tmp_path / "sweep")[0], "noise")
    assert t.loc["bandit-progress", "seeds"] == 1 and t.loc["bandit-progress", "tasks"] == 0.5
    # against a published comparison: frozen, then judged per arm within the tolerances
    assert rep.main(["--runs", str(tmp_path / "sweep"), "--write-published", str(tmp_path / "pub.json"),
                     "--machine", "m"]) == 0
    pub = json.loads((tmp_path / "pub.json").read_text())
    assert {a["arm"] for a in pub["arms"]} == {"uniform", "bandit-progress"} and pub["machine"] == "m"
    v = rep.compare(t, pub, "noise", 0.05, 0.05)
    assert (v["verdict"] == "PASS").all()
    pub["arms"][[a["arm"] for a in pub["arms"]].index("uniform")]["val_learnable_mean"] += 0.06
    v = rep.compare(t, pub, "noise", 0.05, 0.05)
    assert v.loc["uniform", "verdict"] == "FAIL" and v.loc["bandit-progress", "verdict"] == "PASS"
    (tmp_path / "pub.json").write_text(json.dumps(pub))
    assert rep.main(["--runs", str(tmp_path / "sweep"), "--published", str(tmp_path / "pub.json"),
                     "--report", str(tmp_path / "report.md"), "--plot", str(tmp_path / "mix.png")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "**FAIL**" in text and "![mixtures](mix.png)" in text
