"""dev/step_trace.py on the CPU (the NumPy backend): traces of the same steps agree call for call,
a call that changes an array shows it at that call, and --diff names the first calls that differ
(exit 1) or says the traces agree (exit 0)."""
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import load_script

TOOL = Path(__file__).resolve().parent.parent / "dev" / "step_trace.py"


@pytest.fixture(scope="module")
def tool():
    return load_script(TOOL, "dev_step_trace")


def test_a_call_that_changes_an_array_shows_at_that_call(tool):
    class Toy:
        def k_add(self, out, x):
            out += x

        def k_read(self, out):
            return float(out.sum())

    be, log = Toy(), []
    tool.traced(be, log)
    out, x = np.zeros(4, np.float32), np.ones(4, np.float32)
    be.k_read(out)
    be.k_add(out, x)
    be.k_read(out)
    assert [r["call"] for r in log] == ["k_read", "k_add", "k_read"]
    assert log[0]["hashes"][0] != log[1]["hashes"][0] == log[2]["hashes"][0]
    assert log[1]["hashes"][1] == tool.array_hash(x) and tool.array_hash(3.0) is None


def test_traces_of_the_same_steps_agree_and_diff_finds_a_change(tool, tmp_path, capsys):
    args = ["--backend", "numpy", "--shape", "tiny", "--precision", "fp32", "--batch", "2", "--steps", "1"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert tool.main(args + ["--out", str(a)]) == 0
    assert tool.main(args + ["--out", str(b)]) == 0
    ta, tb = json.loads(a.read_text()), json.loads(b.read_text())
    calls = [c["call"] for c in ta["calls"]]
    assert calls[0] == "k_embed_fwd" and "k_loss_bwd" in calls and "k_adamw_step" in calls
    assert ta["calls"] == tb["calls"]
    assert tool.main(["--diff", str(a), str(b)]) == 0
    assert "the traces agree" in capsys.readouterr().out
    # one argument of one call changed: that call and that argument are named
    k = calls.index("k_loss_bwd")
    tb["calls"][k]["hashes"][2] = "0" * 16
    b.write_text(json.dumps(tb))
    assert tool.main(["--diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "1 of" in out and "k_loss_bwd" in out
    rows, count = tool.diff(ta["calls"], tb["calls"])
    assert count == 1 and rows[0]["i"] == k and rows[0]["arguments that differ"] == "2"
    # a longer trace: the extra calls count as differing
    rows, count = tool.diff(ta["calls"], ta["calls"] + ta["calls"][:3])
    assert count == 3 and rows[0]["b"] == calls[0] and rows[0]["a"] == "-"


def test_bad_input_is_named(tool, tmp_path):
    with pytest.raises(SystemExit, match="--set nope: expected ATTR=VALUE"):
        tool.main(["--backend", "numpy", "--set", "nope", "--out", str(tmp_path / "t.json")])
    # --set names a setting of the CUDA backend (bench.step.cuda_backend): refused before any GPU is asked for
    with pytest.raises(SystemExit, match="--set no_such_switch: not a setting of the CUDA backend"):
        tool.main(["--backend", "cuda", "--set", "no_such_switch=1", "--out", str(tmp_path / "t.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a trace"):
        tool.main(["--diff", str(bad), str(bad)])
    with pytest.raises(SystemExit, match="--out"):
        tool.main(["--backend", "numpy"])
