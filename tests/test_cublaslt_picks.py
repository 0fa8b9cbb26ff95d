"""The table of cuBLASLt picks (andrea/backends/cuda/cublaslt_picks.json) on the CPU: the package's
table reads, a malformed one is refused naming the file and the field, only the GPU's and
version's entry applies, and dev/cublaslt_algos.py writes picks above its gain threshold only,
replacing its GPU's table and keeping the others (the choice of algorithm itself needs a GPU).

    python -m pytest tests/test_cublaslt_picks.py -q
"""
import json
from pathlib import Path

import pytest

from andrea.backends.cuda.cublaslt import MAX_PICK, PICKS_FILE, problem_sig, read_picks
from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
KEY = (False, True, 8192, 768, 768, 768, 768, 768, 28, 14, "bias", 14, 0, (256, 0), 28, True, True)


@pytest.fixture(scope="module")
def algos():
    return load_script(ROOT / "dev" / "cublaslt_algos.py", "cublaslt_algos")


def test_the_package_table_reads():
    doc = json.loads(PICKS_FILE.read_text())
    assert isinstance(doc["tables"], list)
    for t in doc["tables"]:
        assert read_picks(PICKS_FILE, t["device"], t["cublaslt_version"]) == t["picks"]
    assert read_picks(PICKS_FILE, "no such GPU", 1) == {}
    assert read_picks(PICKS_FILE.with_name("absent.json"), "NVIDIA H200", 1) == {}


def test_problem_sig_is_compact_json_of_the_key():
    import numpy as np
    sig = problem_sig(KEY)
    assert json.loads(sig) == json.loads(json.dumps(KEY))
    assert problem_sig(tuple(np.int64(x) if type(x) is int else x for x in KEY)) == sig
    assert " " not in sig


@pytest.mark.parametrize("doc, field", [
    ("{", "not JSON"),
    ('{"tables": {}}', "field tables"),
    ('{"tables": [{"device": "G", "picks": {}}]}', r"tables\[0\]: expected device"),
    ('{"tables": [{"device": "G", "cublaslt_version": 1, "picks": {"k": 0}}]}', r"tables\[0\]\.picks\['k'\]: 0"),
    ('{"tables": [{"device": "G", "cublaslt_version": 1, "picks": {"k": 64}}]}', "expected an integer 1..63"),
    ('{"tables": [{"device": "G", "cublaslt_version": 1, "picks": {"k": true}}]}', "True"),
])
def test_a_malformed_table_is_refused(tmp_path, doc, field):
    p = tmp_path / "picks.json"
    p.write_text(doc)
    with pytest.raises(ValueError, match=field) as e:
        read_picks(p, "G", 1)
    assert str(p) in str(e.value)


def test_picks_written_above_the_gain_only(algos, tmp_path):
    other = (True,) + KEY[1:]
    third = KEY[:2] + (4096,) + KEY[3:]
    timings = {KEY: {0: 100.0, 1: 99.0, 3: 90.0},  # 11% faster at place 3
               other: {0: 100.0, 2: 98.5},         # 1.5%: noise
               third: {1: 50.0, 2: 40.0}}          # no first pick timed: left to the heuristic
    picks = algos.new_picks(timings, 0.03)
    assert picks == {problem_sig(KEY): 3}
    assert max(picks.values()) <= MAX_PICK
    p = tmp_path / "picks.json"
    p.write_text(json.dumps({"tables": [{"device": "B", "cublaslt_version": 2, "picks": {"x": 2}},
                                        {"device": "A", "cublaslt_version": 1, "picks": {"old": 5}}]}))
    algos.write_picks(p, "A", 1, picks, {"measured": "2026-11-30"})
    assert read_picks(p, "A", 1) == picks  # its table replaced
    assert read_picks(p, "B", 2) == {"x": 2}  # another GPU's kept
    assert json.loads(p.read_text())["tables"][-1]["measured"] == "2026-11-30"
    algos.write_picks(p, "A", 1, {}, {})  # nothing faster now: its table goes
    assert read_picks(p, "A", 1) == {} and read_picks(p, "B", 2) == {"x": 2}
    p.write_text('{"tables": 3}')
    with pytest.raises(ValueError, match="field tables"):
        algos.write_picks(p, "A", 1, picks, {})
    assert p.read_text() == '{"tables": 3}'  # a malformed file is left as it was
