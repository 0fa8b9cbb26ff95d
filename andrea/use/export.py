"""Export a trained model: safetensors with ANDREA's names, or a Hugging Face GPT-2 folder.

    andrea export RUN_OR_CHECKPOINT --format safetensors [--out DIR]
    andrea export RUN_OR_CHECKPOINT --format hf [--out DIR]

`safetensors`: DIR/model.safetensors holds every parameter under ANDREA's name (wte, wpe,
h0.qkv_w, ...; shapes as in andrea/core/model.py) in float32, its metadata the resolved config (JSON),
the step and the config hash; DIR/tokenizer.json beside it.

`hf`: a folder `transformers.GPT2LMHeadModel.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load without custom code: config.json (GPT-2 with ANDREA's
sizes, activation gelu_new = tanh GELU, layer_norm_epsilon 1e-5, no dropout, tied embeddings),
model.safetensors under GPT-2's names (andrea/use/gpt2.py), generation_config.json (stops at any
special token of the chat template), and the tokenizer (tokenizer.json, tokenizer_config.json
with the chat template, special_tokens_map.json). The vocabulary keeps ANDREA's padded size
(model.vocab_size rows); ids past the tokenizer's are never produced by it.

The folder is assembled under a temporary name and renamed into place: complete or absent. It
holds andrea-export.json, the manifest naming the files the export wrote: an existing --out is
replaced only when it is such an earlier export holding nothing else (or an empty folder); any
other existing file or folder is refused (exit 2) and left as it is.
Needs the `export` extra (safetensors; transformers only to load the result).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from ..util.atomic import atomic_write

FORMATS = ("safetensors", "hf")


def _safetensors():
    try:
        from safetensors.numpy import save
    except ImportError:
        raise ValueError("export needs the safetensors package: pip install -e '.[export]'") from None
    return save


def chat_template() -> str:
    """ANDREA's chat template in Jinja, for tokenizer.apply_chat_template (andrea/data/chat.py)."""
    from ..data.chat import ASSISTANT, DOC, END
    return ("{{ '" + DOC + "' }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '" + END
            + "' }}{% endfor %}{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}")


def hf_config(cfg, tok, meta: dict) -> dict:
    m = cfg.model
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": m.vocab_size, "n_positions": m.context, "n_embd": m.d_model, "n_layer": m.n_layer,
        "n_head": m.n_head, "n_inner": 4 * m.d_model, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0, "initializer_range": cfg.train.init_std,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": tok.doc_id, "eos_token_id": tok.eot_id, "pad_token_id": tok.doc_id,
        "torch_dtype": "float32", "andrea": meta,
    }


def tokenizer_files(tok, context: int) -> dict:
    from ..data.chat import ASSISTANT, DOC, END, SYSTEM, TOOL, USER

    special = {"bos_token": DOC, "eos_token": END, "pad_token": DOC,
               "additional_special_tokens": [SYSTEM, USER, ASSISTANT, TOOL]}
    config = dict(special, tokenizer_class="PreTrainedTokenizerFast", model_max_length=context,
                  clean_up_tokenization_spaces=False, add_prefix_space=False, chat_template=chat_template())
    return {"tokenizer.json": Path(tok.path).read_bytes(),
            "tokenizer_config.json": json.dumps(config, indent=1) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=1) + "\n"}


def files_for(fmt: str, cfg, params, tok, meta: dict) -> dict:
    """{file name: bytes or text} of one export."""
    from .gpt2 import to_gpt2
    from ..core.model import ParamLayout

    save = _safetensors()
    views = ParamLayout.from_config(cfg.model).views(np.ascontiguousarray(params, dtype=np.float32))
    if fmt == "safetensors":
        from ..config import to_dict
        md = {"format": "andrea", "config": json.dumps(to_dict(cfg), sort_keys=True),
              **{k: str(v) for k, v in meta.items()}}
        return {"model.safetensors": save({n: np.ascontiguousarray(v) for n, v in views.items()}, md),
                "tokenizer.json": Path(tok.path).read_bytes()}
    eos = [tok.eot_id] + sorted(i for i in tok.special_ids.values() if i != tok.eot_id)
    gen = {"bos_token_id": tok.doc_id, "eos_token_id": eos, "pad_token_id": tok.doc_id}
    return {"model.safetensors": save(to_gpt2(views), {"format": "pt"}),
            "config.json": json.dumps(hf_config(cfg, tok, meta), indent=1) + "\n",
            "generation_config.json": json.dumps(gen, indent=1) + "\n",
            **tokenizer_files(tok, min(cfg.model.context, cfg.train.seq_len))}


MANIFEST = "andrea-export.json"  # names the files an export wrote: what a later export may replace
WRITTEN_BY = "andrea export"


class ExportError(ValueError):
    """An --out that cannot be written: names the target and why."""


