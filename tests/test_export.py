"""Export to safetensors / Hugging Face GPT-2 and import back, on a model trained here.

The HF folder is loaded by `transformers` itself (GPT2LMHeadModel, AutoTokenizer, no custom code):
its fp32 logits match ANDREA's forward pass (the training engine, NumPy fp32) to 1e-5 of the
largest logit on several prompts, and its greedy generate gives `andrea generate`'s text.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from andrea import cli
from andrea.config import load_run_config
from andrea.data.chat import render_prompt
from andrea.data.tokenizer import load_tokenizer
from andrea.core.engine import Engine
from andrea.use.export import export
from andrea.use.importer import import_weights
from andrea.use.locate import locate

from conftest import make_shards
from trained_model import make_run

safetensors = pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def hf_dir(run, tmp_path_factory):
    return export(run, "hf", tmp_path_factory.mktemp("export") / "hf")


def weights_block(bin_path: Path) -> bytes:
    raw = bin_path.read_bytes()
    n = int(np.frombuffer(raw[4:8], dtype="<i4")[0])
    return raw[8:8 + 4 * n]


def andrea_logits(run, ids):
    cfg = load_run_config(run / "config.yaml")
    cfg.train.batch_size, cfg.train.seq_len = 1, len(ids)
    eng = Engine(cfg)
    eng.load_checkpoint(locate(run).checkpoint)
    x = np.array([ids], dtype=np.int32)
    eng.forward(x, x)
    z = eng.g["logits"]  # the classifier's workspace: all B*T rows when they fit one chunk
    assert z.shape[0] == len(ids), "the logits workspace holds a chunk, not every position"
    return z.astype(np.float64)


def start_config(run, tmp_path) -> Path:
    """The run's config, pointed at fresh shards and a fresh results folder: a run to start."""
    make_shards(tmp_path, vocab=300)
    d = yaml.safe_load((run / "config.yaml").read_text())
    d["results_dir"] = str(tmp_path / "results")
    d["data"]["train_shards"] = str(tmp_path / "shards" / "train_*.bin")
    d["data"]["val_shards"] = str(tmp_path / "shards" / "val_*.bin")
    path = tmp_path / "start.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_hf_logits_match_andrea_forward(run, hf_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    tok = load_tokenizer(run / "tokenizer.json")
    prompts = [tok.encode(render_prompt(q)) for q in ("hi", "Name a colour", "Sort: 5 3 9 1")]
    prompts.append(list(np.random.default_rng(0).integers(0, 300, 24)))  # the whole context, any ids
    for ids in prompts:
        ours = andrea_logits(run, ids)
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0].double().numpy()
        err = np.abs(theirs - ours).max() / np.abs(ours).max()
        assert err < 1e-5, f"{len(ids)} tokens: relative error {err:.2e}"


