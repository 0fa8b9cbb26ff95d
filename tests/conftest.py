"""Shared test set-up: offline hub, small configs, random-token shards, polling with a deadline,
scripts outside the package loaded by path."""
import importlib.util
import os
import time

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def load_script(path, name: str):
    """A script outside the package (dev/, benchmarks/, scripts/) loaded by its path, as module name."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fp8_gpu() -> bool:
    """A CUDA GPU with FP8 tensor cores (compute capability 8.9 or later) and CuPy."""
    from andrea.backends import cuda_available
    if not cuda_available():
        return False
    import cupy as cp
    return int(cp.cuda.Device().compute_capability) >= 89


def small_config(tmp_path, **train):
    """An ANDREA-tiny-shaped config dict whose shards live in tmp_path (call make_shards)."""
    t = {"steps": 12, "batch_size": 2, "seq_len": 16, "lr": 3e-3, "warmup_steps": 2,
         "ckpt_every": 4, "keep_last": 2, "eval_every": 0, "sample_every": 0, "seed": 3}
    t.update(train)
    return {"exp": "t", "results_dir": str(tmp_path),
            "model": {"n_layer": 2, "d_model": 32, "n_head": 4, "context": 32, "vocab_size": 61},
            "data": {"train_shards": str(tmp_path / "shards" / "train_*.bin"),
                     "val_shards": str(tmp_path / "shards" / "val_*.bin"),
                     "tokenizer": str(tmp_path / "no-tokenizer.json")},
            "train": t, "backend": {"name": "numpy"}}


def make_shards(tmp_path, vocab=61, n_train=5000, n_val=1000, seed=0):
    from andrea.data.shards import write_shard
    rng = np.random.default_rng(seed)
    d = tmp_path / "shards"
    write_shard(d / "train_000.bin", rng.integers(0, vocab, n_train // 2))
    write_shard(d / "train_001.bin", rng.integers(0, vocab, n_train - n_train // 2))
    write_shard(d / "val_000.bin", rng.integers(0, vocab, n_val))
    return d


@pytest.fixture
def tiny_run(tmp_path):
    """(config dict, tmp_path) with shards written; tests adjust cfg["train"] before use."""
    make_shards(tmp_path)
    return small_config(tmp_path), tmp_path


def wait_for(pred, what: str, timeout: float = 60.0, proc=None):
    """Poll pred until it holds; fail naming what was awaited, or at once if proc exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
