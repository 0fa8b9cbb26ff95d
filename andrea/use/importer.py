"""Start an experiment from GPT-2-layout weights: the step-0 checkpoint of a fine-tuning run.

    andrea import SOURCE --config results/<exp>/resolved/train.yaml [--run-dir results/<exp>]

SOURCE is a Hugging Face GPT-2 folder (config.json + model.safetensors), a GPT-2-layout
.safetensors file (names with or without the `transformer.` prefix, as the original GPT-2 files
have them), or an ANDREA-named .safetensors file or folder (`andrea export --format safetensors`).
The weights must fit the config's model: every tensor's shape is checked, and a source vocabulary
smaller than model.vocab_size is padded with zero rows (GPT-2's 50,257 tokens in ANDREA-120M's
50,304). A HF config.json must describe GPT-2's block as ANDREA computes it (gelu_new, layer-norm
epsilon 1e-5, no per-layer attention scaling).

The result is `<run>/checkpoints/step_00000000.bin` with zero Adam moments and a sidecar that
starts the data at its beginning (and `<run>/config.yaml`, a copy of the config, when the run
folder has none): `python -m andrea.train experiment=<exp>` then resumes from it.
Round trip: export -> import gives the exported checkpoint's weights byte for byte.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

FOLDER_FILES = ("model.safetensors",)


def _load_file(path: Path) -> Tuple[Dict[str, np.ndarray], dict]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ValueError("import needs the safetensors package: pip install -e '.[export]'") from None
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types for bad headers and dtypes
        raise ValueError(f"{path}: not a readable safetensors file of float tensors ({e})") from None


def read_source(src) -> Tuple[Dict[str, np.ndarray], dict, Path]:
    """(tensors, HF config.json or {}, the weights file)."""
    src = Path(src)
    if not src.exists():
        raise ValueError(f"{src}: no such file or folder; expected a Hugging Face GPT-2 folder or a .safetensors file")
    hf = {}
    if src.is_dir():
        f = src / "model.safetensors"
        if not f.is_file():
            raise ValueError(f"{src}: no model.safetensors in it (sharded or pickled weights are not read)")
        cj = src / "config.json"
        if cj.is_file():
            try:
                hf = json.loads(cj.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{cj}: not valid JSON ({e})") from None
        src = f
    tensors, meta = _load_file(src)
    return tensors, hf, src


def check_hf_config(hf: dict, cfg, where: Path) -> None:
    """A config.json describing another block than ANDREA's fails on the field that differs."""
    m = cfg.model
    expect = {"n_embd": m.d_model, "n_layer": m.n_layer, "n_head": m.n_head}
    want = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "layer_norm_epsilon": (1e-5,),
            "scale_attn_by_inverse_layer_idx": (False,), "reorder_and_upcast_attn": (False,)}
    for k, v in expect.items():
        if k in hf and hf[k] != v:
            raise ValueError(f"{where}: field {k} is {hf[k]}, the config's model needs {v}")
    for k, ok in want.items():
        if k in hf and hf[k] not in ok:
            raise ValueError(f"{where}: field {k} is {hf[k]!r}; ANDREA computes {ok[0]!r}")
    if hf.get("n_inner") not in (None, 4 * m.d_model):
        raise ValueError(f"{where}: field n_inner is {hf['n_inner']}; ANDREA's MLP is 4 * d_model = {4 * m.d_model}")


def to_flat(tensors: Dict[str, np.ndarray], cfg, where: Path) -> np.ndarray:
    """ANDREA's flat float32 weights from GPT-2- or ANDREA-named tensors."""
    from .gpt2 import gpt2_name, is_transposed
    from ..core.model import ParamLayout

    layout = ParamLayout.from_config(cfg.model)
    andrea_named = "wte" in tensors
    if not andrea_named and not any(k.startswith("transformer.") for k in tensors):
        tensors = {"transformer." + k: v for k, v in tensors.items()}  # original GPT-2 files: no prefix
    flat = np.zeros(layout.n_params, dtype=np.float32)
    for name, off, shape in layout.entries:
        key = name if andrea_named else gpt2_name(name)
        if key not in tensors:
            raise ValueError(f"{where}: tensor {key} is missing (needed for {name} {shape})")
        t = np.asarray(tensors[key])
        if not andrea_named and is_transposed(name):
            t = t.T
        if name == "wte" and t.ndim == 2 and t.shape[0] < shape[0] and t.shape[1] == shape[1]:
            t = np.concatenate([t, np.zeros((shape[0] - t.shape[0], shape[1]), dtype=t.dtype)])
        if t.shape != tuple(shape):
            raise ValueError(f"{where}: tensor {key} has shape {tuple(t.shape)}, the config's model needs "
                             f"{tuple(shape)}" + (" (transposed: GPT-2 stores linear weights as (in, out))"
                                                   if not andrea_named and is_transposed(name) else ""))
        if not np.issubdtype(t.dtype, np.floating):
            raise ValueError(f"{where}: tensor {key} is {t.dtype}, expected floating point")
        flat[off:off + t.size] = t.reshape(-1)
    if not np.isfinite(flat).all():
        raise ValueError(f"{where}: NaN or Inf among the weights")
    return flat


def import_weights(src, config, run_dir=None) -> Path:
    from ..util.atomic import atomic_copy
    from ..core.checkpoint import latest_checkpoint, write_checkpoint
    from ..config import config_hash
    from ..data.loader import ShardLoader
    from .locate import load_config

    cfg = load_config(config)  # a bad config is one line naming the file and what was expected
    tensors, hf, where = read_source(src)
    if hf:
        check_hf_config(hf, cfg, Path(src) / "config.json")
    flat = to_flat(tensors, cfg, where)
    run_dir = Path(run_dir) if run_dir else Path(cfg.results_dir) / cfg.exp
    if latest_checkpoint(run_dir) is not None:
        raise ValueError(f"{run_dir}: already holds checkpoints; import starts a run, it does not replace one "
                         "(choose another --run-dir or remove its checkpoints/)")
    t = cfg.train
    loader = ShardLoader(cfg.data.train_shards, t.batch_size, t.seq_len, t.seed, cfg.model.vocab_size)
    side = {"reason": "import", "imported_from": str(src), "data": loader.state(),
            "loss_scale": float(t.loss_scale) if t.precision == "fp16" else 1.0,
            "good_streak": 0, "bad_streak": 0, "skipped": 0, "config_hash": config_hash(cfg),
            "precision": t.precision, "exp": cfg.exp}
    zeros = np.zeros_like(flat)
    path = write_checkpoint(run_dir / "checkpoints", 0, flat, zeros, zeros, side)
    if not (run_dir / "config.yaml").exists():  # a run folder generate, chat and export read as it is
        atomic_copy(config, run_dir / "config.yaml")
    return path


def cmd_import(a) -> int:
    path = import_weights(a.source, a.config, a.run_dir)
    print(f"andrea import: {a.source} -> {path}; `python -m andrea.train` on this run resumes from it",
          file=sys.stderr)
    return 0


def add_arguments(p) -> None:
    p.add_argument("source", help="Hugging Face GPT-2 folder, or a .safetensors file (GPT-2 or ANDREA names)")
    p.add_argument("--config", required=True, help="resolved config of the experiment to start")
    p.add_argument("--run-dir", help="run folder (default: <results_dir>/<exp>)")
    p.set_defaults(fn=cmd_import)
