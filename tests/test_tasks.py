"""andrea/tasks: standard in-context tasks scored in batches on the engine's kernels, each kind
checked against a float64 one-position reference (the KV-cache Decoder), few-shot drawing,
left truncation, the suite's JSON, bad task files. The model and the task files are written here
(tests/tasks_model.py); the real benchmark files are read from ../shared/eval-data when present."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from andrea import cli
from andrea.backends import get_backend
from andrea.tasks.__main__ import main as tasks_main
from andrea.tasks.data import TaskDataError, read_items
from andrea.tasks.prompts import Request, fewshot_indices, pairs, requests
from andrea.tasks.results import compare_tasks, wilson
from andrea.tasks.run import load_model, score_task
from andrea.tasks.suites import CORE, KINDS, LM, MC, SCHEMA, TASKS, resolve
from andrea.use.inference import Decoder
from andrea.use.locate import locate

from tasks_model import make_model, sentence, write_tasks

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "eval-data"
WINDOW = 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    run = make_model(root, context=WINDOW)
    files = write_tasks(root / "data")
    scorer, tok, meta = load_model(run, backend="numpy", batch_tokens=512)
    cfg, params = locate(run, prog=None).load()
    ref = Decoder(cfg.model, get_backend("numpy"), WINDOW, "float64")
    ref.load(params)
    return run, root / "data", files, scorer, tok, ref


def reference(dec, tokens, n_cont):
    """Summed loss of the last n_cont targets and whether each is the argmax, one position at a
    time in float64 (no batch, no padding)."""
    dec.reset()
    logits = [dec.feed(tokens[:1])] + [dec.step(t) for t in tokens[1:-1]]
    loss, greedy = 0.0, True
    for z, y in list(zip(logits, tokens[1:]))[-n_cont:]:
        m = z.max()
        loss += m + math.log(np.exp(z - m).sum()) - z[y]
        greedy &= bool(z[y] >= m)
    return loss, greedy


@pytest.mark.parametrize("name,kind", [("copa", MC), ("winograd", SCHEMA), ("lambada_openai", LM)])
def test_each_kind_against_the_one_position_reference(setup, name, kind):
    run, data, files, scorer, tok, ref = setup
    res, picked, (reqs, loss, count, greedy) = score_task(scorer, tok, name, 1, data)
    items = read_items(files[name], kind)
    assert res["n"] == len(items) == 24 and res["fewshot"] == 1 and res["kind"] == kind
    assert len({len(r.tokens) for r in reqs}) > 5  # odd lengths, several per batch
    want = np.array([reference(ref, r.tokens, r.n_cont) for r in reqs], dtype=object)
    ref_loss = want[:, 0].astype(float)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, atol=2e-5)  # fp32 batched vs float64, ~60 positions
    if kind == LM:
        assert list(greedy) == list(want[:, 1].astype(bool))
        assert res["accuracy"] == np.mean(want[:, 1].astype(bool))
    else:
        by_item = {}
        for r, L in zip(reqs, ref_loss / count):
            by_item.setdefault(r.item, []).append(L)
        expect = [int(np.argmin(by_item[i])) for i in range(len(items))]
        assert list(picked) == expect
        assert res["accuracy"] == pytest.approx(np.mean([e == it["gold"] for e, it in zip(expect, items)]))
        assert res["chance"] == pytest.approx(np.mean([1 / len(by_item[i]) for i in range(len(items))]))


def test_the_classifier_in_chunks_of_the_rows_asked_for(setup, monkeypatch):
    """The continuations' positions gathered and classified a few rows at a time (3: chunks that end
    inside a continuation and inside a batch) give the losses and greedy flags of one chunk a batch,
    the losses to float32 rounding (a row of a BLAS product may round differently with the matrix's
    row count)."""
    run, data, files, scorer, tok, ref = setup
    _, _, (reqs, loss, count, greedy) = score_task(scorer, tok, "lambada_openai", 1, data)
    assert sum(count) > 3 * len(reqs) / 2  # several tokens a continuation
    monkeypatch.setattr(scorer, "rows", 3)
    loss3, count3, greedy3 = scorer.score(reqs, argmax=True)
    np.testing.assert_allclose(loss3, loss, rtol=1e-6, atol=0)
    assert list(count3) == list(count) and list(greedy3) == list(greedy)


def test_shared_groups_keep_every_scored_position_after_the_prefix():
    """An item's options share the longest common prefix of their inputs, cut so every scored
    position and one input position follow it; options cut from the left at other offsets, one
    option alone and short prefixes go the unshared way."""
    from andrea.tasks.shared import share

    ctx = list(range(20, 40))
    reqs = [Request(0, 0, ctx + [1, 2, 3], 1, False), Request(0, 1, ctx + [1, 2, 4, 5], 1, False),
            Request(0, 2, ctx + [1, 7, 8], 1, False),                 # item 0: prefix ctx + [1]
            Request(1, 0, ctx + [9], 1, False), Request(1, 1, ctx[1:] + [8, 9], 1, True),  # cut otherwise
            Request(2, 0, ctx + [5], 1, False),                       # one option
            Request(3, 0, [1, 2, 3, 4, 5, 6], 1, False), Request(3, 1, [1, 2, 3, 7, 8, 9], 1, False)]
    groups, rest = share(reqs, 64)
    assert groups == [([0, 1, 2], 21)] and sorted(rest) == [3, 4, 5, 6, 7]
    reqs[0].n_cont = 2  # a scored position inside the common prefix: the prefix stops before it
    assert share(reqs, 64)[0] == [([0, 1, 2], 20)]


def _shared_tasks(root, rng):
    """MC items whose options share a long query (some cut by the window, options of one and of
    several lengths) and schema items whose options share only their few-shot examples."""
    mc = [{"query": sentence(rng, 3 + i % 9) + (" " + sentence(rng, 40) if i % 5 == 0 else "") + ", therefore",
           "gold": 0, "choices": [sentence(rng, 1 + (i + j) % (1 + i % 3)) + "." for j in range(2 + i % 3)]}
          for i in range(18)]
    schema = [{"context_options": [sentence(rng, 1) + " " + w for w in ("cat", "dog", "bird")[:2 + i % 2]],
               "continuation": sentence(rng, 1 + i % 2) + ".", "gold": i % 2} for i in range(18)]
    for rel, rows in (("commonsense_reasoning/copa.jsonl", mc), ("language_understanding/winograd_wsc.jsonl", schema)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_shared_context_scores_as_the_whole_sequences(setup, tmp_path, monkeypatch):
    """Each item's common prefix computed once (its keys and values of every layer kept) and only
    the options' own tokens after it gives the losses of the whole sequences to float32 rounding,
    the same choices: multiple choice (1- and 4-shot) and schema (3- and 6-shot: its options share
    only the examples), odd lengths, options cut by the window, context and option batches of a few
    sequences (batch_tokens = 2 windows), the classifier 5 rows at a time, some items unshared in
    the same call. Losses computed without the prefix's keys and values fail it."""
    from andrea.tasks.batching import batches
    from andrea.tasks.shared import share

    run, tok = setup[0], setup[4]
    _shared_tasks(tmp_path, np.random.default_rng(7))
    on, _, meta = load_model(run, backend="numpy", batch_tokens=2 * WINDOW)
    off, _, meta_off = load_model(run, backend="numpy", batch_tokens=2 * WINDOW, shared=False)
    assert meta["shared_context"] and not meta_off["shared_context"]
    monkeypatch.setattr(on, "rows", 5)
    cut_shared = unshared = 0
    for name, shots in (("copa", (1, 4)), ("winograd", (3, 6))):
        for k in shots:
            res, picked, (reqs, loss, count, _) = score_task(on, tok, name, k, tmp_path)
            assert on.last["shared"] >= 10
            unshared += on.last["unshared"]
            groups = share(reqs, WINDOW)[0]
            assert len(batches([p for _, p in groups], WINDOW, on.N)) > 2  # several context batches
            cut_shared += sum(reqs[r].cut for m, _ in groups for r in m)
            assert len({len(reqs[r].tokens) - p for m, p in groups for r in m}) > 3  # suffixes of odd lengths
            res0, picked0, (_, loss0, count0, _) = score_task(off, tok, name, k, tmp_path)
            assert off.last == {"shared": 0, "unshared": len(reqs)}
            np.testing.assert_allclose(loss, loss0, rtol=1e-5, atol=1e-5)
            assert list(picked) == list(picked0) and list(count) == list(count0)
    assert cut_shared > 0 and unshared > 0  # options cut at one offset share what is left of their context
    assert list(on.score(reqs, argmax=True)[2]) == list(off.score(reqs, argmax=True)[2])  # greedy flags too


