"""An independent check of andrea/tasks: the same zero-shot multiple-choice items scored by
lm-evaluation-harness (`pip install lm-eval`, in the dev extra) on the run's Hugging Face export
(`andrea export RUN --format hf`, PyTorch's GPT-2 on the CPU), through a custom task that reads a
local JSONL file. Skipped where lm-eval is not installed; to run it alone:

    pip install 'lm-eval[hf]' && pytest -q tests/test_tasks_lmeval.py

Both sides get the same text: our prompt's context (the document token, the query, the delimiter)
and each choice, with lm-eval's target_delimiter "" so it adds nothing between them; both split a
pair the same way (the context's trailing whitespace moved to the continuation, the whole encoded
once). lm-eval gives each choice's summed log-likelihood; our choice is the lowest mean loss per
token, so its choice is read from its log-likelihoods divided by the same token counts. Where the
two runs differ it can only be by float32 rounding in two implementations of one model (ours
NumPy, its PyTorch): an item may then differ only when its two best options are within that
rounding of each other.
"""
import json
import os

import numpy as np
import pytest

from andrea import cli
from andrea.tasks.prompts import pairs
from andrea.tasks.run import load_model, score_task
from andrea.tasks.suites import MC

from tasks_model import make_model, write_tasks

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[hf]'; in the dev extra)")
pytest.importorskip("accelerate", reason="lm-eval's Hugging Face model needs accelerate (pip install 'lm-eval[hf]')")

N_ITEMS = 300
TIE = 1e-4  # nats per token: float32 rounding of a ~60-position forward pass, two implementations

TASK_YAML = """task: andrea_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
"""


def test_lm_eval_makes_the_same_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    run = make_model(tmp_path, context=64)
    files = write_tasks(tmp_path / "data", seed=1, n=N_ITEMS)
    assert cli.main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    scorer, tok, _ = load_model(run, backend="numpy")
    res, picked, (reqs, loss, count, _) = score_task(scorer, tok, "copa", 0, tmp_path / "data")
    assert not res["truncated"]
    items = [json.loads(line) for line in files["copa"].read_text().splitlines()]
    rows = [{"context": pairs(items, i, MC, " ", 0)[0][0], "choices": it["choices"], "gold": it["gold"]}
            for i, it in enumerate(items)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "yaml").mkdir()
    (tmp_path / "yaml" / "andrea_mc.yaml").write_text(TASK_YAML.format(data=tmp_path / "mc.jsonl"))

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32,device=cpu",
                          tasks=["andrea_mc"], task_manager=TaskManager(include_path=str(tmp_path / "yaml")),
                          batch_size=64, log_samples=True)
    samples = sorted(out["samples"]["andrea_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == N_ITEMS
    ll = [np.array([float(r[0]) for r in s["filtered_resps"]]) for s in samples]
    ours = {}
    for r, L, k in zip(reqs, loss, count):
        ours.setdefault(r.item, []).append((L, k))
    differ, worst = [], 0.0
    for i, theirs in enumerate(ll):
        L = np.array([o[0] for o in ours[i]])
        k = np.array([o[1] for o in ours[i]])
        worst = max(worst, float(np.abs(L + theirs).max()))
        mean = -theirs / k
        if int(np.argmin(mean)) != picked[i]:
            top = np.sort(mean)
            differ.append((i, float(top[1] - top[0])))
    # the same model in two implementations: the same summed loss of every choice ...
    assert worst < 1e-4, f"largest |our loss - lm-eval's| over {sum(len(x) for x in ll)} choices: {worst:.2e}"
    # ... and the same choice on every item, except where its two best options tie within rounding
    assert all(margin < TIE for _, margin in differ), differ
    assert len(differ) <= 2
    # lm-eval's own accuracy (the summed log-likelihood's argmax), read from the same numbers as ours
    acc_sum = np.mean([int(np.argmax(x)) == it["gold"] for x, it in zip(ll, items)])
    assert out["results"]["andrea_mc"]["acc,none"] == pytest.approx(acc_sum)
    print(f"lm-eval: {N_ITEMS} items, {len(differ)} choices differ (margins {[m for _, m in differ]}), "
          f"largest loss difference {worst:.2e} nats; our accuracy {res['accuracy']:.4f}, lm-eval's acc "
          f"(summed log-likelihood) {acc_sum:.4f}")