def own_export(out: Path):
    """The files of out, when out is an earlier export's folder holding only what that export
    wrote (its manifest and the files it names); else None."""
    try:
        man = json.loads((out / MANIFEST).read_text())
        names = set(man["files"]) | {MANIFEST}
        if man.get("written_by") != WRITTEN_BY or not all(isinstance(n, str) for n in names):
            return None
        present = {p.name for p in out.iterdir()}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not present <= names or any((out / n).is_dir() and not (out / n).is_symlink() for n in present):
        return None
    return present


def check_target(out: Path) -> None:
    """Refuse an --out this command may not replace: anything but a missing path, an empty folder
    or an earlier export (recognised by its manifest). Nothing is deleted that export did not write."""
    if out.is_symlink():
        raise ExportError(f"--out {out}: a symbolic link; pass a new folder, or the folder of an earlier export")
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"--out {out}: an existing file; expected a new folder, or the folder of an "
                          f"earlier export (it holds {MANIFEST}); nothing was written")
    if not any(out.iterdir()):
        return
    if own_export(out) is None:
        extra = ""
        if (out / MANIFEST).is_file():
            extra = " (it holds files the export did not write)"
        raise ExportError(f"--out {out}: an existing folder that is not an earlier export's{extra}; its files "
                          f"are left as they are. Expected a new folder, or one written by andrea export "
                          f"(it holds {MANIFEST}); nothing was written")


def _missing_parents(out: Path):
    missing = []
    for p in out.parents:
        if p.exists():
            break
        missing.append(p)
    return missing  # deepest first


def write_folder(out: Path, files: dict, manifest: dict = None) -> Path:
    """Write files into out atomically as a whole: a temporary sibling folder, renamed into place
    (exchanged with an earlier export of the same place in one rename). An existing out that is not
    an earlier export is refused (ExportError, before anything is written); on any failure nothing
    temporary is left and out is as it was."""
    import tempfile

    from ..util.atomic import NoSpace, swap_in_folder

    out = Path(out)
    check_target(out)
    files = dict(files)
    files[MANIFEST] = json.dumps(dict(manifest or {}, written_by=WRITTEN_BY, files=sorted(files)), indent=1) + "\n"
    made = _missing_parents(out)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; the export is an ordinary folder
        for name, data in files.items():
            atomic_write(tmp / name, data.encode() if isinstance(data, str) else data)
        check_target(out)  # again: another process may have put something there meanwhile
        was_empty_dir = out.is_dir() and not any(out.iterdir())
        if was_empty_dir:
            os.rmdir(out)  # an empty folder only: rmdir cannot remove anything in it
        swap_in_folder(tmp, out)
    except NoSpace as e:
        _cleanup(tmp, made)
        raise NoSpace(out / e.path.name, e.needed, e.free) from None
    except OSError as e:
        _cleanup(tmp, made)
        raise ExportError(f"--out {out}: cannot write the export there ({e.strerror or e}); "
                          "nothing was written") from None
    except BaseException:
        _cleanup(tmp, made)
        raise
    _cleanup(tmp, [])  # the earlier export, now at the temporary name
    return out


def _cleanup(tmp, made) -> None:
    if tmp is not None and os.path.lexists(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    for d in made:  # the parent folders this call created, deepest first, if still empty
        try:
            d.rmdir()
        except OSError:
            break


def export(path, fmt: str, out=None, tokenizer=None, prog: str = "andrea export") -> Path:
    from ..config import config_hash
    from .locate import load_tokenizer_for, locate

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if out:
        check_target(Path(out))  # refused before the model is read
    located = locate(path, tokenizer, prog=prog)
    cfg, params = located.load()
    tok = load_tokenizer_for(located, cfg)
    step = int(located.checkpoint.stem.split("_")[-1])
    meta = {"exp": cfg.exp, "step": step, "config_hash": config_hash(cfg), "checkpoint": located.checkpoint.name}
    out = Path(out) if out else Path(cfg.results_dir) / cfg.exp / "export" / f"{cfg.exp}-{step}-{fmt}"
    return write_folder(out, files_for(fmt, cfg, params, tok, meta),
                        {"format": fmt, "source": str(located.checkpoint), **meta})


def cmd_export(a) -> int:
    import sys
    out = export(a.path, a.format, a.out, a.tokenizer)
    print(f"andrea export: {a.format} -> {out} ({', '.join(sorted(p.name for p in out.iterdir()))})",
          file=sys.stderr)
    return 0


def add_arguments(p) -> None:
    p.add_argument("path", help="run folder (results/<exp>), archive folder or step_XXXXXXXX.bin checkpoint")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", help="output folder, new or an earlier export's (default: "
                   "<results_dir>/<exp>/export/<exp>-<step>-<format>); any other existing path is refused")
    p.add_argument("--tokenizer", help="tokenizer.json, or a folder holding one (default: the archive's, else the "
                   "config's data.tokenizer)")
    p.set_defaults(fn=cmd_export)