def test_shared_context_in_a_two_byte_dtype(setup, tmp_path):
    """The rows moved as their bits (uint16), as on CUDA in bf16 and fp16: float16 on NumPy gives
    the unshared path's losses to float16 rounding and its choices."""
    from andrea.tasks.score import Scorer

    run, tok = setup[0], setup[4]
    _shared_tasks(tmp_path, np.random.default_rng(8))
    cfg, params = locate(run, prog=None).load()
    on, off = (Scorer(cfg.model, get_backend("numpy"), params, WINDOW, "float16", 2 * WINDOW, shared=s)
               for s in (True, False))
    _, picked, (reqs, loss, _, _) = score_task(on, tok, "copa", 1, tmp_path)
    assert on.last["shared"] >= 10 and on.b["saved_qkv"].dtype == np.float16
    _, picked0, (_, loss0, _, _) = score_task(off, tok, "copa", 1, tmp_path)
    np.testing.assert_allclose(loss, loss0, rtol=2e-3, atol=2e-3)
    assert list(picked) == list(picked0)


def test_exact_match_reads_the_argmax(setup):
    """A continuation made of the model's own greedy tokens is a match; one token changed, it is not."""
    run, data, files, scorer, tok, ref = setup
    ctx = tok.encode("<|endoftext|>red cat and the")
    ref.reset()
    z, cont = ref.feed(ctx), []
    for _ in range(3):
        cont.append(int(np.argmax(z)))
        z = ref.step(cont[-1])
    other = cont[:2] + [(cont[2] + 1) % 300]
    reqs = [Request(0, 0, ctx + cont, 3, 0), Request(1, 0, ctx + other, 3, 0), Request(2, 0, ctx + cont[:1], 1, 0)]
    _, _, greedy = scorer.score(reqs, argmax=True)
    assert list(greedy) == [True, False, True]


