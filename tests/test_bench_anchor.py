"""benchmarks/torch_gpt.py, the PyTorch anchor: ANDREA's architecture exactly, and it runs and reports;
python -m andrea.bench without a GPU says so in one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea.core.model import count_params
from andrea.train import compose_config
from conftest import load_script

torch = pytest.importorskip("torch")
from test_model_torch import general_position_step  # noqa: E402  (needs torch)
REPO = Path(__file__).resolve().parent.parent
ANCHOR = REPO / "benchmarks" / "torch_gpt.py"


def anchor():
    return load_script(ANCHOR, "torch_gpt")


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
    r = subprocess.run([sys.executable, "-m", "andrea.bench.step", "--anchor"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert "needs a CUDA GPU" in r.stderr


def test_bench_table_ratio_is_ours_over_theirs():
    from andrea.bench.step import table
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
    """--set NAME=VALUE: parsed to a dict (ints where they parse); split into the CUDA backend's
    constructor options (a Tuning with the geometry fields, pdl, graph_edits) and the run's FP8 settings;
    anything else, or a value its field does not take, is an error naming it."""
    import pytest

    from andrea.backends.cuda.tuning import Tuning
    from andrea.bench.step import backend_settings, parse_settings
    assert parse_settings(["ln_blocks=528", " loss_vectors = 16", "fp8_dlogits_rounding=nearest"]) == {
        "ln_blocks": 528, "loss_vectors": 16, "fp8_dlogits_rounding": "nearest"}
    for bad in ("ln_blocks", "ln_blocks=", "=3"):
        with pytest.raises(SystemExit, match="expected ATTR=VALUE"):
            parse_settings([bad])
    options, run = backend_settings({"ln_blocks": 528, "loss_prefetch": 0, "fp8_dlogits_rounding": "nearest",
                                     "pdl": 0, "graph_edits": "1"})
    assert options == {"tuning": Tuning(ln_blocks=528, loss_prefetch=False), "pdl": False, "graph_edits": True}
    assert run == {"fp8_dlogits_rounding": "nearest"}
    assert backend_settings({}) == ({"tuning": Tuning()}, {})
    with pytest.raises(SystemExit, match="nope: not a setting of the CUDA backend"):
        backend_settings({"nope": 1})
    with pytest.raises(SystemExit, match="fp8_keep_xt: not a setting"):  # a winner hard-wired: no switch left
        backend_settings({"fp8_keep_xt": 0})
    with pytest.raises(SystemExit, match="ln_blocks='x': expected an integer"):
        backend_settings({"ln_blocks": "x"})
    with pytest.raises(SystemExit, match="fp8_tile_rows = 96"):
        backend_settings({"fp8_tile_rows": 96})
    with pytest.raises(SystemExit, match="pdl=2: expected 0 or 1"):
        backend_settings({"pdl": 2})
    with pytest.raises(SystemExit, match="graph_edits=on: expected 0 or 1"):
        backend_settings({"graph_edits": "on"})


def test_tuning_is_frozen_and_checked():
    """Tuning: a frozen dataclass; with_settings returns a copy, values from a command line's text."""
    import dataclasses

    import pytest

    from andrea.backends.cuda.tuning import Tuning
    t = Tuning()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.ln_blocks = 3
    u = t.with_settings({"hopper_attention": "0", "fp8_layernorm_warps": "8", "loss_blocks": 7})
    assert (u.hopper_attention, u.fp8_layernorm_warps, u.loss_blocks) == (False, 8, 7) and t == Tuning()
    for bad in ({"fp8_layernorm_rows": 12}, {"loss_blocks": -1}, {"hopper_attention": "maybe"}, {"x": 1}):
        with pytest.raises(ValueError):
            t.with_settings(bad)


def test_pass_closed_by_hands_the_close_over():
    """The bench's and the profiler's wrappers of param_grad_pass: start reaches the backend, the
    close runs inside the closer (where it is timed or annotated), an exception closes it at once."""
    import contextlib

    import pytest

    from andrea.bench.step import pass_closed_by
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


