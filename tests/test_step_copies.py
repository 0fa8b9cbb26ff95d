"""dev/step_copies.py on the CPU: every form it times is described in its help, and without a GPU it
says so and exits 2 (the timing itself runs on a GPU: docs/BENCHMARKS.md)."""
import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "dev" / "step_copies.py"


@pytest.fixture(scope="module")
def sc():
    spec = importlib.util.spec_from_file_location("step_copies", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
