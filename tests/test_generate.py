"""Sampling and the generate / chat commands on a model trained here (tests/trained_model.py)."""
import io
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea import cli
from andrea.core.checkpoint import sidecar_path
from andrea.data.chat import render_prompt
from andrea.data.tokenizer import load_tokenizer
from andrea.core.engine import Engine
from andrea.use.generate import Sampler, TextStream, complete, fit_conversation, load
from andrea.use.locate import locate

from trained_model import QA, make_run

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("model"))


def gen(capsys, *argv):
    rc = cli.main(["generate", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_answers_and_stops_at_end_of_turn(run, capsys):
    for q, a in QA:
        rc, out, _ = gen(capsys, run, "--prompt", q, "--temperature", 0, "--max-tokens", 50)
        assert rc == 0 and out == a + "\n"  # no <|end|>, nothing after it
    cfg, tok, dec, _ = load(run)
    ids = list(complete(dec, tok.encode(render_prompt("hi")), 50, Sampler(), tok.special_ids.values()))
    assert ids[-1] == tok.eot_id and len(ids) == len(tok.encode("hello there")) + 1
    rc, out, _ = gen(capsys, run, "--prompt", "hi", "--temperature", 0, "--max-tokens", 1)
    assert rc == 0 and out == tok.decode(ids[:1]) + "\n"


def test_special_tokens_are_never_shown(run, capsys):
    tok = load_tokenizer(run / "tokenizer.json")
    # --raw: the template typed out by hand, so the prompt itself is made of special tokens
    rc, out, _ = gen(capsys, run, "--raw", "--prompt", render_prompt("hi"), "--temperature", 0)
    assert rc == 0 and out == "hello there\n"
    ids = tok.encode("<|user|>blue é<|end|><|assistant|>") + [tok.doc_id]
    s = TextStream(tok)
    pieces = [s.push(i) for i in ids]
    assert "".join(pieces) == "blue é" and not any("\ufffd" in p or "<|" in p for p in pieces)
    # sampled at a high temperature for many tokens: whatever comes, no special token text
    for seed in range(3):
        rc, out, _ = gen(capsys, run, "--raw", "--prompt", "<|endoftext|>", "--temperature", 3,
                         "--seed", seed, "--max-tokens", 40)
        assert rc == 0 and "<|" not in out


def test_sampling_options(run, capsys):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50)
    top3 = set(np.argsort(logits)[-3:])
    s = Sampler(temperature=2.0, top_k=3, seed=1)
    assert {s.pick(logits) for _ in range(300)} == top3
    assert {Sampler(5.0, top_k=1, seed=i).pick(logits) for i in range(20)} == {int(logits.argmax())}
    assert {Sampler(5.0, top_p=1e-9, seed=i).pick(logits) for i in range(20)} == {int(logits.argmax())}
    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    nucleus = set(np.argsort(-p)[:int(np.searchsorted(np.cumsum(np.sort(p)[::-1]), 0.5)) + 1])
    s = Sampler(1.0, top_p=0.5, seed=2)
    assert {s.pick(logits) for _ in range(300)} == nucleus
    a = [Sampler(1.0, seed=4).pick(logits) for _ in range(5)]
    assert a == [Sampler(1.0, seed=4).pick(logits) for _ in range(5)]
    for bad, match in (({"temperature": -1}, "--temperature"), ({"top_k": -2}, "--top-k"),
                       ({"top_p": 0}, "--top-p")):
        with pytest.raises(ValueError, match=match):
            Sampler(**bad)
    rc, out1, _ = gen(capsys, run, "--prompt", "hi", "--temperature", 1.5, "--seed", 9, "--top-k", 5, "--top-p", 0.9)
    rc2, out2, _ = gen(capsys, run, "--prompt", "hi", "--temperature", 1.5, "--seed", 9, "--top-k", 5, "--top-p", 0.9)
    assert rc == rc2 == 0 and out1 == out2
    rc, _, err = gen(capsys, run, "--prompt", "hi", "--top-p", 2)
    assert rc == 2 and "--top-p 2.0" in err


def test_cached_sampling_matches_engine_generate(run):
    """The evaluation's old path (Engine.generate: a full forward per token, the window sliding
    past train.seq_len) and the decoder give the same tokens, greedy and sampled."""
    cfg, tok, dec, ckpt = load(run)
    eng = Engine(cfg)
    eng.load_checkpoint(ckpt)
    long_prompt = render_prompt("What is 12 + 7? " * 4)  # longer than the 24-token window
    assert len(tok.encode(long_prompt)) > dec.context
    for prompt, temperature, seed in ((render_prompt("hi"), 0.0, 0), (long_prompt, 0.0, 0),
                                      (render_prompt("Sort: 3 1 2"), 1.0, 5)):
        ids = tok.encode(prompt)
        old = eng.generate(ids, 30, temperature, seed, stop_ids=(tok.eot_id,))
        dec.reset()
        new = list(complete(dec, ids, 30, Sampler(temperature, seed=seed), (tok.eot_id,)))
        assert new == old


def test_chat_repl(run):
    from andrea.use.generate import add_arguments
    import argparse

    ap = argparse.ArgumentParser()
    add_arguments(ap, chat=True)
    out = io.StringIO()
    a = ap.parse_args([str(run), "--temperature", "0"])
    script = "hi\n\nName a colour\n/reset\nhi\n/quit\nhi\n"
    assert a.fn(a, io.StringIO(script), out) == 0
    assert out.getvalue() == "hello there\nblue é\nhello there\n"  # nothing after /quit, no markers


def test_fit_conversation_drops_oldest_exchanges():
    prefix, ex = [0], [[1] * 5, [2] * 5, [3] * 5]
    assert fit_conversation(prefix, ex, 100, 10) == [0] + [1] * 5 + [2] * 5 + [3] * 5
    assert fit_conversation(prefix, ex, 19, 3) == [0] + [1] * 5 + [2] * 5 + [3] * 5  # 1 + 15 + 3
    assert fit_conversation(prefix, ex, 18, 3) == [0] + [2] * 5 + [3] * 5
    assert fit_conversation(prefix, [[4] * 30], 20, 3) == [0] + [4] * 30  # the newest always stays


def test_bad_paths_name_what_is_wrong(run, tmp_path, capsys):
    rc, _, err = gen(capsys, tmp_path / "missing", "--prompt", "hi")
    assert rc == 2 and str(tmp_path / "missing") in err and "no such file" in err
    (tmp_path / "notes.txt").write_text("x")
    rc, _, err = gen(capsys, tmp_path / "notes.txt", "--prompt", "hi")
    assert rc == 2 and "notes.txt" in err and "step_XXXXXXXX.bin" in err
    rc, _, err = gen(capsys, tmp_path, "--prompt", "hi")
    assert rc == 2 and "no valid checkpoint" in err
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    ck = locate(copy).checkpoint
    side = sidecar_path(ck)
    side.write_text(side.read_text().replace('"config_hash": "', '"config_hash": "0'))
    rc, _, err = gen(capsys, ck, "--prompt", "hi")
    assert rc == 2 and ck.name in err and "config_hash" in err
    rc, _, err = gen(capsys, run, "--prompt", "hi", "--tokenizer", tmp_path / "tok.json")
    assert rc == 2 and str(tmp_path / "tok.json") in err


def test_archive_is_self_contained(run, tmp_path, capsys):
    """scripts/archive.py copies the tokenizer; the archive alone answers."""
    import subprocess
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "archive.py"), "--config", str(run / "config.yaml"),
                        "--checkpoints", str(run / "checkpoints"), "--out", str(tmp_path / "final")],
                       capture_output=True, text=True, cwd=REPO, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    moved = tmp_path / "elsewhere"
    shutil.move(tmp_path / "final", moved)
    (run / "tokenizer.json").rename(run / "tokenizer.moved")
    try:
        rc, out, _ = gen(capsys, moved, "--prompt", "hi", "--temperature", 0)
    finally:
        (run / "tokenizer.moved").rename(run / "tokenizer.json")
    assert rc == 0 and out == "hello there\n"


def test_bench_prints_tokens_per_second(run, capsys):
    """--bench's table: prefill, single stream and each --bench-streams count, every figure a
    positive number; the new tokens capped by the window less the 16-token prompt."""
    rc, _, err = gen(capsys, run, "--bench", "--bench-tokens", 40, "--bench-streams", "1,3", "--temperature", 0)
    assert rc == 0
    rows = dict(line.strip("|").split("|") for line in err.splitlines() if line.startswith("|"))
    rows = {k.strip(): float(v.strip().replace(",", "")) for k, v in rows.items()}
    assert set(rows) == {"prefill 23 tokens (ms)", "prefill tokens/s", "single stream decode tokens/s",
                         "single stream end-to-end tokens/s", "1 streams decode tokens/s (total)",
                         "1 streams with prefills tokens/s", "3 streams decode tokens/s (total)",
                         "3 streams with prefills tokens/s"}, rows
    assert min(rows.values()) > 0
    assert "8 new tokens" in err  # the window of 24 less the prompt of 16
    rc, _, err = gen(capsys, run, "--bench", "--bench-streams", "1,x")
    assert rc == 2 and "--bench-streams" in err