def test_fp8_layer_filter_takes_the_four_linear_layers_of_each_block():
    """--fp8 converts qkv, proj, up and down of every block and nothing else: the output projection
    (tied to wte) stays 16-bit, as in ANDREA's fp8 path."""
    tg = anchor()
    with torch.device("meta"):
        model = tg.GPT(*tg.SHAPES["12m"])
    chosen = [name for name, m in model.named_modules() if tg.fp8_layer(m, name)]
    assert chosen == [f"blocks.{l}.{k}" for l in range(6) for k in ("qkv", "proj", "up", "down")]
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linear == chosen  # the output projection is no torch.nn.Linear: nothing else to leave out
    lm_head = torch.nn.Linear(8, 16)
    assert not tg.fp8_layer(lm_head, "lm_head") and not tg.fp8_layer(lm_head, "blocks.0.head")
    assert not tg.fp8_layer(torch.nn.LayerNorm(8), "blocks.0.up")  # a name alone is not enough
    assert not tg.fp8_layer(lm_head, "blocks.x.qkv") and not tg.fp8_layer(lm_head, "blocks.0.qkv.inner")


def _fake_torchao(monkeypatch):
    import types
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", types.ModuleType("torchao.float8"))


def test_fp8_problems_name_the_flag_and_what_is_missing(monkeypatch):
    tg = anchor()
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert tg.fp8_problem(None, "float16", cpu) is None  # no --fp8: nothing to check
    assert tg.fp8_problem("torchao", "float16", gpu) == (
        "--fp8 torchao needs --dtype bfloat16 (autocast around the FP8 products), not float16")
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    msg = tg.fp8_problem("torchao", "bfloat16", gpu)
    assert msg.startswith("--fp8 torchao: torchao's float8 training does not import (ModuleNotFoundError") and \
        msg.endswith("pip install torchao")
    import builtins
    real_import = builtins.__import__

    def broken(name, *args, **kw):  # a torchao built for another torch: any error, on one line
        if name.startswith("torchao"):
            raise OSError("undefined symbol: _ZN3c10\nin _C.so")
        return real_import(name, *args, **kw)
    with monkeypatch.context() as m:
        m.setattr(builtins, "__import__", broken)
        msg = tg.fp8_problem("torchao", "bfloat16", gpu)
    assert "does not import (OSError: undefined symbol: _ZN3c10 in _C.so); pip install torchao" in msg
    _fake_torchao(monkeypatch)
    assert tg.fp8_problem("torchao", "bfloat16", cpu) == (
        "--fp8 torchao needs a CUDA GPU of compute capability 8.9 or newer (FP8 tensor cores); device cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    assert tg.fp8_problem("torchao", "bfloat16", gpu).endswith("(FP8 tensor cores); NVIDIA A100 is sm_80")
    for cap in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None, cap=cap: cap)
        assert tg.fp8_problem("torchao", "bfloat16", gpu) is None, cap


