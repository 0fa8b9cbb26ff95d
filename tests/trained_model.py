"""A small chat model that learns two conversations by heart in a few seconds on the CPU, written
as a run folder (config.yaml, checkpoints/, the tokenizer): what generate, chat, export and import
are tested on. Nothing is downloaded."""
from pathlib import Path

import numpy as np
import yaml

from andrea.core.checkpoint import write_checkpoint
from andrea.config import config_hash, load_run_config, to_dict
from andrea.data.chat import render_conversation
from andrea.data.synthetic import generate as synthetic_conversations
from andrea.data.tokenizer import train_tokenizer
from andrea.core.engine import Engine

# Learnt by heart: greedy decoding after each question gives its answer, then <|end|>.
QA = [("hi", "hello there"), ("Name a colour", "blue é")]
STEPS = 120


def conversation(q, a):
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


def make_run(root: Path, steps: int = STEPS) -> Path:
    """Train the model and write results-style folder root/mini; returns that folder."""
    run = root / "mini"
    texts = [render_conversation(c["conversations"]) for c in synthetic_conversations(200, 0)]
    texts += [render_conversation(conversation(q, a)) for q, a in QA] * 20
    tok = train_tokenizer(texts, 300, run / "tokenizer.json", progress=False)
    cfg = load_run_config({
        "exp": "mini", "results_dir": str(root),
        "model": {"name": "mini", "n_layer": 2, "d_model": 32, "n_head": 4, "context": 24, "vocab_size": 300},
        "data": {"tokenizer": str(run / "tokenizer.json")},
        "train": {"steps": steps, "batch_size": 2, "seq_len": 24, "lr": 1e-2, "warmup_steps": 5,
                  "min_lr": 1e-3, "seed": 5},
        "backend": {"name": "numpy"}})
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    rows = []
    for q, a in QA:
        ids = tok.encode(render_conversation(conversation(q, a)))
        assert len(ids) <= 24, (q, a, len(ids))
        ids = ids + [tok.doc_id] * (25 - len(ids))
        rows.append(ids)
    arr = np.array(rows, dtype=np.int32)
    eng = Engine(cfg)
    for s in range(1, steps + 1):
        eng.train_step(s, [(arr[:, :-1], arr[:, 1:])])
    params, m, v = eng.host_state()
    write_checkpoint(run / "checkpoints", steps, params, m, v, {"config_hash": config_hash(cfg)})
    return run
