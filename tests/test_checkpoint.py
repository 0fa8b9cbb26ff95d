"""Checkpoint bytes, atomic layout, retention, and every bad input's clear error."""
import json

import numpy as np
import pytest

from andrea.core import checkpoint as ck
from andrea.data.shards import ShardError, read_shard, write_shard

N = 1000


def state(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=N).astype(np.float32) for _ in range(3)]


def test_checkpoint_bytes(tmp_path):
    p, m, v = state()
    path = ck.write_checkpoint(tmp_path, 42, p, m, v, {"config_hash": "abc"})
    assert path.name == "step_00000042.bin"
    raw = path.read_bytes()
    assert len(raw) == 8 + 12 * N
    assert np.frombuffer(raw[:8], "<i4").tolist() == [42, N]
    blocks = np.frombuffer(raw, "<f4", offset=8).reshape(3, N)
    for a, b in zip(blocks, (p, m, v)):
        assert np.array_equal(a, b)
    c = ck.read_checkpoint(path, N, "abc")
    assert c.step == 42 and np.array_equal(c.params, p) and np.array_equal(c.v, v)
    side = json.loads(ck.sidecar_path(path).read_text())
    assert side["n_params"] == N and len(side["sha256"]) == 64
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("mutate,match", [
    (lambda raw: raw[:-4], r"truncated"),
    (lambda raw: raw + b"\0" * 12, r"oversized"),
    (lambda raw: raw[:100], r"truncated"),
    (lambda raw: raw[:3], r"shorter than the 8-byte header"),
])
def test_bad_sizes(tmp_path, mutate, match):
    path = ck.write_checkpoint(tmp_path, 1, *state(), {})
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(ck.CheckpointError, match=match) as e:
        ck.read_checkpoint(path, N)
    assert path.name in str(e.value)


def test_n_params_mismatch(tmp_path):
    path = ck.write_checkpoint(tmp_path, 400, *state(), {})
    with pytest.raises(ck.CheckpointError, match=rf"step_00000400.bin: n_params is {N} but the model has {N + 1}"):
        ck.read_checkpoint(path, N + 1)


def test_sha_and_config_hash_mismatch(tmp_path):
    path = ck.write_checkpoint(tmp_path, 5, *state(), {"config_hash": "abc"})
    with pytest.raises(ck.CheckpointError, match="config_hash"):
        ck.read_checkpoint(path, N, "other")
    raw = bytearray(path.read_bytes())
    raw[100] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ck.CheckpointError, match="sha256"):
        ck.read_checkpoint(path, N)
    assert not ck.is_valid(path)


def test_missing_sidecar_is_not_a_checkpoint(tmp_path):
    good = ck.write_checkpoint(tmp_path / "checkpoints", 4, *state(), {})
    half = ck.write_checkpoint(tmp_path / "checkpoints", 8, *state(1), {})
    ck.sidecar_path(half).unlink()  # as if killed between the two renames
    assert ck.latest_checkpoint(tmp_path) == good
    with pytest.raises(ck.CheckpointError, match="sidecar"):
        ck.read_checkpoint(half, N)


def test_prune_keeps_last_k_and_newest_good(tmp_path):
    for s in range(1, 6):
        ck.write_checkpoint(tmp_path, s, *state(s), {})
    ck.sidecar_path(ck.bin_path(tmp_path, 5)).unlink()  # newest is incomplete
    ck.prune(tmp_path, keep_last=2)
    left = [p.name for p in ck.list_checkpoints(tmp_path)]
    assert left == ["step_00000003.bin", "step_00000004.bin", "step_00000005.bin"]
    assert ck.is_valid(ck.bin_path(tmp_path, 4))


def test_shard_errors(tmp_path):
    good = write_shard(tmp_path / "a.bin", np.arange(100))
    assert read_shard(good).tolist() == list(range(100))
    raw = bytearray(good.read_bytes())
    bad_magic = tmp_path / "magic.bin"
    bad_magic.write_bytes(b"\1\2\3\4" + bytes(raw[4:]))
    with pytest.raises(ShardError, match=r"magic.bin: magic is .* expected 20240520"):
        read_shard(bad_magic)
    short = tmp_path / "short.bin"
    short.write_bytes(bytes(raw[:-2]))
    with pytest.raises(ShardError, match=r"short.bin: header says 100 tokens"):
        read_shard(short)
    with pytest.raises(ShardError, match=r"\[0, 65535\]"):
        write_shard(tmp_path / "big.bin", [70000])


def test_loader_refuses_tokens_past_the_vocabulary(tmp_path):
    from andrea.data.loader import ShardLoader
    write_shard(tmp_path / "train_000.bin", [1, 2, 3, 99] * 50)
    with pytest.raises(ValueError, match=r"train_000.bin: token id 99 >= model.vocab_size=61"):
        ShardLoader(str(tmp_path / "train_*.bin"), 2, 8, 0, vocab_size=61)
    assert ShardLoader(str(tmp_path / "train_*.bin"), 2, 8, 0, vocab_size=100).n_windows == (200 - 1) // 8