def test_anchor_fp8_errors_are_one_line_and_exit_2(monkeypatch, capsys):
    tg = anchor()
    base = ["--shape", "tiny", "--fp8", "torchao", "--device", "cpu", "--steps", "1", "--warmup", "0"]
    assert tg.main(base + ["--dtype", "float32"]) == 2
    assert capsys.readouterr().err == "torch_gpt: --fp8 torchao needs --dtype bfloat16 (autocast around the " \
                                      "FP8 products), not float32\n"
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert tg.main(base + ["--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torch_gpt: --fp8 torchao: torchao's float8 training does not import") and \
        err.count("\n") == 1
    with pytest.raises(SystemExit):
        tg.main(["--fp8", "te"])  # torchao is the only choice
    assert "invalid choice: 'te'" in capsys.readouterr().err


def test_to_float8_swaps_exactly_the_chosen_layers():
    """torchao's float8 training on the CPU (its emulated products): the four layers of each block
    become Float8Linear with the same parameters, and the loss stays near the bf16 model's."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (the FP8 anchor's GPU runs carry it)")
    from torchao.float8.float8_linear import Float8Linear
    tg = anchor()
    torch.manual_seed(0)
    ref = tg.GPT(*tg.SHAPES["tiny"])
    model = tg.GPT(*tg.SHAPES["tiny"])
    model.load_state_dict(ref.state_dict())
    params = {name: p for name, p in model.named_parameters()}
    label = tg.to_float8(model, emulate=True)
    assert label.startswith("torchao ") and label.endswith(" tensorwise") and len(label.split()) == 3
    swapped = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert swapped == [f"blocks.{l}.{k}" for l in range(2) for k in ("qkv", "proj", "up", "down")]
    assert {name: p for name, p in model.named_parameters()} == params  # the same tensors, nothing new
    assert type(model.wte) is torch.nn.Embedding and type(model.lnf) is torch.nn.LayerNorm
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, ref_loss = model(x, y), ref(x, y)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 0.02 * ref_loss.item(), (loss.item(), ref_loss.item())
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in model.blocks[0].qkv.parameters())


def _fake_anchor_run(calls):
    """subprocess.run for run_anchor: records the command, answers as torch_gpt.py would."""
    def run(cmd, capture_output, text):
        calls.append(cmd[2:])
        fp8 = "torchao 9.9.9 tensorwise" if "--fp8" in cmd else None
        dtype = cmd[cmd.index("--dtype") + 1]
        rec = dict(dtype=dtype, fp8=fp8, tok_s=400_000 if fp8 else 200_000, ms_step=10.0, tflops=100.0)
        return subprocess.CompletedProcess(cmd, 0, stdout="progress\n" + json.dumps(rec) + "\n", stderr="")
    return run


def test_bench_anchor_precisions_run_the_anchor_once_each(monkeypatch, capsys):
    """python -m andrea.bench --precision fp8 --anchor ...: the bf16 anchor by default; with
    --anchor-precision bf16,fp8 the anchor once in bf16 and once with torchao's FP8, a ratio each."""
    import andrea.backends
    import andrea.bench.step as bench
    calls = []
    monkeypatch.setattr(andrea.backends, "cuda_available", lambda: True)
    monkeypatch.setattr(bench.subprocess, "run", _fake_anchor_run(calls))
    ours = dict(precision="fp8", attention="fused", tok_s=300_000, ms_step=20.0, tflops=100.0, planned_gb=1.0,
                plan_arena_gb=0.9, pool_used_gb=1.0, device_used_gb=1.1, per_kernel_ms={"k_matmul": 1.0})
    monkeypatch.setattr(bench, "run_engine", lambda *args: dict(ours))
    argv = ["--exp", "ANDREA-12M", "--precision", "fp8", "--batch", "4", "--steps", "7", "--anchor", str(ANCHOR),
            "--anchor-modes", "reduce-overhead"]
    tail = ["--compile", "1", "--mode", "reduce-overhead", "--steps", "7"]
    head = ["--shape", "12m", "--batch", "4", "--dtype", "bfloat16"]
    assert bench.main(argv) == 0
    assert calls == [head + tail]  # fp8 alone: the 16-bit anchor, as before
    capsys.readouterr()
    calls.clear()
    assert bench.main(argv + ["--anchor-precision", "bf16,fp8", "--anchor-modes", "eager,reduce-overhead"]) == 0
    eager = ["--compile", "0", "--mode", "default", "--steps", "7"]
    assert calls == [head + eager, head + tail, head + ["--fp8", "torchao"] + eager,
                     head + ["--fp8", "torchao"] + tail]
    rows = capsys.readouterr().out.splitlines()[-6:-1]
    assert rows[0].startswith("andrea fp8 attn fused") and rows[0].split()[-1] == "1.00"
    assert rows[1].startswith("pytorch bfloat16 eager") and rows[1].split()[-1] == "1.50"
    assert rows[3].startswith("pytorch float8 via torchao 9.9.9 tensorwise eager") and rows[3].split()[-1] == "0.75"
    assert rows[4].startswith("pytorch float8 via torchao 9.9.9 tensorwise reduce-overhead")


def test_bench_anchor_precision_refuses_unknown_names(capsys):
    from andrea.bench.step import anchor_precisions, main
    assert anchor_precisions("bf16, fp8") == ["bf16", "fp8"] and anchor_precisions("fp16") == ["fp16"]
    for bad in ("bf16,fp9", "", ","):
        with pytest.raises(SystemExit) as e:
            main(["--anchor-precision", bad])
        assert e.value.code == 2
        assert f"argument --anchor-precision: {bad!r}: expected a comma list of fp32, fp16, bf16, fp8" in \
            capsys.readouterr().err


def test_spy_graphs_keeps_the_last_key_of_each_kind():
    """dev/ab_settings.py --replay and dev/graph_probe.py find a step's graphs by the keys its last
    step ran: spy_graphs records them by kind (the key's first item) and still runs every call."""
    from andrea.bench.step import spy_graphs

    class Eng:
        def __init__(self):
            self.calls = []

        def _run(self, key, fn):
            self.calls.append(key)
            fn()

    eng, ran = Eng(), []
    used = spy_graphs(eng)
    for key in (("passes", True, True, False), ("optimizer", 1), ("passes", True, True, True)):
        eng._run(key, lambda: ran.append(1))
    assert used == {"passes": ("passes", True, True, True), "optimizer": ("optimizer", 1)}
    assert len(eng.calls) == 3 and len(ran) == 3


def test_warmed_engine_steps_on_and_finds_the_last_graphs(monkeypatch):
    """warmed_engine, the dev tools' common start: warmup train steps taken (step numbers 1..), step()
    the next one on the next batch, graphs() the graphs the last step ran by kind (here on the CPU,
    a runner that keeps a label per key stands in for CUDA graphs)."""
    import andrea.bench.step as bench
    from andrea.backends.numpy_backend import NumpyBackend

    class Runner:
        def __init__(self):
            self.graphs = {}

        def run(self, key, fn):
            fn()
            self.graphs[key] = (f"{key[0]} {len(self.graphs)}", 0)

        def clear(self):
            self.graphs.clear()

    class Backend(NumpyBackend):
        def graph_runner(self):
            return Runner()

    monkeypatch.setattr(bench, "cuda_backend", lambda settings: Backend())
    eng, step, graphs = bench.warmed_engine("ANDREA-tiny", "fp32", 2, 10, warmup=3)
    rec = step()
    assert rec["step"] == 4 and step()["step"] == 5
    # the tools' lr: stationary weights (the experiment's lr diverged over a tool's hundreds of steps)
    assert eng.cfg.train.lr == bench.TOOL_LR and rec["lr"] == pytest.approx(bench.TOOL_LR)
    g = graphs()
    assert sorted(g) == ["optimizer", "passes"] and all(v.startswith(k) for k, v in g.items())


def test_default_anchor_is_the_checkouts():
    """`--anchor` without a path takes benchmarks/torch_gpt.py of this checkout (it pointed into
    the package folder once the benchmark moved to andrea/bench/, and every bare --anchor failed)."""
    from andrea.bench.step import DEFAULT_ANCHOR
    assert DEFAULT_ANCHOR == ANCHOR.resolve()
    assert DEFAULT_ANCHOR.is_file()


def test_bench_anchor_runs_take_the_fastest(monkeypatch, capsys, tmp_path):
    """--anchor-runs 4: the anchor four times, each its own process; the row is the fastest run that
    finished ("best of 3": one failed), with every finished run's tokens/s in the JSON."""
    import andrea.backends
    import andrea.bench.step as bench
    calls, speeds = [], iter([200_000, None, 260_000, 230_000])

    def run(cmd, capture_output, text):
        calls.append(cmd)
        tok_s = next(speeds)
        if tok_s is None:
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="compile failed")
        rec = dict(dtype="bfloat16", fp8=None, tok_s=tok_s, ms_step=10.0, tflops=100.0)
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(rec) + "\n", stderr="")
    monkeypatch.setattr(andrea.backends, "cuda_available", lambda: True)
    monkeypatch.setattr(bench.subprocess, "run", run)
    ours = dict(precision="fp16", attention="fused", tok_s=390_000, ms_step=20.0, tflops=100.0, planned_gb=1.0,
                plan_arena_gb=0.9, pool_used_gb=1.0, device_used_gb=1.1, per_kernel_ms={"k_matmul": 1.0})
    monkeypatch.setattr(bench, "run_engine", lambda *args: dict(ours))
    out = tmp_path / "bench.json"
    assert bench.main(["--exp", "ANDREA-12M", "--anchor", str(ANCHOR), "--anchor-modes", "reduce-overhead",
                       "--anchor-precision", "bf16", "--anchor-runs", "4", "--json", str(out)]) == 0
    assert len(calls) == 4 and all(c == calls[0] for c in calls)
    captured = capsys.readouterr()
    assert "anchor bf16 reduce-overhead failed" in captured.err
    row = captured.out.splitlines()[-2]
    assert row.startswith("pytorch bfloat16 reduce-overhead best of 3") and row.split()[-1] == "1.50"
    anchor, = json.loads(out.read_text())["anchors"]
    assert anchor["tok_s"] == 260_000 and anchor["runs_tok_s"] == [200_000, 260_000, 230_000]
    assert bench.main(["--anchor-runs", "0"]) == 2
    assert "--anchor-runs 0: expected 1 or more" in capsys.readouterr().err
