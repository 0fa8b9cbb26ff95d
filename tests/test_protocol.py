"""andrea.run.protocol: the engine's event lines and exit codes, written and read by one module."""
import io
import re
from pathlib import Path

import pytest

from andrea.run import protocol
REPO = Path(__file__).resolve().parent.parent


def test_emit_then_parse_round_trip(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    protocol.emit("step", step=7, loss=1.25, skipped=False)
    protocol.emit("done", step=7, status="finished")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert protocol.parse(lines[0]) == {"event": "step", "step": 7, "loss": 1.25, "skipped": False}
    assert protocol.parse(lines[1] + "\n") == {"event": "done", "step": 7, "status": "finished"}


def test_emit_refuses_an_unknown_event(monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    with pytest.raises(ValueError, match="'stp'"):
        protocol.emit("stp", step=1)


def test_parse_blank_non_object_and_cut_lines():
    assert protocol.parse("   \n") is None
    assert protocol.parse("[1, 2]") is None
    with pytest.raises(ValueError):
        protocol.parse('{"event": "step", "st')  # the last line of a killed engine


def test_exit_codes_are_the_documented_ones():
    codes = [protocol.EXIT_OK, protocol.EXIT_GAVE_UP, protocol.EXIT_BAD_INPUT, protocol.EXIT_ABORTED,
             protocol.EXIT_NO_SPACE, protocol.EXIT_ORPHANED, protocol.EXIT_STOPPED]
    assert codes == [0, 1, 2, 3, 4, 5, 75]


def test_the_engine_emits_only_protocol_events():
    """Every emit("...") in the engine process names an event the protocol defines, and every
    protocol event is emitted somewhere (no stale names on either side)."""
    src = "".join((REPO / "andrea" / name).read_text() for name in ("run/runner.py", "cli.py"))
    emitted = set(re.findall(r'\bemit\("([a-z_]+)"', src))
    assert emitted == set(protocol.EVENTS)


def test_no_module_defines_its_own_exit_codes():
    for path in (REPO / "andrea").rglob("*.py"):
        if path.name == "protocol.py":
            continue
        src = path.read_text()
        assert not re.search(r"^\s*\w*EXIT\w*\s*=\s*\d", src, re.M), f"{path}: exit code defined outside protocol.py"
        assert "json.dumps({\"event\"" not in src, f"{path}: writes engine events without protocol.emit"
