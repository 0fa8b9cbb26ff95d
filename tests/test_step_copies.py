"""dev/step_copies.py on the CPU: every form it times is described in its help, and without a GPU it
says so and exits 2 (the timing itself runs on a GPU: docs/BENCHMARKS.md)."""
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sc():
    return load_script(ROOT / "dev" / "step_copies.py", "step_copies")


def test_every_form_is_described(sc):
    described = [line.split()[0] for line in sc.__doc__.splitlines()
                 if line.startswith("    ") and line.split() and line.split()[0] in sc.FORMS]
    assert described == list(sc.FORMS)


def test_exits_2_without_a_gpu(sc, capsys):
    from andrea.backends import cuda_available
    if cuda_available():
        pytest.skip("a GPU is here: the script would run")
    assert sc.main(["--exp", "ANDREA-tiny", "--steps", "1", "--rounds", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
