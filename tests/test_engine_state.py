"""Engine state and the one checkpoint load path; training and the report validate on the same
windows and give the same loss for the same checkpoint."""
import json
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from andrea.core import checkpoint as ck
from andrea.config import config_hash, load_run_config
from andrea.data.loader import val_windows
from andrea.core.engine import Engine
from andrea.pipeline.evaluate import held_out_loss


def batch(rng, B=2, T=16, V=61):
    x = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    return x[:, :-1], x[:, 1:]


def test_state_round_trip_continues_bit_exactly(tiny_run):
    cfg = load_run_config(tiny_run[0])
    rng = np.random.default_rng(0)
    a = Engine(cfg)
    for s in range(1, 4):
        a.train_step(s, [batch(rng)])
    a.skipped, a.bad_streak, a.good_streak, a.loss_scale = 2, 1, 5, 8.0  # counters travel too
    st = a.state()
    b = Engine(cfg)
    assert b.params.tobytes() != a.params.tobytes()
    b.load_state(st)
    assert (b.loss_scale, b.good_streak, b.bad_streak, b.skipped) == (8.0, 5, 1, 2)
    x = batch(rng)
    ra, rb = a.train_step(4, [x]), b.train_step(4, [x])
    assert ra == rb
    for name in ("params", "m", "v"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
    st.params[:] = 0  # the state is a copy: changing it leaves the engine alone
    assert np.any(a.params != 0)


def test_load_checkpoint_refuses_another_config(tiny_run):
    cfg_dict, tmp = tiny_run
    cfg = load_run_config(cfg_dict)
    eng = Engine(cfg)
    st = eng.state()
    path = ck.write_checkpoint(tmp / "ckpt", 3, st.params, st.m, st.v,
                               {"config_hash": config_hash(cfg),
                                "data": {}, **st.counters()})
    assert Engine(cfg).load_checkpoint(path, config_hash(cfg)).step == 3
    other = load_run_config(dict(cfg_dict, train=dict(cfg_dict["train"], lr=1e-4)))
    with pytest.raises(ck.CheckpointError, match="config_hash"):
        Engine(other).load_checkpoint(path, config_hash(other))


def test_val_windows_stop_at_the_asked_number_across_shards(tmp_path):
    from andrea.data.shards import write_shard
    d = tmp_path / "s"
    write_shard(d / "val_000.bin", np.arange(100))  # 12 windows of 9 tokens, starting every 8
    write_shard(d / "val_001.bin", np.arange(100, 200))
    got = val_windows(str(d / "val_*.bin"), B=2, T=8, n_batches=3)  # all from the first shard
    assert len(got) == 3 and [int(x[1, 0]) for x, _ in got] == [8, 24, 40]
    got = val_windows(str(d / "val_*.bin"), B=2, T=8, n_batches=7)  # the 7th batch is the second shard's
    assert len(got) == 7 and got[5][0][:, 0].tolist() == [80, 88] and got[6][0][:, 0].tolist() == [100, 108]
    assert np.array_equal(got[6][1], got[6][0] + 1)  # y is x shifted by one token
    assert len(val_windows(str(d / "val_*.bin"), B=2, T=8, n_batches=100)) == 12  # 24 windows
    with pytest.raises(ValueError, match="vocab_size=50"):
        val_windows(str(d / "val_*.bin"), B=2, T=8, n_batches=1, vocab_size=50)


class _Bytes:
    """The tokenizer's only part the held-out loss reads: bytes per token id."""

    def token_bytes(self, V):
        return np.ones(V, dtype=np.int64)


def test_training_and_report_validate_alike(tiny_run):
    """The engine process's val event and the report's held-out loss of the final checkpoint."""
    cfg_dict, tmp = tiny_run
    steps = 6
    cfg_dict["train"].update(steps=steps, eval_every=steps, eval_batches=3, ckpt_every=0)
    cfg_dict["eval"] = {"batches": 3}
    run = tmp / "run"
    run.mkdir()
    OmegaConf.save(OmegaConf.create(cfg_dict), run / "config.yaml")
    r = subprocess.run([sys.executable, "-m", "andrea.cli", "engine", "--config", str(run / "config.yaml"),
                        "--run-dir", str(run)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    vals = [json.loads(line) for line in r.stdout.splitlines() if '"val"' in line]
    assert [v["step"] for v in vals] == [steps]
    cfg = load_run_config(run / "config.yaml")
    eng = Engine(cfg)
    eng.load_checkpoint(ck.bin_path(run / "checkpoints", steps), config_hash(cfg))
    report = held_out_loss(eng, _Bytes(), cfg)
    assert report["val_batches"] == 3
    assert report["val_loss"] == vals[0]["val_loss"]
