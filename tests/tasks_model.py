"""A small trained model and small task files written by the tests of andrea/tasks (nothing read
from outside the repository): a run folder with config.yaml, one checkpoint and its tokenizer."""
import json
from pathlib import Path

import numpy as np
import yaml

from andrea.config import config_hash, load_run_config, to_dict
from andrea.core.checkpoint import write_checkpoint
from andrea.core.engine import Engine
from andrea.data.chat import render_conversation
from andrea.data.synthetic import generate as synthetic_conversations
from andrea.data.tokenizer import train_tokenizer

WORDS = ("red blue green cat dog bird sun moon tree river stone house apple bread water fire "
         "the a is was and of in on to big small old new").split()


def sentence(rng, n):
    return " ".join(rng.choice(WORDS, n))


def write_tasks(root: Path, seed: int = 0, n: int = 24) -> dict:
    """Three task files of odd lengths, one per kind, at the paths of copa, winograd and
    lambada_openai in the layout (so suites find them). Returns {task name: path}."""
    rng = np.random.default_rng(seed)
    mc = [{"query": sentence(rng, 1 + i % 7) + ", therefore", "gold": int(rng.integers(0, 2 + i % 3)),
           "choices": [sentence(rng, 1 + (i + j) % 5) + "." for j in range(2 + i % 3)]} for i in range(n)]
    for it in mc:
        it["gold"] = min(it["gold"], len(it["choices"]) - 1)
    schema = [{"context_options": [sentence(rng, 2 + i % 6) + " " + w for w in ("cat", "dog", "bird")[:2 + i % 2]],
               "continuation": sentence(rng, 1 + i % 4) + ".", "gold": i % 2} for i in range(n)]
    lm = [{"context": sentence(rng, 3 + i % 9), "continuation": sentence(rng, 1 + i % 3)} for i in range(n)]
    out = {}
    for name, rel, rows in (("copa", "commonsense_reasoning/copa.jsonl", mc),
                            ("winograd", "language_understanding/winograd_wsc.jsonl", schema),
                            ("lambada_openai", "language_understanding/lambada_openai.jsonl", lm)):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[name] = p
    return out


def make_model(root: Path, context: int = 64, steps: int = 30, seed: int = 0) -> Path:
    """Train a 2-layer model briefly on synthetic chats and word salad; write it as run folder root/m."""
    run = root / "m"
    rng = np.random.default_rng(seed)
    texts = [render_conversation(c["conversations"]) for c in synthetic_conversations(150, seed)]
    texts += [sentence(rng, 12) + "." for _ in range(300)]
    tok = train_tokenizer(texts, 300, run / "tokenizer.json", progress=False)
    cfg = load_run_config({
        "exp": "m", "results_dir": str(root),
        "model": {"name": "m", "n_layer": 2, "d_model": 32, "n_head": 4, "context": context, "vocab_size": 300},
        "data": {"tokenizer": str(run / "tokenizer.json")},
        "train": {"steps": steps, "batch_size": 4, "seq_len": context, "lr": 1e-2, "warmup_steps": 3,
                  "min_lr": 1e-3, "seed": seed},
        "backend": {"name": "numpy"}})
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    stream = np.array([i for t in texts for i in tok.encode(t)], dtype=np.int32)
    eng = Engine(cfg)
    for s in range(1, steps + 1):
        starts = rng.integers(0, stream.size - context - 1, 4)
        w = np.stack([stream[a:a + context + 1] for a in starts])
        eng.train_step(s, [(w[:, :-1], w[:, 1:])])
    params, m, v = eng.host_state()
    write_checkpoint(run / "checkpoints", steps, params, m, v, {"config_hash": config_hash(cfg)})
    return run
