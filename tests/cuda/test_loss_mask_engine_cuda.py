"""CUDA: the engine's loss_on=assistant steps (the chat loss mask) against the NumPy engine's, on the
GPU (skipped without one): the in-place correction of the loss gradient is queued before the
step's graphs replay, and each step takes its own number of answer targets.

    python -m pytest -m gpu tests/cuda/test_loss_mask_engine_cuda.py -q
"""
import numpy as np
import pytest

from andrea.backends import cuda_available
from test_chat_loss_mask import tiny_cfg  # the CPU test's config and shards (tests/ is on the path)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("bf16", 3e-2), ("fp16", 1e-2)])
def test_assistant_steps_match_the_numpy_engine(tmp_path, precision, tol):
    """Five steps (two microbatches each, their answer counts different every step; graphs capture
    on the second and replay after) from step 1 in a loss_on=assistant phase: the recorded losses
    are the NumPy engine's within tol, and the masked steps' losses differ from the same run's
    with every target counted (the mask reached the kernels)."""
    from andrea.config import load_run_config, to_dict
    from andrea.core.engine import Engine
    from andrea.data.loader import train_loader
    phases = [{"name": "polish", "start_step": 0, "loss_on": "assistant"}]
    base = to_dict(tiny_cfg(tmp_path, phases))
    runs = {}
    for name, backend, prec, ph in (("numpy", "numpy", "fp32", phases), ("cuda", "cuda", precision, phases),
                                    ("all", "cuda", precision, [])):
        d = {**base, "backend": {**base["backend"], "name": backend},
             "train": {**base["train"], "precision": prec, "phases": ph}}
        cfg = load_run_config(d)
        eng, loader = Engine(cfg), train_loader(load_run_config({**d, "train": {**d["train"], "phases": phases}}))
        runs[name] = [eng.train_step(s, loader.next_step(2))["loss"] for s in range(1, 6)]
    np.testing.assert_allclose(runs["cuda"], runs["numpy"], rtol=tol)
    # the mask reached the kernels: counting every target moves the losses more than the precision
    # moves them (the 16-bit runs' own distance from NumPy's); a single step may land close by chance
    # (bf16 on an H200: one step within 3x the precision's distance), so the five are taken together
    noise = max(abs(a - b) for a, b in zip(runs["cuda"], runs["numpy"]))
    assert np.mean([abs(a - b) for a, b in zip(runs["all"], runs["cuda"])]) > 3 * noise, (runs, noise)