def test_fewshot_draws_other_items_with_a_fixed_seed():
    for n in (2, 5, 11):
        for i in range(n):
            for k in (1, 3, 10):
                got = fewshot_indices(i, n, k)
                assert i not in got and len(set(got)) == len(got) == min(k, n - 1)
                assert all(0 <= j < n for j in got) and got == fewshot_indices(i, n, k)
    assert fewshot_indices(3, 40, 5) != fewshot_indices(4, 40, 5)
    items = [{"query": f"q{i}", "choices": [f"a{i}", f"b{i}"], "gold": i % 2} for i in range(6)]
    ctx = pairs(items, 2, MC, " ", 5)[0][0]
    assert "q2" not in ctx[:-len("q2 ")] and all(f"q{j}" in ctx for j in (0, 1, 3, 4, 5))
    assert all(f"q{j} {'ab'[j % 2]}{j}\n" in ctx for j in (0, 1, 3, 4, 5))  # each with its right answer


def test_items_longer_than_the_window_are_cut_from_the_left_and_counted(setup, tmp_path):
    run, data, files, scorer, tok, ref = setup
    long = " ".join(["red cat"] * 60)
    rows = [{"query": long, "choices": ["sun.", "big old moon."], "gold": 0},
            {"query": "the dog", "choices": ["sun.", "moon."], "gold": 1}]
    p = tmp_path / "commonsense_reasoning" / "copa.jsonl"
    p.parent.mkdir(parents=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res, picked, (reqs, loss, count, _) = score_task(scorer, tok, "copa", 0, tmp_path)
    assert res["truncated"] == 1
    assert [r.cut for r in reqs] == [True, True, False, False]
    full = tok.encode("<|endoftext|>" + long + " big old moon.")
    assert reqs[1].tokens == full[-(WINDOW + 1):] and reqs[1].n_cont == len(tok.encode(" big old moon."))
    # the options of a cut item keep the same context tokens: those the longest continuation leaves
    ctx = reqs[1].tokens[:-reqs[1].n_cont]
    assert reqs[0].tokens[:-reqs[0].n_cont] == ctx and len(reqs[0].tokens) < WINDOW + 1
    assert reqs[0].tokens[-reqs[0].n_cont:] == tok.encode(" sun.")
    for r, L in zip(reqs, loss):
        assert L == pytest.approx(reference(ref, r.tokens, r.n_cont)[0], rel=2e-5, abs=2e-5)


def _whole(tok, items, kind, delimiter, fewshot, window, indices=None):
    """The Requests of the items at indices (all by default) with every pair encoded whole, one at a
    time, and cut as the module says: the last window + 1 tokens, a multiple-choice item's options
    at one place (the room its longest continuation leaves)."""
    from andrea.tasks.prompts import split_space
    rows = []
    for i in range(len(items)) if indices is None else indices:
        for o, (ctx, cont) in enumerate(pairs(items, i, kind, delimiter, fewshot)):
            ctx, cont = split_space(ctx, cont)
            whole, head = tok.encode(ctx + cont), tok.encode(ctx)
            rows.append((i, o, whole, max(1, len(whole) - len(head))))
    room = {}
    if kind == MC:
        for i in {r[0] for r in rows}:
            mine = [r for r in rows if r[0] == i]
            most = max(k for *_, k in mine)
            if max(len(w) for _, _, w, _ in mine) > window + 1 and window + 1 - most >= 1:
                room[i] = window + 1 - most
    out = []
    for i, o, whole, k in rows:
        if i in room:
            keep = whole[:len(whole) - k][-room[i]:] + whole[len(whole) - k:]
        else:
            keep = whole[-(window + 1):]
        out.append(Request(i, o, keep, min(k, len(keep) - 1), len(keep) < len(whole)))
    return out


def test_safe_cuts_split_the_tokens_and_the_others_may_not():
    """Wherever safe_cut allows, the text's tokens are its two sides' (random texts of letters,
    digits, punctuation, apostrophes and every kind of whitespace). The check can fail: cutting at
    every edge of whitespace instead (a space before a word, a run of newlines) gives other tokens."""
    from andrea.tasks.prompts import safe_cut
    tok = _wide_tokenizer()
    rng = np.random.default_rng(7)
    alphabet = list("aabbcst119..,!?'") + ["'s", "'ll", " ", " ", "\n", "\n", "\t", "\xa0", "\x1c", "\u2003", "é"]
    naive_differs = 0
    for _ in range(400):
        text = "".join(rng.choice(alphabet, int(rng.integers(1, 24))))
        whole = tok.encode(text)
        for k in range(1, len(text)):
            cut = tok.encode(text[:k]) + tok.encode(text[k:])
            if safe_cut(text, k):
                assert cut == whole, (text, k)
            elif text[k - 1].isspace() != text[k].isspace():
                naive_differs += cut != whole
    assert naive_differs > 50


def _wide_tokenizer():
    """A byte-level BPE of 600 tokens trained here on words, numbers and whitespace runs, so that
    spaces, newlines and punctuation merge with their neighbours."""
    from andrea.data.tokenizer import train_tokenizer
    import tempfile
    rng = np.random.default_rng(3)
    words = ["the", "cat", "'s", "don't", "12", "345", "...", "?!", "\n\n", "  ", "\t", "Answer:", "é"]
    texts = [" ".join(rng.choice(words, 40)) + "\n" + "\n".join(rng.choice(words, 8)) for _ in range(300)]
    with tempfile.TemporaryDirectory() as d:
        return train_tokenizer(texts, 600, Path(d) / "tok.json", progress=False)


def test_prompts_in_pieces_give_the_whole_texts_tokens(setup):
    """requests() encodes pieces (shared few-shot examples, the item's text to its last safe cut,
    each option's rest + continuation); its Requests are those of every pair encoded whole: items
    whose examples start or end with whitespace, run into the item or the continuation, empty
    queries, the continuation merging into the context's last word, at windows that cut and do not."""
    for tok in (setup[4], _wide_tokenizer()):
        ends = ["the red cat and the", "red cat sat on the mat, and then", "numbers 12 and 3", "the red ca",
                "a small do", "a b c:", "", " lead space", "trail space ", "two\n\nlines\n", "tab\there\t"]
        choices = [" dog.", "t is big", "g was old", "4 five", "!? yes", "  two spaces", "s", "\nnext", ""]
        rng = np.random.default_rng(1)
        mc = [{"query": (sentence(rng, 30) + " " if k % 3 else "") + e, "choices": choices, "gold": k % 4}
              for k, e in enumerate(ends)]
        schema = [{"context_options": [e, e + " x", "\n" + e], "continuation": c, "gold": 1}
                  for e, c in zip(ends, choices + choices)]
        lm = [{"context": e, "continuation": c} for e, c in zip(ends, choices + choices)]
        for kind, items in ((MC, mc), (SCHEMA, schema), (LM, lm)):
            for window, delimiter, k in ((16, "", 2), (64, "", 3), (64, " ", 2), (400, "\n", 5)):
                fast = requests(tok, items, kind, delimiter, k, window, range(len(items)))
                whole = _whole(tok, items, kind, delimiter, k, window)
                assert [(r.item, r.option, r.tokens, r.n_cont, r.cut) for r in fast] == \
                    [(r.item, r.option, r.tokens, r.n_cont, r.cut) for r in whole], (kind, window, delimiter)


def test_long_prompts_in_pieces_give_the_whole_texts_tokens(setup):
    """10-shot prompts of long items (words, numbers, punctuation, non-ASCII, newlines and space
    runs) keep exactly the tokens and continuation lengths of the whole text's encoding."""
    tok = setup[4]
    rng = np.random.default_rng(5)
    words = ["red", "cat", "3.14159", "1234567", "(x)", "--", "é", "über", "\n", "  ", "the", "dog,", "'s"]
    items = [{"query": " ".join(rng.choice(words, int(rng.integers(200, 900)))), "gold": 0,
              "choices": [" ".join(rng.choice(words, 1 + j)) for j in range(3)]} for _ in range(12)]
    for window in (24, 64):
        fast = requests(tok, items, MC, " ", 10, window, range(len(items)))
        slow = _whole(tok, items, MC, " ", 10, window)
        assert [(r.tokens, r.n_cont, r.cut) for r in fast] == [(r.tokens, r.n_cont, r.cut) for r in slow]
        assert all(r.cut for r in fast)


def test_requests_built_in_worker_processes_are_the_same(setup):
    """Prepared's worker processes send back the Requests build() makes in this process (packed as
    arrays, unpacked), with the items, for each task; with one task no process is started."""
    from andrea.tasks.prepare import Prepared, build, pack, unpack
    run, data, files, scorer, tok, ref = setup
    entries = [("copa", 0), ("winograd", 2), ("lambada_openai", 1)]
    with Prepared(tok, entries, data, WINDOW, limit=7, workers=2) as prep:
        assert prep.pool is not None
        for name, k in entries:
            items, reqs = build(tok, name, k, data, WINDOW, limit=7)
            assert prep.get(name) == (items, reqs) and len(reqs) >= 7
        assert prep.built_here == []
    with Prepared(tok, entries[:1], data, WINDOW) as prep:
        assert prep.pool is None and prep.get("copa") == build(tok, "copa", 0, data, WINDOW)
        assert prep.built_here == ["copa"]
    assert unpack(pack([])) == []


def test_suite_json_names_the_tasks_averaged_and_missing(setup, tmp_path, capsys):
    run, data, files, scorer, tok, ref = setup
    out = tmp_path / "tasks.json"
    rc = cli.main(["tasks", str(run), "--tasks", "core", "--task-data", str(data), "--backend", "numpy",
                   "--limit", "5", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0
    res = json.loads(out.read_text())
    core = dict(CORE)
    assert set(res["tasks"]) == {"copa", "winograd", "lambada_openai"}
    for name, t in res["tasks"].items():
        assert t["fewshot"] == core[name] and t["n"] == 5
        assert t["random_baseline"] == TASKS[name].baseline
        assert t["centered"] == pytest.approx((t["accuracy"] - t["random_baseline"]) / (1 - t["random_baseline"]))
    s = res["suite"]
    assert s["name"] == "core" and sorted(s["averaged"]) == sorted(res["tasks"])
    assert s["score"] == pytest.approx(np.mean([t["centered"] for t in res["tasks"].values()]))
    missing = {m["task"] for m in s["missing"]}
    assert missing == set(core) - set(res["tasks"]) and len(missing) == 19
    assert res["items"] == 15 and res["items_per_s"] > 0 and res["window"] == WINDOW
    assert "| copa | multiple_choice |" in printed.out and "items/s" in printed.out
    assert "shared context on" in printed.out and res["shared_context"] is True
    assert tasks_main([str(run), "--tasks", "copa", "--task-data", str(data), "--backend", "numpy", "--limit", "3",
                       "--no-shared-context", "--json", str(out)]) == 0
    assert "shared context off" in capsys.readouterr().out and json.loads(out.read_text())["shared_context"] is False
    assert "andrea tasks: arc_easy: skipped, no file" in printed.err
    assert resolve("core,copa", 1)[0][:2] == [("hellaswag_zeroshot", 1), ("jeopardy", 1)]


@pytest.mark.parametrize("line,field", [
    ('{"query": "q", "gold": 0}', "field choices is missing"),
    ('{"query": "q", "choices": ["a", "b"], "gold": 2}', "field gold is 2; expected an index into choices (0..1)"),
    ('{"query": "q", "choices": ["a"], "gold": 0}', "field choices is [\"a\"]; expected a list of two or more"),
    ('{"query": 3, "choices": ["a", "b"], "gold": 0}', "field query is 3; expected a text"),
    ('{"query": "q", "choices": ["a", "b"], "gold": true}', "field gold is true; expected an integer"),
    ('{"query": "q", "choices": ["a", "b"], "gold": 0', "not valid JSON"),
])
def test_bad_task_file_is_one_line_naming_file_line_and_field(setup, tmp_path, capsys, line, field):
    run = setup[0]
    p = tmp_path / "commonsense_reasoning" / "copa.jsonl"
    p.parent.mkdir(parents=True)
    good = '{"query": "q", "choices": ["a", "b"], "gold": 1}\n'
    p.write_text(good + "\n" + line + "\n" + good)
    rc = tasks_main([str(run), "--tasks", "copa", "--task-data", str(tmp_path), "--backend", "numpy"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith(f"andrea tasks: {p}:3: ") and field in err[0]


def test_bad_arguments_exit_2(setup, tmp_path, capsys):
    run, data = setup[0], setup[1]
    for argv, says in (([str(run), "--tasks", "nope", "--task-data", str(data)], "unknown task or suite 'nope'"),
                       ([str(run), "--tasks", "copa", "--task-data", str(tmp_path / "x")], "no such folder"),
                       ([str(run), "--tasks", "arc_easy", "--task-data", str(data)], "none of the tasks"),
                       ([str(tmp_path / "none"), "--tasks", "copa", "--task-data", str(data)], "no such file")):
        assert tasks_main(argv + ["--backend", "numpy"]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1


def test_task_scores_compared_with_a_binomial_interval():
    lo, hi = wilson(0.5, 100)
    assert 0.37 < lo < 0.38 and 0.62 < hi < 0.63 and wilson(0.0, 50)[0] == pytest.approx(0.0, abs=1e-12)
    pub = {"tasks": {"copa": {"accuracy": 0.5, "n": 100, "fewshot": 0}, "piqa": {"accuracy": 0.6, "n": 9, "fewshot": 0}}}
    near = {"tasks": {"copa": {"accuracy": 0.53, "n": 100, "fewshot": 0}}}
    far = {"tasks": {"copa": {"accuracy": 0.70, "n": 100, "fewshot": 0}}}
    assert compare_tasks(near, pub)["verdict"] == "PASS" and compare_tasks(far, pub)["verdict"] == "FAIL"
    assert compare_tasks({"tasks": {"copa": {"accuracy": 0.5, "n": 99, "fewshot": 0}}}, pub) is None


needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is not here (the benchmark files are "
                                  "not part of the repository)")


@needs_shared
def test_real_task_files_read_and_score(setup):
    """Every benchmark file of a scored kind passes the checks; a few items of each kind score."""
    run, data, files, scorer, tok, ref = setup
    present = [n for n, t in TASKS.items() if t.kind in KINDS and (SHARED / t.path).is_file()]
    assert len(present) >= 15
    for n in present:
        assert read_items(SHARED / TASKS[n].path, TASKS[n].kind)
    for n in ("arc_easy", "winogrande", "bigbench_operators"):
        res, _, _ = score_task(scorer, tok, n, 3, SHARED, limit=4)
        assert res["n"] == 4 and 0 <= res["accuracy"] <= 1


@needs_shared
@pytest.mark.parametrize("name", [n for n, t in TASKS.items() if t.kind in KINDS])
def test_real_prompts_in_pieces_give_the_whole_texts_tokens(setup, name):
    """Every real task file present: the first items' Requests, with the task's CORE few-shot count
    and ten, at a small and a GPT-2-sized window, are those of each pair encoded whole."""
    tok, t = setup[4], TASKS[name]
    if not (SHARED / t.path).is_file():
        pytest.skip(f"no {t.path} in {SHARED}")
    items = read_items(SHARED / t.path, t.kind)
    for k in sorted({dict(CORE).get(name, 0), 10}):
        for window in (64, 1024):
            fast = requests(tok, items, t.kind, t.delimiter, k, window, range(12))
            slow = _whole(tok, items, t.kind, t.delimiter, k, window, range(12))
            assert [(r.tokens, r.n_cont, r.cut) for r in fast] == [(r.tokens, r.n_cont, r.cut) for r in slow]


def test_evaluation_report_and_published_reference(setup, tmp_path):
    """The evaluate step's part: skipped with a note without eval.task_data; else the table, and a
    published reference (andrea.pipeline.publish) that keeps the task scores and compares them."""
    from andrea.pipeline import publish
    from andrea.tasks import report

    run, data, files, scorer, tok, ref = setup
    cfg, params = locate(run, prog=None).load()
    cfg.eval.tasks = "copa,winograd"
    b = report.for_report(cfg, params, tok)
    assert "eval.task_data is empty" in b["skipped"] and "Not scored: eval.task_data is empty" in report.section(b)
    cfg.eval.task_data, cfg.eval.task_limit = str(data), 7
    b = report.for_report(cfg, params, tok)
    assert set(b["tasks"]) == {"copa", "winograd"} and b["tasks"]["copa"]["n"] == 7 and b["published"] is None
    assert b["shared_context"] is True  # the path that ran, as andrea tasks' JSON says it
    text = report.section(b)
    assert "## Standard tasks" in text and "| winograd | schema |" in text and "first 7 items" in text
    res = tmp_path / "results" / "m"
    (res / "eval").mkdir(parents=True)
    (res / "trained").mkdir()
    metrics = {"exp": "m", "val_loss": 2.0, "perplexity": 7.4, "bits_per_byte": 1.0, "step": 30, "config_hash": "x",
               "overrides": [], "benchmarks": b}
    (res / "eval" / "metrics.json").write_text(json.dumps(metrics))
    (res / "trained" / "m.loss.json").write_text(json.dumps({"history": [{"step": 1, "loss": 3.0}]}))
    out = publish.publish(res, tmp_path / "m.json", "test machine", "abc")
    pub = json.loads(out.read_text())
    assert pub["tasks"]["copa"] == {k: b["tasks"]["copa"][k] for k in report.KEPT}
    assert pub["suite"]["score"] == b["suite"]["score"] and pub["task_settings"]["limit"] == 7
    assert pub["provenance"]["kernel_settings"] == publish.kernel_settings()  # the tuning defaults, or None
    again = report.for_report(cfg, params, tok, pub)
    assert again["published"]["verdict"] == "PASS" and len(again["published"]["tasks"]) == 2
    assert "**PASS**" in report.section(again)
    pub["tasks"]["copa"]["accuracy"] = 1.0 if b["tasks"]["copa"]["accuracy"] < 0.5 else 0.0
    assert report.for_report(cfg, params, tok, pub)["published"]["verdict"] == "FAIL"


def test_hub_rows_convert_to_the_jsonl_layout():
    """Each converter on a row shaped as its hub dataset's (written here: no network)."""
    from andrea.tasks.hub import HUB, arc, copa, hellaswag, lambada, mmlu, winograd, winogrande

    assert arc({"question": "Which is hot?", "choices": {"text": ["ice", "sun"], "label": ["A", "B"]},
                "answerKey": "B"}) == {"query": "Question: Which is hot?", "choices": ["ice", "sun"], "gold": 1}
    assert copa({"premise": "The man turned on the faucet.", "choice1": "The toilet filled with water.",
                 "choice2": "Water flowed from the spout.", "question": "effect", "label": 1}) == \
        {"query": "The man turned on the faucet, therefore", "choices": ["the toilet filled with water.",
                                                                         "water flowed from the spout."], "gold": 1}
    h = hellaswag({"activity_label": "Baking", "ctx": "A chef [title] mixes", "endings": ["a", "b [step] c"], "label": "1"})
    assert h["gold"] == 1 and "[" not in h["query"] + "".join(h["choices"])
    assert mmlu({"question": "2+2?", "choices": ["3", "4"], "answer": 1, "subject": "math"})["choices"] == ["A", "B"]
    w = winogrande({"sentence": "Sarah beat Maria so _ won.", "option1": "Sarah", "option2": "Maria", "answer": "1"})
    assert w == {"context_options": ["Sarah beat Maria so Sarah", "Sarah beat Maria so Maria"], "continuation": "won.", "gold": 0}
    g = winograd({"text": "The cup fell because it was full.", "pronoun": "it", "pronoun_loc": 21,
                  "options": ["the cup", "the table"], "label": 0})
    assert g["context_options"][0] == "The cup fell because the cup" and g["continuation"] == "was full."
    assert lambada({"text": "I don't care about signs"}) == {"context": "I don't care about", "continuation": "signs"}
    for name, h in HUB.items():
        assert name in TASKS and h.split in ("test", "validation")


def test_compare_and_dashboard_show_the_suite_score(tmp_path):
    """andrea compare's suite_score column and the dashboard's: eval/tasks.json served as the
    run's benchmarks record and the runs table's cell made from it."""
    import re
    import shutil
    import subprocess

    from andrea.pipeline import compare
    from andrea.pipeline.dashboard import PAGE, build_routes

    bench = {"format": "andrea-tasks/1", "tasks": {"copa": {"centered": 0.04}},
             "suite": {"name": "core", "score": 0.0123, "averaged": ["copa", "winograd"], "missing": []}}
    for name, b in (("a", bench), ("b", None)):
        run = tmp_path / name
        (run / "eval").mkdir(parents=True)
        (run / "config.yaml").write_text(f"exp: {name}\n")
        (run / "eval" / "metrics.json").write_text(json.dumps({"val_loss": 1.0, "val_batches": 2,
                                                               **({"benchmarks": b} if b else {})}))
        if b:
            (run / "eval" / "tasks.json").write_text(json.dumps(b))
    df = compare.summary([compare.read_run(tmp_path / "a"), compare.read_run(tmp_path / "b")])
    assert list(df["suite_score"].isna()) == [False, True] and df["suite_score"][0] == 0.0123
    assert "+0.0123" in compare.format_table(df)
    index, files = build_routes([tmp_path / "a"])
    url = index["runs"][0]["benchmarks"]
    assert files[url] == ((tmp_path / "a").resolve(), "eval/tasks.json")
    if shutil.which("node") is None:
        pytest.skip("needs node to run the page's script")
    fn = re.search(r"\nfunction suiteCell\(b\) \{.*?\n\}\n", PAGE.read_text(), re.S).group(0)
    js = tmp_path / "t.js"
    js.write_text(fn + f"\nconsole.log(JSON.stringify([suiteCell({json.dumps(bench)}), suiteCell({{skipped: 'x'}}), "
                       "suiteCell(null)]));\n")
    out = json.loads(subprocess.run(["node", str(js)], capture_output=True, text=True, check=True).stdout)
    assert out == ["core +0.012 (2 tasks)", "not scored", ""]


def test_bfloat16_logits_widen_exactly():
    """The argmax of bfloat16 logits is read from float32 made of their bits (CuPy has no bf16
    arithmetic): each bf16 value is the top half of the float32 of the same value."""
    from andrea.tasks.score import as_float32, widen_bf16

    f = np.random.default_rng(0).normal(0, 30, (9, 13)).astype(np.float32)
    f = (f.view(np.uint32) & 0xFFFF0000).view(np.float32)  # values bfloat16 holds exactly
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(widen_bf16(np, bits), f)
    assert as_float32(np, f) is f


def _cuda():
    from andrea.backends import cuda_available
    return cuda_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU and CuPy")
def test_cuda_scores_as_numpy_does(setup, tmp_path):
    """The same code on the CUDA kernels: in fp32 the same losses (to float32 rounding) and the same
    choice on every one of a few hundred items of each kind; in bf16 (the argmax read from widened
    bfloat16 logits) the same choices but for near-ties."""
    run, data, files, scorer, tok, ref = setup
    write_tasks(tmp_path, seed=3, n=200)
    cu32, _, _ = load_model(run, backend="cuda", precision="fp32", batch_tokens=512)
    cu16, _, _ = load_model(run, backend="cuda", precision="bf16", batch_tokens=512)
    whole, _, _ = load_model(run, backend="cuda", precision="fp32", batch_tokens=512, shared=False)
    for name in ("copa", "winograd", "lambada_openai"):
        res, picked, (reqs, loss, count, greedy) = score_task(scorer, tok, name, 1, tmp_path)
        res32, picked32, (_, loss32, _, greedy32) = score_task(cu32, tok, name, 1, tmp_path)
        assert (cu32.last["shared"] > len(reqs) / 4) == (name == "copa")  # the shared context's path
        np.testing.assert_allclose(loss32, loss, rtol=1e-4, atol=1e-4)
        assert list(picked32) == list(picked) and res32["accuracy"] == res["accuracy"]
        _, picked_whole, (_, loss_whole, _, _) = score_task(whole, tok, name, 1, tmp_path)
        np.testing.assert_allclose(loss32, loss_whole, rtol=1e-4, atol=1e-4)
        assert list(picked_whole) == list(picked32)
        res16, picked16, _ = score_task(cu16, tok, name, 1, tmp_path)
        assert np.mean(np.asarray(picked16) == np.asarray(picked)) >= 0.9
