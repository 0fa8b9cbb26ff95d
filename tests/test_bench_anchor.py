"""benchmarks/torch_gpt.py, the PyTorch anchor: ANDREA's architecture exactly, and it runs and reports;
python -m andrea.bench without a GPU says so in one line."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea.model import count_params
from andrea.train import compose_config

torch = pytest.importorskip("torch")
from test_model_torch import general_position_step  # noqa: E402  (needs torch)
REPO = Path(__file__).resolve().parent.parent
ANCHOR = REPO / "benchmarks" / "torch_gpt.py"


def anchor():
    spec = importlib.util.spec_from_file_location("torch_gpt", ANCHOR)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("exp, shape", [("ANDREA-tiny", "tiny"), ("ANDREA-12M", "12m"), ("ANDREA-120M", "120m")])
def test_anchor_has_andreas_shapes_and_parameter_count(exp, shape):
    m, tg = compose_config(exp).model, anchor()
    assert tg.SHAPES[shape] == (m.n_layer, m.d_model, m.n_head, m.context, m.vocab_size)
    with torch.device("meta"):
        model = tg.GPT(*tg.SHAPES[shape])
    assert sum(p.numel() for p in model.parameters()) == count_params(m)


def test_anchor_computes_andreas_loss_and_gradients():
    """ANDREA's weights loaded into the anchor give the NumPy engine's loss and gradients (float64)."""
    _, eng, host, tokens, targets, loss = general_position_step("float64", seed=1)
    ours = eng.layout.views(eng.be.to_numpy(eng.grads))
    w = eng.layout.views(host)
    model = anchor().GPT(2, 24, 3, 16, 37).double()
    where = {"wte": model.wte.weight, "wpe": model.wpe.weight, "lnf_w": model.lnf.weight, "lnf_b": model.lnf.bias}
    for l, b in enumerate(model.blocks):
        where.update({f"h{l}.qkv_w": b.qkv.weight, f"h{l}.qkv_b": b.qkv.bias, f"h{l}.attn_out_w": b.proj.weight,
                      f"h{l}.attn_out_b": b.proj.bias, f"h{l}.mlp_w1": b.up.weight, f"h{l}.mlp_b1": b.up.bias,
                      f"h{l}.mlp_w2": b.down.weight, f"h{l}.mlp_b2": b.down.bias, f"h{l}.ln1_w": b.ln1.weight,
                      f"h{l}.ln1_b": b.ln1.bias, f"h{l}.ln2_w": b.ln2.weight, f"h{l}.ln2_b": b.ln2.bias})
    assert set(where) == set(w)  # every ANDREA parameter has its place in the anchor, and no more
    with torch.no_grad():
        for name, p in where.items():
            p.copy_(torch.from_numpy(np.array(w[name])))
    ref = model(torch.from_numpy(tokens).long(), torch.from_numpy(targets).long())
    ref.backward()
    assert abs(loss - ref.item()) / abs(ref.item()) < 1e-9, (loss, ref.item())
    for name, p in where.items():
        g = p.grad.numpy()
        assert np.linalg.norm(ours[name] - g) / np.linalg.norm(g) < 1e-9, name


def test_anchor_runs_and_prints_json():
    r = subprocess.run([sys.executable, str(ANCHOR), "--shape", "tiny", "--dtype", "float32", "--batch", "2",
                        "--seq", "16", "--steps", "2", "--warmup", "1", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["n_params"] == count_params(compose_config("ANDREA-tiny").model) and rec["T"] == 16
    assert rec["tok_s"] > 0 and rec["ms_step"] > 0 and rec["tflops"] > 0 and rec["loss"] > 0


def test_bench_without_gpu_is_one_line():
    from andrea.backends import cuda_available
    if cuda_available():
        pytest.skip("a GPU is here")
    r = subprocess.run([sys.executable, "-m", "andrea.bench", "--anchor"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert "needs a CUDA GPU" in r.stderr


def test_bench_table_ratio_is_ours_over_theirs():
    from andrea.bench import table
    ours = dict(precision="fp16", attention="fused", tok_s=300_000, ms_step=20.0, tflops=100.0, planned_gb=1.0,
                plan_arena_gb=0.9, pool_used_gb=1.0, device_used_gb=1.1)
    anchors = [dict(dtype="bf16", anchor_mode="eager", tok_s=600_000, ms_step=10.0, tflops=200.0),
               dict(dtype="bf16", anchor_mode="reduce-overhead", tok_s=200_000, ms_step=30.0, tflops=66.7)]
    lines = table(ours, anchors).splitlines()
    assert lines[0].split() == ["tok/s", "ms/step", "TFLOP/s", "ratio"]
    assert lines[1].split()[-4:] == ["300,000", "20.00", "100.0", "1.00"]
    assert lines[2].startswith("pytorch bf16 eager") and lines[2].split()[-1] == "0.50"
    assert lines[3].split()[-1] == "1.50" and lines[4].startswith("memory: planned 1.0 GB")


def test_bench_settings_parse_and_refuse():
    """--set ATTR=INT: parsed to a dict; anything else, or an attribute the backend lacks, is an
    error naming it."""
    import pytest

    from andrea.bench import apply_settings, parse_settings
    assert parse_settings(["ln_blocks=528", " loss_vectors = 16"]) == {"ln_blocks": 528, "loss_vectors": 16}
    for bad in ("ln_blocks", "ln_blocks=x", "=3"):
        with pytest.raises(SystemExit, match="expected ATTR=INT"):
            parse_settings([bad])

    class Be:
        ln_blocks = 264
    be = Be()
    apply_settings(be, {"ln_blocks": 528})
    assert be.ln_blocks == 528 and isinstance(be.ln_blocks, int)
    with pytest.raises(SystemExit, match="no attribute nope"):
        apply_settings(be, {"nope": 1})


def test_pass_closed_by_hands_the_close_over():
    """The bench's and the profiler's wrappers of param_grad_pass: start reaches the backend, the
    close runs inside the closer (where it is timed or annotated), an exception closes it at once."""
    import contextlib

    import pytest

    from andrea.bench import pass_closed_by
    log = []

    class Be:
        @contextlib.contextmanager
        def param_grad_pass(self, start=None):
            log.append(("open", start))
            try:
                yield
            finally:
                log.append("close")

    def closer(close):
        log.append("closer")
        close()
    with pass_closed_by(Be(), "grads", closer):
        log.append("body")
    assert log == [("open", "grads"), "body", "closer", "close"]
    log.clear()
    with pytest.raises(ValueError):
        with pass_closed_by(Be(), None, closer):
            raise ValueError("in the pass")
    assert log == [("open", None), "close"]
