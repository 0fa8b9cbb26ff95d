"""The one-command pipeline survives Ctrl-C, SIGTERM and preemption: interrupt the default
workflow (ANDREA-tiny with few steps) at a random point of training by signalling Snakemake's
process group, run the same command again, and compare the final checkpoint's sha256 and the
report with a straight run. A preempted train job (SIGTERM to it alone) resumes by itself under
`--retries`; a changed training setting starts afresh in its own run folder, the old run untouched.
SIGKILL of the whole process group (kill -9, a power loss) leaves Snakemake's lock behind: the same
command stops on it (exit 1, touching nothing), and after `snakemake --unlock` it resumes to the
same bytes.

Runs in a copy of the checkout (the real data/ and results/ are never touched)."""
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from andrea.pipeline.runs import run_name
from relkit import REPO, TRIALS, group_alive, wait_for

RUNS = max(1, TRIALS // 2)  # a pipeline run costs a minute or more: one interruption per kind by default

sys.path.insert(0, str(REPO / "tests"))
from test_workflow import copy_repo  # noqa: E402

STEPS = 40
OVERRIDES = (f"train.steps={STEPS} train.ckpt_every=5 train.eval_every=10 train.sample_every=20 "
             "train.batch_size=4 train.seq_len=32 data.n_synthetic=400 "
             "eval.n_tasks=8 eval.batches=2 eval.max_new_tokens=8")
NAME = run_name("ANDREA-tiny", OVERRIDES.split())  # a run with overrides has its own folder (andrea/pipeline/runs.py)
RUN = Path("results") / NAME
FINAL = RUN / "archive" / "final" / f"step_{STEPS:08d}.bin"


def smk_cmd(*extra):
    return [sys.executable, "-m", "snakemake", "--cores", "1", *extra, "--config", f"overrides={OVERRIDES}"]


def smk_env(work):
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                PYTHONPATH=str(work), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def smk(work, *extra, timeout=900):
    return subprocess.run(smk_cmd(*extra), cwd=work, env=smk_env(work), capture_output=True, text=True,
                          timeout=timeout)


def outcome(work):
    """(sha256 of the archived final checkpoint, the report without its timings (evaluation time,
    training speed and wall time), metrics without them, the history's steps)."""
    report = (work / RUN / "report.md").read_text()
    report = re.sub(r"Evaluated in [\d.]+ s", "Evaluated in _ s", report)
    report = re.sub(r"\| (training tokens/s \(median\)|training wall time) \| [^|]+ \|", r"| \1 | _ |", report)
    metrics = json.loads((work / RUN / "eval" / "metrics.json").read_text())
    metrics.pop("wall_s", None)
    for k in ("tokens_per_s", "train_wall_s"):  # the memory plan stays: it must be the same
        metrics["training"].pop(k)
    steps = [h["step"] for h in json.loads((work / RUN / "trained" / f"{NAME}.loss.json").read_text())["history"]]
    return hashlib.sha256((work / FINAL).read_bytes()).hexdigest(), report, metrics, steps


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A copy of the checkout with the data built and one straight run's outcome."""
    work = copy_repo(tmp_path_factory.mktemp("pipeline"))
    r = smk(work)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    ref = outcome(work)
    assert ref[3] == list(range(1, STEPS + 1))
    return work, ref


def fresh_results(work):
    """Forget the run (keep the data): the next snakemake trains it again from scratch."""
    shutil.rmtree(work / RUN)


def interrupt(work, sig, rng):
    """Start the workflow in its own process group, signal the group at a random moment of
    training; returns (signalled while training?, snakemake's exit code)."""
    p = subprocess.Popen(smk_cmd(), cwd=work, env=smk_env(work), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        state = work / RUN / f"{NAME}.state.json"
        wait_for(lambda: state.exists() and json.loads(state.read_text()).get("engine_pid"), "training to start",
                 timeout=600, proc=p)
        wait_for(lambda: json.loads(state.read_text()).get("step", 0) >= rng.randint(1, STEPS // 2),
                 "a random step", timeout=600, proc=p)
        training = json.loads(state.read_text()).get("step", 0) < STEPS
        os.killpg(p.pid, sig)
        return training, p.wait(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_workflow_resumes_to_the_same_bytes(straight, sig):
    work, ref = straight
    rng = random.Random(int(os.environ.get("ANDREA_RELIABILITY_SEED", "9")) + int(sig))
    exact = 0
    for _ in range(RUNS):
        fresh_results(work)
        training, rc = interrupt(work, sig, rng)
        assert training and rc != 0  # stopped mid-training: the workflow failed, nothing marked done
        ckpts = sorted((work / RUN / "checkpoints").glob("step_*.bin"))
        assert ckpts, "the stopped run kept its checkpoints"
        kept = int(ckpts[-1].stem.split("_")[1])
        assert not (work / RUN / "trained").exists() and not (work / FINAL).exists()
        t_again = time.time()
        r = smk(work)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        assert outcome(work) == ref
        hist = json.loads((work / RUN / "trained" / f"{NAME}.loss.json").read_text())["history"]
        assert all(h["t"] < t_again for h in hist if h["step"] <= kept), "resumed, not trained again"
        exact += 1
    print(f"\nsnakemake {signal.Signals(sig).name} to the process group: {RUNS} interrupted, "
          f"{exact} resumed bit-exact (checkpoint sha256, report)")


@pytest.mark.slow
def test_retries_resume_a_preempted_train_job(straight):
    """SIGTERM to the train job alone, as a scheduler preempting it: it exits 75, Snakemake
    retries it, the retry resumes from its checkpoint, and the end is the straight run's."""
    work, ref = straight
    fresh_results(work)
    p = subprocess.Popen(smk_cmd("--retries", "1"), cwd=work, env=smk_env(work), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        state = work / RUN / f"{NAME}.state.json"
        wait_for(lambda: state.exists() and json.loads(state.read_text()).get("last_checkpoint_step"),
                 "a first checkpoint", timeout=600, proc=p)
        proxy = json.loads(state.read_text())["pid"]
        os.kill(proxy, signal.SIGTERM)
        out = p.communicate(timeout=900)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, out[-4000:]
    assert "Trying to restart job" in out and "75" in out, out[-4000:]  # exit 75, then the retry
    assert outcome(work) == ref


@pytest.mark.slow
def test_changed_training_setting_starts_afresh_and_keeps_the_old_run(straight):
    work, _ = straight
    if not (work / FINAL).exists():
        r = smk(work)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    old = sorted(p.name for p in (work / RUN / "checkpoints").glob("step_*"))
    p = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--config",
                        f"overrides={OVERRIDES} train.lr=1e-3"], cwd=work, env=smk_env(work),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    # a changed training setting is another run, in its own folder: the old one is left as it was
    assert sorted(x.name for x in (work / RUN / "checkpoints").glob("step_*")) == old
    new = run_name("ANDREA-tiny", OVERRIDES.split() + ["train.lr=1e-3"])
    assert new != NAME
    hist = json.loads((work / "results" / new / "trained" / f"{new}.loss.json").read_text())["history"]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))


KILL_AT = 12  # a step after the checkpoints of steps 5 and 10, 28 steps before the end


def history_steps(work):
    """The steps of the live loss history (the run folder's <exp>.loss.json), [] until it is there."""
    try:
        return [h["step"] for h in json.loads((work / RUN / f"{NAME}.loss.json").read_text())["history"]]
    except (OSError, ValueError, KeyError):
        return []


@pytest.mark.slow
def test_sigkill_of_the_process_group_needs_unlock_then_resumes_to_the_same_bytes(straight):
    """kill -9 of Snakemake's process group once the loss history shows step KILL_AT: nothing gets
    to clean up, so Snakemake's lock stays; the same command refuses to start (LockException,
    exit 1) and changes nothing; `snakemake --unlock`, then the same command, resumes from the
    newest checkpoint and ends with the straight run's checkpoint bytes and report."""
    work, ref = straight
    fresh_results(work)
    p = subprocess.Popen(smk_cmd(), cwd=work, env=smk_env(work), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: KILL_AT in history_steps(work), f"step {KILL_AT} in the loss history", timeout=600, proc=p)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        wait_for(lambda: not group_alive(p.pid), "every process of the group to be gone", timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    hist = history_steps(work)
    assert KILL_AT in hist and max(hist) < STEPS, f"killed after the last step: {max(hist)}"
    trained = work / RUN / "trained"  # Snakemake made the folder for the job's outputs; none is there
    assert not (trained.exists() and any(trained.iterdir())) and not (work / FINAL).exists()
    assert list((work / ".snakemake" / "locks").iterdir()), "SIGKILL left no lock to test"
    ckpts = sorted((work / RUN / "checkpoints").glob("step_*.bin"))
    assert ckpts, "the killed run kept its checkpoints"
    kept = int(ckpts[-1].stem.split("_")[1])
    before = {q.name: q.read_bytes() for q in (work / RUN / "checkpoints").iterdir() if q.is_file()}

    r = smk(work)  # the same command: stopped by the stale lock
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert "LockException" in out and "--unlock" in out, out[-4000:]
    assert {q.name: q.read_bytes() for q in (work / RUN / "checkpoints").iterdir() if q.is_file()} == before
    assert not (trained.exists() and any(trained.iterdir()))

    u = subprocess.run([sys.executable, "-m", "snakemake", "--unlock"], cwd=work, env=smk_env(work),
                       capture_output=True, text=True, timeout=300)  # the README's command, as it is
    assert u.returncode == 0, (u.stdout + u.stderr)[-4000:]
    locks = work / ".snakemake" / "locks"
    assert not (locks.exists() and any(locks.iterdir())), "--unlock left the stale lock"
    t_again = time.time()
    r = smk(work)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert outcome(work) == ref
    hist = json.loads((work / RUN / "trained" / f"{NAME}.loss.json").read_text())["history"]
    assert all(h["t"] < t_again for h in hist if h["step"] <= kept), "resumed, not trained again"
