"""A restart never truncates an existing history: when the checkpoints are gone (deleted, or a
checkpoints folder that was a symlink loop and is removed) while the records say step N, the run
says it starts over in one line and keeps the old records in previous/; a checkpoint name taken
by a directory is moved aside and named, and the save at that step succeeds."""
import os
import shutil

from relkit import make_shards, read, run_proxy, write_run

STEPS = 6


def finished_run(tmp_path):
    make_shards(tmp_path)
    run = write_run(tmp_path, steps=STEPS, ckpt_every=3)
    r = run_proxy(run)
    assert r.returncode == 0, r.stderr
    return run


def kept_aside(run, r, old_loss: bytes, old_state: dict):
    """The one line, the old records in previous/<name>/ byte for byte, a new whole history."""
    lines = [ln for ln in r.stderr.splitlines() if "starting over from step 0" in ln]
    assert len(lines) == 1, r.stderr
    assert f"state says step {STEPS}" in lines[0] and "no checkpoint found" in lines[0], lines[0]
    aside = [d for d in (run / "previous").iterdir()]
    assert len(aside) == 1 and f"previous/{aside[0].name}" in lines[0], lines[0]
    assert (aside[0] / "t.loss.json").read_bytes() == old_loss
    assert read(aside[0], "state", "t")["step"] == old_state["step"]
    assert [h["step"] for h in read(run, "loss")["history"]] == list(range(1, STEPS + 1))
    assert read(run, "state")["status"] == "finished"
    assert "Traceback" not in r.stderr


def test_deleted_checkpoints_keep_the_old_history_aside(tmp_path):
    run = finished_run(tmp_path)
    old_loss, old_state = (run / "t.loss.json").read_bytes(), read(run, "state")
    shutil.rmtree(run / "checkpoints")
    r = run_proxy(run)
    assert r.returncode == 0, r.stderr
    kept_aside(run, r, old_loss, old_state)


def test_a_checkpoints_symlink_loop_then_removed_keeps_the_old_history_aside(tmp_path):
    run = finished_run(tmp_path)
    old_loss, old_state = (run / "t.loss.json").read_bytes(), read(run, "state")
    shutil.rmtree(run / "checkpoints")
    os.symlink("checkpoints", run / "checkpoints")
    r = run_proxy(run)
    assert r.returncode == 2 and "cannot be listed" in r.stderr, r.stderr
    assert (run / "t.loss.json").read_bytes() == old_loss  # refused: the history is whole
    os.unlink(run / "checkpoints")  # what a user does next
    r = run_proxy(run)
    assert r.returncode == 0, r.stderr
    kept_aside(run, r, old_loss, old_state)


def test_a_directory_in_place_of_a_checkpoint_is_moved_aside_and_the_save_succeeds(tmp_path):
    run = finished_run(tmp_path)
    final = run / "checkpoints" / f"step_{STEPS:08d}.bin"
    good = final.read_bytes()
    final.unlink()
    final.mkdir()
    (final / "notes.txt").write_text("a user's file")
    r = run_proxy(run)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "is not a file" in r.stderr and "moved it aside" in r.stderr, r.stderr
    moved = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(final.name + ".obstacle-")]
    assert len(moved) == 1 and moved[0].name in r.stderr, r.stderr
    assert (moved[0] / "notes.txt").read_text() == "a user's file"  # moved, not deleted
    assert final.read_bytes() == good  # resumed from step 3 and saved step 6 again, bit-exact
    assert [h["step"] for h in read(run, "loss")["history"]] == list(range(1, STEPS + 1))
    assert read(run, "state")["status"] == "finished" and not (run / "previous").exists()


def test_a_start_over_gives_the_trackers_a_new_run_and_keeps_the_old_one_aside(tmp_path):
    """proxy.trackers=[tensorboard]: the old history's event files move to previous/ with it, and
    the new history's steps 1..N reach a new tracker run (before, the trackers skipped every step up
    to the old history's last, so a finished run's start-over sent them nothing)."""
    import pytest
    from omegaconf import OmegaConf

    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    make_shards(tmp_path)
    run = write_run(tmp_path, steps=STEPS, ckpt_every=3)
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.proxy = {"trackers": ["tensorboard"]}
    OmegaConf.save(cfg, run / "config.yaml")
    assert run_proxy(run).returncode == 0
    shutil.rmtree(run / "checkpoints")
    r = run_proxy(run)
    assert r.returncode == 0 and "starting over from step 0" in r.stderr, r.stderr

    def steps(folder):
        ea = ea_mod.EventAccumulator(str(folder))
        ea.Reload()
        return sorted({e.step for tag in ea.Tags()["scalars"] for e in ea.Scalars(tag)})
    (old,) = (run / "previous").iterdir()
    assert steps(old / "trackers" / "tensorboard") == list(range(1, STEPS + 1))
    assert steps(run / "trackers" / "tensorboard") == list(range(1, STEPS + 1))
