"""The README's first command installs what the default workflow needs and no PyTorch (nor the
CUDA libraries and Triton that its default build brings): the workflow runs on the package's own
NumPy engine. Checked on what pip resolves, without installing anything: the dependency closure
of the install spec the README's first line names, followed through the installed packages'
metadata; and every module of the package and the workflow's scripts import with torch,
transformers and safetensors made unimportable."""
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
# what the default workflow must not pull: PyTorch, its CUDA build's libraries and compiler
HEAVY = re.compile(r"^(torch|triton|nvidia-.*|transformers|safetensors)$")


def readme_commands() -> list:
    """The README's first code block: its command lines (the install and the test commands)."""
    block = (REPO / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("   #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def install_extras(command: str) -> list:
    """The extras of the `pip install -e <spec>` of the project in a README command."""
    m = re.search(r"pip install (?:-\S+ )*-e '?\.(?:\[([^\]]*)\])?'?", command)
    assert m, f"no `pip install -e .` in {command!r}"
    return [e.strip() for e in (m.group(1) or "").split(",") if e.strip()]


def closure(extras: list) -> set:
    """The canonical names of the project's dependencies with these extras and of everything they
    require in turn (markers evaluated, extras followed), as the installed packages declare."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    for e in extras:
        todo += [Requirement(r) for r in project["optional-dependencies"][e]]
    seen, done = set(), set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        seen.add(name)
        key = (name, tuple(sorted(req.extras)))
        if key in done:
            continue
        done.add(key)
        try:
            requires = metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:  # not installed here: its own name is still checked
            continue
        for text in requires:
            dep = Requirement(text)
            if dep.marker is None or any(dep.marker.evaluate({"extra": x}) for x in ("", *req.extras)):
                todo.append(dep)
    return seen


def test_first_command_installs_no_torch():
    first = readme_commands()[0]
    assert "snakemake --cores 1" in first  # the line that sets up and runs the default workflow
    heavy = sorted(n for n in closure(install_extras(first)) if HEAVY.match(n))
    assert not heavy, f"the README's first command installs {heavy} (through {install_extras(first)})"


def test_second_command_installs_what_the_tests_need():
    """The test command's install holds torch and pytest (so the check above can see torch), and
    takes torch's CPU build from its own index before the dev extra."""
    second = readme_commands()[1]
    assert second.rstrip().endswith("pytest -q")
    names = closure(install_extras(second))
    assert {"torch", "pytest", "hydra-optuna-sweeper", "tensorboard"} <= names
    assert second.index("download.pytorch.org/whl/cpu torch") < second.index("pip install -e '.[dev]'")


BLOCK = """
import importlib, json, pkgutil, runpy, sys
for name in ("torch", "transformers", "safetensors"):
    sys.modules[name] = None  # `import torch` now fails, as where it is not installed
import andrea
bad = []
def check(what, load):
    try:
        load()
    except ImportError as e:
        if "halted" in str(e):
            bad.append(f"{what}: {e}")
    except BaseException:
        pass  # another missing extra (CuPy, mpi4py) or a script's own argument parsing: not this test's
for info in pkgutil.walk_packages(andrea.__path__, "andrea."):
    if not info.name.endswith(".__main__"):  # those run their command
        check(info.name, lambda: importlib.import_module(info.name))
for script in sys.argv[1:]:
    check(script, lambda: runpy.run_path(script, run_name="andrea_import_check"))
print(json.dumps(bad))
"""


def test_workflow_imports_nothing_of_torch():
    """Every module of the package, and each script the workflow runs, imports with torch,
    transformers and safetensors unimportable (they are imported inside the functions that
    need them: export, import, the PyTorch benchmarks)."""
    scripts = sorted(str(p) for p in (REPO / "scripts").glob("*.py"))
    r = subprocess.run([sys.executable, "-c", BLOCK, *scripts], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    bad = json.loads(r.stdout.strip().splitlines()[-1])
    assert not bad, bad
    import_check = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; import torch"],
                                  capture_output=True, text=True)
    assert "halted" in import_check.stderr  # the block above does make torch unimportable
