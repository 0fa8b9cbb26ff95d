"""The model-using commands (export, import, generate, chat) on bad or damaged input: `export --out`
never deletes what export did not write and leaves nothing temporary behind; a bad config or
tokenizer is one line naming the file and what was expected (exit 2); a damaged newest checkpoint
is named with its reason on stderr before an older one is used."""
import json
import os
import shutil

import numpy as np
import pytest

from andrea import cli
from andrea.core import checkpoint as ck
from andrea.run.protocol import EXIT_BAD_INPUT, EXIT_NO_SPACE
from relkit import snapshot
from trained_model import make_run

pytest.importorskip("safetensors")

HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
            "tokenizer.json", "tokenizer_config.json", "andrea-export.json"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("model"), steps=10)


def main(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def leftovers(folder):
    """Hidden temporary names export might leave beside its target."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith((".tmp", ".old")))


# --- 1. export --out ------------------------------------------------------------------------------

def test_export_over_the_run_itself_is_refused_and_deletes_nothing(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "notes.txt").write_text("my notes")
    before = snapshot(copy)
    rc, _, err = main(capsys, "export", copy, "--format", "safetensors", "--out", copy)
    line = one_line(err)
    assert rc == EXIT_BAD_INPUT and str(copy) in line and "not an earlier export" in line
    assert snapshot(copy) == before  # checkpoints, config, notes: all still there, unchanged
    assert leftovers(tmp_path) == []


def test_export_into_a_folder_of_user_files_is_refused(run, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    before = snapshot(notes)
    rc, _, err = main(capsys, "export", run, "--format", "hf", "--out", notes)
    assert rc == EXIT_BAD_INPUT and str(notes) in one_line(err)
    assert snapshot(notes) == before and leftovers(tmp_path) == []


def test_export_onto_an_existing_file_is_refused_without_leftovers(run, tmp_path, capsys):
    f = tmp_path / "model"
    f.write_text("not a folder")
    rc, _, err = main(capsys, "export", run, "--format", "safetensors", "--out", f)
    line = one_line(err)
    assert rc == EXIT_BAD_INPUT and str(f) in line and "existing file" in line
    assert f.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_export_replaces_its_own_earlier_export(run, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(capsys, "export", run, "--format", "safetensors", "--out", out)[0] == 0
    manifest = json.loads((out / "andrea-export.json").read_text())
    assert manifest["files"] == ["model.safetensors", "tokenizer.json"] and manifest["format"] == "safetensors"
    first = (out / "model.safetensors").read_bytes()
    assert main(capsys, "export", run, "--format", "hf", "--out", out)[0] == 0
    assert {p.name for p in out.iterdir()} == HF_FILES  # the earlier export replaced as a whole
    assert (out / "model.safetensors").read_bytes() != first
    assert json.loads((out / "andrea-export.json").read_text())["format"] == "hf"
    assert leftovers(tmp_path) == []
    # a file the user put in the export folder makes it no longer only the export's: refused, kept
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    rc, _, err = main(capsys, "export", run, "--format", "hf", "--out", out)
    assert rc == EXIT_BAD_INPUT and "did not write" in one_line(err)
    assert snapshot(out) == before


@pytest.mark.parametrize("exchange", [True, False], ids=["one rename", "moved aside"])
def test_reexport_replaces_in_place_either_way(run, tmp_path, capsys, monkeypatch, exchange):
    """Where the system has no exchanging rename, the earlier export is moved aside, then removed."""
    from andrea.util import atomic
    out = tmp_path / "out"
    assert main(capsys, "export", run, "--format", "hf", "--out", out)[0] == 0
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    assert main(capsys, "export", run, "--format", "safetensors", "--out", out)[0] == 0
    assert {p.name for p in out.iterdir()} == {"andrea-export.json", "model.safetensors", "tokenizer.json"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_export_into_an_empty_folder(run, tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(capsys, "export", run, "--format", "hf", "--out", out)[0] == 0
    assert {p.name for p in out.iterdir()} == HF_FILES and leftovers(tmp_path) == []


def _failing_write(monkeypatch, exc):
    """export's file writes fail at the second file, as a full or read-only disk would."""
    from andrea.use import export as export_mod
    real, calls = export_mod.atomic_write, []

    def write(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise exc(path)
        return real(path, data)

    monkeypatch.setattr(export_mod, "atomic_write", write)
    return calls


def test_failed_export_names_the_target_and_leaves_nothing(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "a" / "b" / "out"
    calls = _failing_write(monkeypatch, lambda p: PermissionError(13, "Permission denied", str(p)))
    rc, _, err = main(capsys, "export", run, "--format", "hf", "--out", out)
    line = one_line(err)
    assert len(calls) == 2 and rc == EXIT_BAD_INPUT
    assert str(out) in line and "Permission denied" in line and ".tmp" not in line, line
    assert list(tmp_path.iterdir()) == []  # not the temporary folder, not the parents it made


def test_failed_reexport_keeps_the_earlier_export(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(capsys, "export", run, "--format", "safetensors", "--out", out)[0] == 0
    before = snapshot(out)
    from andrea.util.atomic import NoSpace
    _failing_write(monkeypatch, lambda p: NoSpace(p, 1000, 10))
    rc, _, err = main(capsys, "export", run, "--format", "hf", "--out", out)
    line = one_line(err)
    assert rc == EXIT_NO_SPACE and str(out) in line and ".tmp" not in line, line
    assert snapshot(out) == before and leftovers(tmp_path) == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_export_into_a_read_only_folder_names_the_target(run, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc, _, err = main(capsys, "export", run, "--format", "hf", "--out", ro / "out")
    finally:
        ro.chmod(0o755)
    line = one_line(err)
    assert rc == EXIT_BAD_INPUT and str(ro / "out") in line and ".tmp" not in line
    assert list(ro.iterdir()) == []


# --- 5. bad config and tokenizer --------------------------------------------------------------------

BAD_CONFIGS = {"parse error": ": : [garbage\n", "scanner error": "a: 'unterminated\n", "a list": "- 1\n- 2\n",
               "unknown key": "foo: 1\n", "wrong type": "model:\n  n_layer: abc\n",
               "binary": b"\xff\xfe\x00\x01garbage", "empty": "", "out of range": "train:\n  lr: -1\n"}


def _write(path, data):
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


@pytest.mark.parametrize("kind", sorted(BAD_CONFIGS))
def test_import_with_a_bad_config_is_one_line(run, tmp_path, capsys, kind):
    src = tmp_path / "st"
    assert main(capsys, "export", run, "--format", "safetensors", "--out", src)[0] == 0
    bad = _write(tmp_path / "bad.yaml", BAD_CONFIGS[kind])
    rc, _, err = main(capsys, "import", src / "model.safetensors", "--config", bad)
    line = one_line(err)
    assert rc == EXIT_BAD_INPUT and str(bad) in line and "expected" in line, line


def test_import_with_a_folder_as_config(run, tmp_path, capsys):
    rc, _, err = main(capsys, "import", tmp_path / "x.safetensors", "--config", tmp_path)
    line = one_line(err)
    assert rc == EXIT_BAD_INPUT and str(tmp_path) in line and "folder" in line and "no such file" not in line


@pytest.mark.parametrize("kind", ["parse error", "unknown key", "wrong type", "binary"])
def test_generate_on_a_run_with_a_bad_config_is_one_line(run, tmp_path, capsys, kind):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    _write(copy / "config.yaml", BAD_CONFIGS[kind])
    rc, out, err = main(capsys, "generate", copy, "--prompt", "hi", "--max-tokens", 2)
    line = one_line(err)
    assert rc == EXIT_BAD_INPUT and out == "" and str(copy / "config.yaml") in line and "expected" in line, line


def test_tokenizer_folder(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = main(capsys, "generate", run, "--prompt", "hi", "--tokenizer", empty)
    line = one_line(err)
    assert rc == EXIT_BAD_INPUT and str(empty) in line and "folder" in line and "no such file" not in line, line
    # a folder holding tokenizer.json (an export, an archive) is read as that file
    held = tmp_path / "held"
    held.mkdir()
    shutil.copy(run / "tokenizer.json", held / "tokenizer.json")
    rc_dir, out_dir, _ = main(capsys, "generate", run, "--prompt", "hi", "--temperature", 0, "--max-tokens", 4,
                              "--tokenizer", held)
    rc_file, out_file, _ = main(capsys, "generate", run, "--prompt", "hi", "--temperature", 0, "--max-tokens", 4,
                                "--tokenizer", held / "tokenizer.json")
    assert rc_dir == rc_file == 0 and out_dir == out_file
    garbage = _write(tmp_path / "garbage.json", "{not json\n")
    rc, _, err = main(capsys, "generate", run, "--prompt", "hi", "--tokenizer", garbage)
    assert rc == EXIT_BAD_INPUT and str(garbage) in one_line(err)


# --- 6. a damaged newest checkpoint -----------------------------------------------------------------

def _truncate(b):
    b.write_bytes(b.read_bytes()[: b.stat().st_size // 2])


def _flip(b):
    raw = bytearray(b.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    b.write_bytes(bytes(raw))


def _no_sidecar(b):
    ck.sidecar_path(b).unlink()


DAMAGE = {"truncated": (_truncate, "truncated"), "flipped byte": (_flip, "sha256"),
          "missing sidecar": (_no_sidecar, "missing")}


def run_with_newer(run, tmp_path):
    """A copy of run with a second checkpoint, step 20, of other weights: (copy, step 10, step 20)."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    old = ck.list_checkpoints(copy / "checkpoints")[-1]
    raw = np.fromfile(old, dtype="<f4", offset=8)
    n = raw.size // 3
    side = json.loads(ck.sidecar_path(old).read_text())
    new = ck.write_checkpoint(copy / "checkpoints", 20, raw[:n] * 0.5, raw[n:2 * n], raw[2 * n:],
                              {"config_hash": side["config_hash"]})
    return copy, old, new


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_generate_names_the_damaged_checkpoint_it_skips(run, tmp_path, capsys, kind):
    copy, old, new = run_with_newer(run, tmp_path)
    damage, reason = DAMAGE[kind]
    damage(new)
    rc, out, err = main(capsys, "generate", copy, "--prompt", "hi", "--temperature", 0, "--max-tokens", 4)
    line = one_line(err)
    assert rc == 0 and "skipping checkpoint" in line and new.name in line and reason in line, line
    assert old.name in line  # and which one it answers from
    rc, want, _ = main(capsys, "generate", old, "--prompt", "hi", "--temperature", 0, "--max-tokens", 4)
    assert rc == 0 and out == want


def test_export_and_chat_name_the_damaged_checkpoint(run, tmp_path, capsys, monkeypatch):
    copy, old, new = run_with_newer(run, tmp_path)
    _flip(new)
    rc, _, err = main(capsys, "export", copy, "--format", "safetensors", "--out", tmp_path / "st")
    assert rc == 0 and sum("skipping checkpoint" in ln and new.name in ln for ln in err.splitlines()) == 1, err
    assert json.loads((tmp_path / "st" / "andrea-export.json").read_text())["checkpoint"] == old.name
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # end of input: the REPL ends at once
    rc, _, err = main(capsys, "chat", copy)
    line = one_line(err)
    assert rc == 0 and line.startswith("andrea chat: skipping checkpoint") and "sha256" in line, line


def test_no_valid_checkpoint_names_each_and_why(run, tmp_path, capsys):
    copy, old, new = run_with_newer(run, tmp_path)
    _truncate(new)
    _no_sidecar(old)
    rc, out, err = main(capsys, "generate", copy, "--prompt", "hi")
    line = one_line(err)
    assert rc == EXIT_BAD_INPUT and out == ""
    assert "none is valid" in line and new.name in line and "truncated" in line and old.name in line, line
