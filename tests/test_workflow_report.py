"""The workflow as a user meets it: `snakemake --report` holds every evaluated run, a bad override
is andrea.train's own line, rules are named by what they do. Runs in a copy of the checkout
(tests/test_workflow.py's helpers), two short runs of ANDREA-tiny."""
import subprocess
import sys

import pytest

from test_workflow import REPO, copy_repo, smk

SHORT = "train.steps=4,train.eval_every=2,eval.n_tasks=8,eval.batches=2"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return copy_repo(tmp_path_factory.mktemp("checkout"))


def test_report_holds_every_evaluated_run(work):
    """Two runs with overrides are evaluated; `snakemake --report results/report.html` without
    them (config exp's pinned run is not even trained) gives one page holding both."""
    names = []
    for extra in ("train.seed=1", "train.seed=2"):
        r = smk(work, "--cores", "1", "--config", f"overrides=[{SHORT},{extra}]")
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        (name,) = [p.name for p in (work / "results").iterdir() if extra in p.name]
        names.append(name)
    r = smk(work, "--cores", "1", "--report", "results/report.html")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    page = (work / "results" / "report.html").read_text(errors="replace")
    assert all(n in page for n in names) and (r.stdout + r.stderr).count("Adding report.md") == 2
    assert not (work / "report.html").exists()
    # a plain run of the default target still builds only its own run, never the other two again
    d = smk(work, "-n", "--cores", "1")
    assert d.returncode == 0 and not any(f"results/{n}/" in d.stdout + d.stderr for n in names)


@pytest.mark.parametrize("override", ["train.lr=abc", "train.lrr=1", "train.seq_len=128"])
def test_bad_override_is_andrea_trains_line(work, override):
    """The same one line as `python -m andrea.train`, exit 2: no InputFunctionException, no
    traceback, none of OmegaConf's unfilled templates ($VALUE). train.seq_len=128 fits some
    experiments (ANDREA-12M) but not the default one, so it is refused while the DAG is built."""
    r = smk(work, "-n", "--cores", "1", "--config", f"overrides=[{override}]")
    t = subprocess.run([sys.executable, "-m", "andrea.train", "experiment=ANDREA-tiny", override],
                       cwd=work, capture_output=True, text=True, env={"PYTHONPATH": str(work), "PATH": ""})
    line = t.stderr.strip()
    assert t.returncode == 2 and line.startswith("andrea.train: config error: ") and "\n" not in line
    out = r.stdout + r.stderr
    assert r.returncode == 2 and line in out.splitlines(), out[-3000:]
    assert "Exception" not in out and "Traceback" not in out and "$VALUE" not in out


def test_rules_are_named_by_what_they_do(work):
    r = smk(work, "--list-rules")
    rules = set(r.stdout.split())
    assert "pull_conversations" in rules and not any("hermes" in x for x in rules)


def test_nothing_lands_at_the_top_of_the_checkout():
    ignored = subprocess.run(["git", "check-ignore", "report.html", "compare.png", "results/report.html"],
                             cwd=REPO, capture_output=True, text=True).stdout.split()
    assert ignored == ["report.html", "compare.png", "results/report.html"]
    readme = (REPO / "README.md").read_text()
    assert "--report results/report.html" in readme and "--report report.html" not in readme


def test_compare_plot_goes_beside_the_runs(tmp_path, monkeypatch):
    from andrea.pipeline import compare
    from test_compare import hist, make_run

    a = make_run(tmp_path / "results", "E", [], hist([3.0, 2.5], 2.6, [50.0, 50.0]))
    b = make_run(tmp_path / "results", "E+train.lr=0.001", ["train.lr=0.001"], hist([3.0, 2.0], 2.1, [50.0, 50.0]))
    (tmp_path / "top").mkdir()
    monkeypatch.chdir(tmp_path / "top")
    assert compare.main([str(a), str(b)]) == 0
    assert (tmp_path / "results" / "compare.png").stat().st_size > 1000 and not list((tmp_path / "top").iterdir())
