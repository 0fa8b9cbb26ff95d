"""dev/ab_settings.py on the CPU: its variant syntax, its refusal of repeated names, and its exit
code where no GPU is (the timing itself needs one).

    python -m pytest tests/test_ab_settings.py -q
"""
import argparse
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ab():
    return load_script(ROOT / "dev" / "ab_settings.py", "ab_settings")


def test_variant_syntax(ab):
    assert ab.parse_variant("t:fp8_tile_rows=128,fp8_layernorm_rows=32") == (
        "t", {"fp8_tile_rows": 128, "fp8_layernorm_rows": 32})
    assert ab.parse_variant("base:") == ("base", {})
    assert ab.parse_variant("sr:fp8_dlogits_rounding=nearest") == ("sr", {"fp8_dlogits_rounding": "nearest"})
    for bad in ("noname", ":fp8_tile_rows=128"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME:ATTR=VALUE"):
            ab.parse_variant(bad)
    with pytest.raises(SystemExit, match="expected ATTR=VALUE"):
        ab.parse_variant("x:fp8_tile_rows")


def test_repeated_names_are_refused(ab):
    with pytest.raises(SystemExit, match="names repeat"):
        ab.main(["--variant", "a:", "--variant", "a:fp8_tile_rows=128"])


def test_without_a_gpu_it_says_so(ab, capsys):
    from andrea.backends import cuda_available
    if cuda_available():
        pytest.skip("a GPU is here")
    assert ab.main(["--variant", "base:", "--variant", "t:fp8_tile_rows=128"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err