def test_hf_greedy_generate_gives_andrea_text(run, hf_dir, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    htok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tok = load_tokenizer(run / "tokenizer.json")
    for q in ("hi", "Name a colour", "Sort: 5 3 9 1", "What is 2 + 2?"):
        text = htok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        assert text == render_prompt(q)
        ids = htok(text, return_tensors="pt").input_ids
        assert ids[0].tolist() == tok.encode(text)
        n = 24 - ids.shape[1]  # HF stops at n_positions; stay inside the context
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        theirs = htok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert cli.main(["generate", str(run), "--prompt", q, "--temperature", "0", "--max-tokens", str(n)]) == 0
        assert capsys.readouterr().out == theirs + "\n", q


def test_hf_folder_contents(run, hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu_new"
    assert cfg["layer_norm_epsilon"] == 1e-5 and cfg["vocab_size"] == 300 and cfg["n_positions"] == 24
    assert cfg["andrea"]["step"] == 120 and cfg["tie_word_embeddings"]
    from safetensors.numpy import load_file
    t = load_file(hf_dir / "model.safetensors")
    assert "lm_head.weight" not in t and t["transformer.h.1.mlp.c_fc.weight"].shape == (32, 128)
    assert (hf_dir / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_round_trip_export_import_is_byte_identical(run, fmt, tmp_path):
    out = export(run, fmt, tmp_path / fmt)
    ckpt = import_weights(out, start_config(run, tmp_path))
    assert ckpt.name == "step_00000000.bin"
    assert weights_block(ckpt) == weights_block(locate(run).checkpoint)
    if fmt == "hf":  # and exporting the imported checkpoint again writes the same tensors file
        again = export(ckpt, "hf", tmp_path / "again", tokenizer=run / "tokenizer.json")
        assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_imported_checkpoint_starts_training(run, hf_dir, tmp_path):
    from andrea.run.runner import Run
    config = start_config(run, tmp_path)
    ckpt = import_weights(hf_dir, config)
    cfg = load_run_config(config)
    r = Run(cfg, ckpt.parent.parent)
    assert r.resume() and r.step == 0
    assert np.asarray(r.eng.params).tobytes() == weights_block(ckpt)
    assert not np.asarray(r.eng.m).any() and not np.asarray(r.eng.v).any()
    with pytest.raises(ValueError, match="already holds checkpoints"):
        import_weights(hf_dir, config)


def test_gpt2_original_names_and_vocab_padding(run, hf_dir, tmp_path):
    """Files as GPT-2 ships them: no `transformer.` prefix, a vocabulary smaller than the model's."""
    from safetensors.numpy import load_file, save_file
    t = load_file(hf_dir / "model.safetensors")
    t = {k[len("transformer."):]: v for k, v in t.items()}
    t["wte.weight"] = t["wte.weight"][:290].copy()
    save_file(t, tmp_path / "gpt2.safetensors")
    ckpt = import_weights(tmp_path / "gpt2.safetensors", start_config(run, tmp_path))
    got = np.frombuffer(weights_block(ckpt), dtype="<f4")
    want = np.frombuffer(weights_block(locate(run).checkpoint), dtype="<f4").copy()
    want[290 * 32:300 * 32] = 0  # wte rows 290..299 padded with zeros
    np.testing.assert_array_equal(got, want)


def test_import_errors_name_file_and_field(run, hf_dir, tmp_path, capsys):
    config = start_config(run, tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    c = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(c, activation_function="relu")))
    rc = cli.main(["import", str(bad), "--config", str(config)])
    err = capsys.readouterr().err
    assert rc == 2 and str(bad / "config.json") in err and "activation_function" in err
    small = load_run_config(config)
    d = yaml.safe_load(config.read_text())
    d["model"]["d_model"] = 16
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ValueError, match=r"tensor transformer.wte.weight has shape \(300, 32\).*\(300, 16\)"):
        import_weights(hf_dir / "model.safetensors", tmp_path / "small.yaml")
    from safetensors.numpy import load_file, save_file
    t = load_file(hf_dir / "model.safetensors")
    del t["transformer.h.1.ln_2.bias"]
    save_file(t, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match=r"missing.safetensors: tensor transformer.h.1.ln_2.bias is missing"):
        import_weights(tmp_path / "missing.safetensors", config)
    rc = cli.main(["import", str(tmp_path / "nowhere"), "--config", str(config)])
    assert rc == 2 and str(tmp_path / "nowhere") in capsys.readouterr().err
    assert small.model.d_model == 32


def test_export_cli_and_bad_format(run, tmp_path, capsys):
    assert cli.main(["export", str(run), "--format", "safetensors", "--out", str(tmp_path / "st")]) == 0
    from safetensors import safe_open
    with safe_open(str(tmp_path / "st" / "model.safetensors"), framework="numpy") as f:
        meta = f.metadata()
        assert "h0.qkv_w" in f.keys() and f.get_tensor("h0.qkv_w").shape == (96, 32)
    assert meta["format"] == "andrea" and json.loads(meta["config"])["model"]["d_model"] == 32
    with pytest.raises(SystemExit):
        cli.main(["export", str(run), "--format", "onnx"])
    assert cli.main(["export", str(tmp_path / "none"), "--format", "hf"]) == 2
    assert str(tmp_path / "none") in capsys.readouterr().err
