"""The Snakemake DAG: dry runs for every experiment, lint, and the offline default end to end.

Runs in a copy of the checkout under tmp_path, so the real data/ and results/ are never touched.
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent
ALL_RULES = {"data_stage_config", "pull_conversations", "prep_megachat", "train_tokenizer", "tokenize",
             "experiment_stage_config", "train", "archive", "evaluate"}
COPY = ("andrea", "kernels", "conf", "config", "profiles", "workflow", "scripts", "docs", "pyproject.toml", "data/fixtures")


def copy_repo(dst: Path) -> Path:
    for name in COPY:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


def smk(cwd, *args, timeout=600):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = str(cwd)  # the copy's andrea, not the one of this checkout
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def job_stats(out: str) -> dict:
    """{rule: count} from the 'Job stats' table of a (dry) run; {} when nothing is to be done."""
    m = re.search(r"Job stats:\njob\s+count\n[-\s]+\n(.*?)\ntotal\s+\d+", out, re.S)
    if not m:
        assert "Nothing to be done" in out, out[-3000:]
        return {}
    return {name: int(n) for name, n in (line.rsplit(None, 1) for line in m.group(1).splitlines())}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return copy_repo(tmp_path_factory.mktemp("checkout"))


@pytest.mark.parametrize("exp", ["ANDREA-12M", "ANDREA-120M", "ANDREA-tiny"])
def test_dag_resolves_with_every_rule(checkout, exp):
    r = smk(checkout, "-n", "--cores", "1", f"results/{exp}")
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = job_stats(r.stdout + r.stderr)
    assert ALL_RULES <= set(jobs) and jobs[f"results/{exp}"] == 1
    assert jobs["train"] == jobs["archive"] == jobs["evaluate"] == 1


def test_lint_clean(checkout):
    r = smk(checkout, "--lint")
    out = r.stdout + r.stderr
    findings = re.findall(r"^\s+\* (.+?):?$", out, re.M)
    assert r.returncode == 0 and not findings, out[-3000:]


def test_bad_override_names_key(checkout):
    r = smk(checkout, "-n", "--cores", "1", "--config", "overrides=train.lrr=1")
    assert r.returncode != 0 and "Key 'lrr' not in 'TrainConfig'" in r.stdout + r.stderr


def test_shared_data_folder_with_different_settings(checkout):
    """With data.source=synthetic everywhere, ANDREA-tiny (val 5%) and ANDREA-12M (val 1%) share
    data/synthetic: one of them at a time is fine, both at once is refused."""
    ov = "overrides=data.source=synthetic"
    r = smk(checkout, "-n", "--cores", "1", "results/ANDREA-12M", "--config", ov)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    r = smk(checkout, "-n", "--cores", "1", "results/ANDREA-12M", "results/ANDREA-tiny", "--config", ov)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "share this data folder" in out and "ANDREA-tiny" in out


def test_every_stage_from_its_own_experiment(tmp_path):
    """All experiments read data/local here, where ANDREA-tiny pins val_fraction 0.05 and ANDREA-12M
    0.01: the stage files written for results/ANDREA-12M hold ANDREA-12M's settings (they once came
    from the default experiment, re-parsed in a job that did not know the targets)."""
    work = copy_repo(tmp_path)
    ov = "overrides=[data.source=local,data.local_path=data/fixtures/hermes3-sample.jsonl]"
    r = smk(work, "--cores", "1", "results/ANDREA-12M", "--until", "data_stage_config", "experiment_stage_config",
            "--config", ov)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert OmegaConf.load(work / "data/local/config/prep.yaml").data.val_fraction == 0.01
    run = work / "results" / "ANDREA-12M+data.source=local"
    for part in ("train", "eval"):
        cfg = OmegaConf.load(run / "resolved" / f"{part}.yaml")
        assert cfg.data.val_fraction == 0.01 and cfg.exp == run.name and cfg.model.vocab_size == 8192
    assert "eval" not in OmegaConf.load(run / "resolved" / "train.yaml")
    assert not (work / "results" / "ANDREA-tiny").exists()


def test_overrides_run_in_their_own_folder(checkout):
    """A list of overrides names the run folder; the older one-string form gives the same run;
    eval.* overrides re-evaluate the run in place (they do not change the weights)."""
    r = smk(checkout, "-n", "--cores", "1", "--config", "overrides=[train.lr=1e-3,train.seed=2]")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    name = "ANDREA-tiny+train.lr=0.001,train.seed=2"
    assert f"results/{name}/trained/{name}.loss.json" in out and "results/ANDREA-tiny/" not in out
    assert f"exp={name}" in out.replace("'", "")  # the train step is told its run's name
    s = smk(checkout, "-n", "--cores", "1", "--config", "overrides=train.seed=2 train.lr=1e-3")
    assert s.returncode == 0 and f"results/{name}/report.md" in s.stdout + s.stderr
    e = smk(checkout, "-n", "--cores", "1", "--config", "overrides=[eval.batches=4]")
    assert e.returncode == 0 and "results/ANDREA-tiny/report.md" in e.stdout + e.stderr


@pytest.mark.parametrize("cfg, expect", [
    ("bogus=1", "Additional properties are not allowed"),
    ("overrides=[train.lr=1e-3,'bad key=1']", "is not valid under any of the given schemas"),
    ("exp=ANDREA-1B", "exp='ANDREA-1B'; expected one of"),
])
def test_workflow_config_schema(checkout, cfg, expect):
    r = smk(checkout, "-n", "--cores", "1", "--config", cfg)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and expect in out, out[-3000:]


def test_workflow_config_file_is_valid():
    import jsonschema
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    jsonschema.validate(cfg, schema)
    assert cfg["exp"] == "ANDREA-tiny" and cfg["overrides"] == [] and cfg["ranks"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"exp": "ANDREA-tiny", "overrides": [1]}, schema)


def test_slurm_profile_dry_run(checkout):
    """profiles/slurm parses (its executor plugin is a dev dependency) and asks Slurm for a GPU and
    the engine's planned memory for training ANDREA-12M; ANDREA-tiny's training asks for no GPU."""
    r = smk(checkout, "-n", "--workflow-profile", "profiles/slurm", "results/ANDREA-12M")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    train = re.search(r"^rule train:\n(.*?)\n\n|^rule train:\n(.*?)(?=^\[|^rule )", out, re.S | re.M)
    block = out[out.index("rule train:"):]
    block = block[:block.index("resources:") + 400].split("\n")
    res = next(line for line in block if "resources:" in line)
    assert "gpu=1" in res and "slurm_partition=gpu" in res and "runtime=2880" in res, res
    from andrea.core.plan import make_plan
    from andrea.train import compose_config
    assert f"mem_mb={make_plan(compose_config('ANDREA-12M')).total() // 2**20 + 2048}" in res
    t = smk(checkout, "-n", "--workflow-profile", "profiles/slurm", "results/ANDREA-tiny")
    block = (t.stdout + t.stderr).split("rule train:")[1]
    assert "gpu=0" in block[:block.index("\n\n") if "\n\n" in block else 2000]


def test_train_rule_takes_the_rank_count(checkout):
    """config ranks: 1 is today's command; N > 1 the single-host launch (--ranks N, and --zero1 with
    config zero1); with a launcher (Slurm: srun) `srun -n N`, and the job asks Slurm for N tasks of
    one GPU each and N GPUs."""
    ov, run = "overrides=[train.grad_accum=4]", "results/ANDREA-12M+train.grad_accum=4"

    def train_block(*cfg, profile=("--cores", "1", "--resources", "gpu=4")):  # default profile: gpu=1
        r = smk(checkout, "-n", "-p", *profile, "--config", *cfg, ov, "--", f"{run}/trained/final.bin")
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-3000:]
        block = out[out.index("rule train:"):]
        return block[:block.index("tee ")]

    one = train_block("ranks=1")
    assert "python3 -m andrea.train --new-run-on-change experiment=ANDREA-12M" in one and "gpu=1," in one
    two = train_block("ranks=2")
    assert "python3 -m andrea.train --ranks 2 --new-run-on-change" in two and "gpu=2," in two
    assert "tasks=0" in two and "mpi=," in two
    zero1 = train_block("ranks=2", "zero1=True")  # ZeRO-1: every rank gets the flag
    assert "python3 -m andrea.train --ranks 2 --zero1 --new-run-on-change" in zero1
    slurm = train_block("ranks=4", "launcher=srun", profile=("--workflow-profile", "profiles/slurm"))
    assert "srun -n 4 python3 -m andrea.train --new-run-on-change" in slurm
    for want in ("gpu=4", "tasks=4", "tasks_per_gpu=1", "mpi=srun"):
        assert want in slurm, slurm
    r = smk(checkout, "-n", "--cores", "1", "--config", "ranks=0")
    assert r.returncode != 0 and "ranks" in r.stdout + r.stderr


def test_default_profile_dry_run(checkout):
    r = smk(checkout, "-n", "results/ANDREA-tiny")  # no --cores: profiles/default gives it
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "profiles/default" in out, out[-3000:]


def test_local_mirror_data_chain(tmp_path):
    """data.source=local: the fixture mirror through pull, prep, tokenizer and shards of ANDREA-12M."""
    work = copy_repo(tmp_path)
    ov = "overrides=[data.source=local,data.local_path=data/fixtures/hermes3-sample.jsonl,data.val_fraction=0.2]"
    dry = smk(work, "-n", "--cores", "1", "results/ANDREA-12M", "--config", ov)
    assert dry.returncode == 0 and "data/fixtures/hermes3-sample.jsonl" in dry.stdout + dry.stderr
    r = smk(work, "--cores", "1", "data/local/tok8192/shards.json", "--config", ov)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    # 21 conversations cannot give 8192 tokens: said on the terminal, not only in the step's log
    assert re.search(r"train-tokenizer: WARNING: .* fewer than the 8192 asked", r.stderr), r.stderr[-3000:]
    pull = json.loads((work / "data/local/raw/pull-report.json").read_text())
    assert pull["rows"] == 23 and pull["skipped"] == 2  # a cut-off line, a row without conversations
    prep = json.loads((work / "data/local/megachat/report.json").read_text())
    assert prep["dropped"] == {"unknown_role": 1} and prep["duplicates"] == 1 and prep["kept"] == 21
    man = json.loads((work / "data/local/tok8192/shards.json").read_text())
    assert man["train"]["tokens"] > 0 and man["val"]["tokens"] > 0
    assert job_stats(smk(work, "-n", "--cores", "1", "data/local/tok8192/shards.json", "--config", ov).stdout) == {}


def test_failed_step_shows_its_log(tmp_path):
    """A step that fails prints the last lines of its log under Snakemake's error (ANDREA-12M's
    pull from the hub, offline here, fails at once with its hint)."""
    work = copy_repo(tmp_path)
    r = smk(work, "--cores", "1", "results/ANDREA-12M", "--until", "pull_conversations")
    assert r.returncode != 0
    assert "--- last" in r.stderr and "data/hub/logs/pull.log ---" in r.stderr, r.stderr[-3000:]
    assert "data.source=synthetic" in r.stderr.split("--- last", 1)[1]  # the hint, from the log
    assert "WARNING: HF_HUB_OFFLINE" in r.stderr


@pytest.mark.slow
def test_offline_default_end_to_end(tmp_path):
    """snakemake --cores 1 from a clean copy; second run does nothing; train.lr re-runs train,
    archive and evaluate only; eval.* re-runs evaluate only."""
    work = copy_repo(tmp_path)
    r = smk(work, "--cores", "1")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    run = work / "results" / "ANDREA-tiny"
    m = json.loads((run / "eval" / "metrics.json").read_text())
    pinned = OmegaConf.load(REPO / "conf" / "experiment" / "ANDREA-tiny.yaml").train.steps
    assert m["step"] == pinned  # the archived checkpoint is the run's last step
    assert m["val_loss"] < 0.5 * math.log(512), m["val_loss"]  # well below a uniform guess, ln V
    assert m["tasks"]["n"] >= 100 and m["tasks"]["accuracy"] > m["tasks"]["chance"], m["tasks"]
    report = (run / "report.md").read_text()
    assert "validation loss" in report and (run / "eval" / "loss.png").stat().st_size > 1000
    if (REPO / "docs" / "published" / "ANDREA-tiny.json").is_file():
        assert m["published"]["verdict"] == "PASS", m["published"]
        assert "**PASS**" in report
    man = json.loads((run / "archive" / "final" / "manifest.json").read_text())
    import hashlib
    for f in man["files"]:
        assert hashlib.sha256((run / "archive" / "final" / f["file"]).read_bytes()).hexdigest() == f["sha256"]
    assert man["environment"]["python"] and man["environment"]["numpy"]

    assert job_stats(smk(work, "--cores", "1").stderr) == {}
    lr = smk(work, "-n", "--cores", "1", "--config", "overrides=train.lr=1e-3")
    assert set(job_stats(lr.stdout + lr.stderr)) == {"experiment_stage_config", "train", "archive", "evaluate", "all"}
    ev = smk(work, "-n", "--cores", "1", "--config", "overrides=eval.batches=4")
    assert set(job_stats(ev.stdout + ev.stderr)) == {"experiment_stage_config", "evaluate", "all"}
    # a dry run wrote nothing: the pinned config is still up to date
    assert job_stats(smk(work, "-n", "--cores", "1").stdout) == {}
    assert "Overrides: none" in report

    # a run with overrides: its own folder, the pinned run untouched, the report says why it is not compared
    before = (run / "report.md").read_text()
    r = smk(work, "--cores", "1", "--config", "overrides=[train.steps=20,train.eval_every=10]")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert set(job_stats(r.stdout + r.stderr)) == {"experiment_stage_config", "train", "archive", "evaluate", "all"}
    shown = r.stdout + r.stderr  # the train and evaluate steps tee their output to the terminal
    assert "20/20" in shown and "loss=" in shown and "python -m andrea.pipeline.dashboard" in shown
    assert "andrea.pipeline.evaluate: ANDREA-tiny+" in shown and "not compared: overrides" in shown
    other = work / "results" / "ANDREA-tiny+train.eval_every=10,train.steps=20"
    rep = (other / "report.md").read_text()
    assert "`train.steps=20`" in rep and "Not compared: overrides" in rep and "PASS" not in rep
    assert json.loads((other / "eval" / "metrics.json").read_text())["step"] == 20
    assert (run / "report.md").read_text() == before
    assert (other / "benchmarks" / "train.tsv").is_file()

    # snakemake --report: one page holding the reports, loss plots and samples
    r = smk(work, "--cores", "1", "--report", "results/report.html")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert (work / "results" / "report.html").stat().st_size > 10_000
