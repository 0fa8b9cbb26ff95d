"""A plain (non-editable) install finds its package data: configs, kernel sources, dashboard page.

The package is built from a copy of the sources and installed with pip into a folder of its own
(offline, no dependencies fetched: they come from the running environment); everything then runs
from another directory with only that folder on the path, through the console scripts.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder, its bin folder, an empty working directory, env that sees only the install)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for tree in ("andrea", "kernels", "conf"):  # the package and the two top-level folders mapped into it
        shutil.copytree(REPO / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    site = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--disable-pip-version-check", "--target", str(site), str(src)],
                       capture_output=True, text=True, timeout=300, cwd=tmp)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return site, site / "bin", elsewhere, env


def run(installed, *argv, timeout=120):
    site, bindir, cwd, env = installed
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_the_installed_package_is_the_one_imported(installed):
    site, _, _, _ = installed
    r = run(installed, sys.executable, "-c", "import andrea; print(andrea.__file__)")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve().is_relative_to(site.resolve())


def test_package_data_is_installed_whole(installed):
    site = installed[0]
    for sub, here in (("kernels", REPO / "kernels"), ("conf", REPO / "conf"), ("web", REPO / "andrea" / "web")):
        mine = sorted(p.relative_to(here) for p in here.rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts)
        theirs = sorted(p.relative_to(site / "andrea" / sub) for p in (site / "andrea" / sub).rglob("*")
                        if p.is_file() and "__pycache__" not in p.parts)
        assert mine and theirs == mine, f"andrea/{sub}: installed {theirs}, expected {mine}"
    r = run(installed, sys.executable, "-c",
            "from andrea.paths import KERNEL_DIR; print(' '.join(sorted(p.name for p in KERNEL_DIR.iterdir())))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == sorted(p.name for p in (REPO / "kernels").iterdir())


def test_every_subpackage_is_listed():
    """pyproject.toml lists the packages by hand (two of them are mapped from the top level): a
    subpackage missing from the list would be missing from the wheel."""
    import tomllib
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "andrea").rglob("__init__.py")}
    found |= {"andrea.kernels", "andrea.conf"}
    assert listed == found, f"pyproject.toml [tool.setuptools] packages: missing {sorted(found - listed)}, " \
                            f"extra {sorted(listed - found)}"


def test_hydra_composes_the_default_experiment(installed):
    bindir = installed[1]
    r = run(installed, bindir / "andrea-train", "--cfg", "job", "experiment=ANDREA-tiny")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^exp: ANDREA-tiny$", r.stdout, re.M), r.stdout[:2000]
    assert re.search(r"^  n_layer: 2$", r.stdout, re.M), r.stdout[:2000]
    r = run(installed, bindir / "andrea", "params", "ANDREA-tiny")
    assert r.returncode == 0 and "136,960 parameters" in r.stdout, r.stdout + r.stderr


def test_the_dashboard_serves_its_page(installed):
    bindir, cwd, env = installed[1], installed[2], installed[3]
    run_dir = cwd / "results" / "ANDREA-tiny"
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen([str(bindir / "andrea-dashboard"), str(run_dir), "--port", "0"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"(http://\S+/)", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        with urllib.request.urlopen(m.group(1), timeout=30) as resp:
            assert resp.status == 200
            assert resp.read() == (REPO / "andrea" / "web" / "dashboard.html").read_bytes()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
