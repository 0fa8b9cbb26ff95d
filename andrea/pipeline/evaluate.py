"""Evaluate a trained run: held-out loss, samples, synthetic-task accuracy, loss curve, report.

    python -m andrea.pipeline.evaluate --config results/ANDREA-tiny/config.yaml \
        --checkpoint-dir results/ANDREA-tiny/archive/final \
        --loss results/ANDREA-tiny/ANDREA-tiny.loss.json \
        --val-conversations data/synthetic/megachat/val.parquet \
        --train-conversations data/synthetic/megachat/train.parquet \
        --out-dir results/ANDREA-tiny [--published docs/published/ANDREA-tiny.json]

Writes `<out>/report.md` and `<out>/eval/{metrics.json, loss.png, samples.json, synthetic.json,
tasks.json}`: synthetic.json the synthetic tasks' rows, tasks.json the standard tasks of eval.tasks
(scored by andrea/tasks/report.py).

- Validation loss: mean cross-entropy over the first eval.batches batches of the validation windows
  (andrea.data.loader.val_windows, the same windows training validates on); perplexity = exp(loss); bits per
  byte = loss / ln 2 * tokens / bytes of those target tokens (a special token counts the bytes of
  its literal text), which compares across vocabularies.
- Samples: eval.prompts through the chat template, eval.temperature, seeded with eval.seed + i
  (andrea.use.sampling, the same sampling as the samples training records). Samples and task answers
  are decoded by the KV-cache decoder (andrea/use/inference.py) on NumPy in fp32 from the checkpoint's
  weights, whatever backend computed the loss: the same text on every machine.
- Tasks (data.source=synthetic): the first eval.n_tasks held-out val conversations, answered
  greedily; exact match against the answer recomputed from the question. Reported beside the
  uniform-guess chance and the best constant answer per task kind learnt from the train split.
- Uniform guess: ln V with V the tokenizer's real vocabulary (a small corpus can give fewer
  tokens than model.vocab_size asks; the report then says so).
- Published (docs/published/<experiment>.json): PASS when |val_loss - published val_loss| <=
  eval.tolerance, FAIL otherwise, and the verdict says so: it compares that one figure, not the
  tasks, the samples or the bits; only for the published config itself: a run with overrides
  (config `overrides`, except where data lives and the backend) is "not compared", naming them.
  The published curve is drawn dashed, over this run's, so it shows where the two coincide.
- Bit for bit: whether every logged training loss equals the published run's, and if not, what
  the two records say differs (provenance: commit, numpy, Python, GPU, backend, and a sha256 of the
  kernel sources, kernels/ and the NumPy reference), or that the published reference does not say.
- Tasks under a baseline (uniform-guess chance, the best constant answer) are marked as such.
- Two validation figures exist for the final checkpoint: the report's (eval.batches batches) and
  training's last (train.eval_batches batches, same windows, fewer or more of them); each is
  printed with its batch count.
- Loss plot: linear cross-entropy axis, or logarithmic with eval.log_scale=true (or --log-scale).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional


from ..util.atomic import atomic_savefig, atomic_write
from ..config import AndreaConfig, load_run_config
from ..data.loader import val_windows
from ..use import sampling
from ..tasks import report as task_report
from .runs import compared_overrides

TASK_TOKENS = 16  # the longest synthetic answer ("0 1 2 3 4") is 9 characters, 9 tokens at most


def uniform_guess(tok, cfg: AndreaConfig) -> dict:
    """ln V of a uniform guess over the tokenizer's real vocabulary (not model.vocab_size's rows)."""
    real = getattr(tok, "vocab_size", None)  # a stand-in without one: the model's rows
    v = min(int(real), cfg.model.vocab_size) if real else cfg.model.vocab_size
    return {"uniform_loss": math.log(v), "tokenizer_vocab": v, "model_vocab": cfg.model.vocab_size}


def held_out_loss(eng, tok, cfg: AndreaConfig) -> dict:
    t = cfg.train
    batches = val_windows(cfg.data.val_shards, t.batch_size, t.seq_len, cfg.eval.batches)
    loss = eng.val_loss(batches)
    nbytes = tok.token_bytes(cfg.model.vocab_size)
    n_tok = sum(y.size for _, y in batches)
    n_bytes = int(sum(nbytes[y].sum() for _, y in batches))
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "batch_size": t.batch_size,
            "seq_len": t.seq_len,
            "bits_per_byte": loss / math.log(2) * n_tok / max(1, n_bytes),
            "val_tokens": n_tok, "val_bytes": n_bytes, "val_batches": len(batches), **uniform_guess(tok, cfg)}


def decoder(cfg: AndreaConfig, params):
    """A NumPy KV-cache decoder over the trained positions (train.seq_len), weights loaded."""
    from ..backends import get_backend
    from ..use.inference import Decoder

    dec = Decoder(cfg.model, get_backend("numpy"), min(cfg.model.context, cfg.train.seq_len))
    dec.load(params)
    return dec


def complete(dec, tok, prompt: str, max_new: int, temperature: float, seed: int) -> str:
    return sampling.complete(sampling.decoder_generate(dec), tok, prompt, max_new, temperature, seed)


def read_exchanges(path: Path, limit: int = 0) -> list:
    """(question, reference answer) of synthetic-task conversations in a megachat split."""
    import pyarrow.parquet as pq

    from ..data import synthetic
    from ..data.chat import ConversationError, first_exchange

    out = []
    for row in pq.read_table(path, columns=["conversations"]).column(0).to_pylist():
        try:
            q, a = first_exchange(row)
            synthetic.kind_of(q)
        except (ConversationError, ValueError):
            continue
        out.append((q, a))
        if limit and len(out) == limit:
            break
    return out


def task_accuracy(dec, tok, cfg: AndreaConfig, val_path: Path, train_path: Optional[Path]) -> dict:
    import pandas as pd

    from ..data import synthetic

    tasks = read_exchanges(val_path, cfg.eval.n_tasks)
    if not tasks:
        raise ValueError(f"{val_path}: no synthetic-task conversations to evaluate")
    majority = {}
    if train_path is not None:
        by_kind = defaultdict(Counter)
        for q, a in read_exchanges(train_path):
            by_kind[synthetic.kind_of(q)][a] += 1
        majority = {k: c.most_common(1)[0][0] for k, c in by_kind.items()}
    rows, scored = [], []
    for q, ref in tasks:
        got = complete(dec, tok, q, min(TASK_TOKENS, cfg.eval.max_new_tokens), 0.0, cfg.eval.seed)
        kind, right = synthetic.kind_of(q), synthetic.answer(q)
        ok = synthetic.is_correct(q, got)
        rows.append({"kind": kind, "question": q, "answer": right, "completion": got, "correct": ok,
                     "reference_matches": ref == right})
        scored.append({"kind": kind, "correct": int(ok), "chance": synthetic.chance(q),
                       "majority": int(majority.get(kind) == right)})
    df = pd.DataFrame(scored)
    kinds = df.groupby("kind").agg(n=("correct", "size"), accuracy=("correct", "mean"),
                                   chance=("chance", "mean"), majority_baseline=("majority", "mean"))
    if not majority:  # no train split: no constant-answer baseline
        kinds["majority_baseline"] = None
    summary = {"n": len(df), "accuracy": float(df["correct"].mean()), "chance": float(df["chance"].mean()),
               "majority_baseline": float(df["majority"].mean()) if majority else None,
               "per_kind": kinds.astype(object).to_dict(orient="index")}
    return {"summary": summary, "rows": rows}


def history_of(obj) -> list:
    """The step records of a loss file: the proxy's {"history": [...]} or a bare list."""
    hist = obj.get("history") if isinstance(obj, dict) else obj
    if not isinstance(hist, list):
        raise ValueError("loss file: expected a JSON object with a 'history' list, or a list of records")
    return [r for r in hist if isinstance(r, dict) and isinstance(r.get("step"), int)]


def curves(hist: list) -> dict:
    tr = [(r["step"], r["loss"]) for r in hist if r.get("loss") is not None]
    va = [(r["step"], r["val_loss"]) for r in hist if r.get("val_loss") is not None]
    return {"train": tr, "val": va}


def plot(path: Path, exp: str, mine: dict, published: Optional[dict], uniform: float,
         log_scale: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if mine["train"]:
        ax.plot(*zip(*mine["train"]), color="C0", lw=1, alpha=0.8, label="train")
    if mine["val"]:
        ax.plot(*zip(*mine["val"]), "o-", color="C1", ms=3, label="val")
    if published is not None:  # drawn last, dashed and dark: visible where it coincides with this run
        pc = curves(published.get("history", []))
        if pc["train"]:
            ax.plot(*zip(*pc["train"]), "--", color="k", lw=1.2, label="published train")
        if pc["val"]:
            ax.plot(*zip(*pc["val"]), "s:", color="C2", lw=1.5, ms=4, mfc="none", label="published val")
    ax.axhline(uniform, color="C3", ls=":", lw=1, label=f"uniform guess (ln V = {uniform:.2f})")
    ax.set_xlabel("optimizer step")
    if log_scale:
        ax.set_yscale("log")
        ax.set_ylabel("cross-entropy (nats, log scale)")
    else:
        ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(exp)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def training_summary(hist: list, state: Optional[dict]) -> dict:
    """Speed and size of the training run from its records: the median tokens/s of the logged steps
    (the first tenth left out: start-up, compilation and graph capture), the engine's wall time at
    its last logged step, and the memory plan's bytes (from the run's state file)."""
    import pandas as pd

    df = pd.DataFrame([r for r in hist if r.get("tokens_per_s") is not None], columns=["step", "tokens_per_s", "wall_s"])
    steady = df[df["step"] > df["step"].max() / 10] if len(df) >= 10 else df
    return {"tokens_per_s": float(steady["tokens_per_s"].median()) if len(steady) else None,
            "train_wall_s": float(df["wall_s"].dropna().iloc[-1]) if df["wall_s"].notna().any() else None,
            "plan_bytes": (state or {}).get("plan_bytes")}


def same_losses(hist: list, published: dict) -> dict:
    """How many of the published run's logged training losses this run reproduces bit for bit."""
    mine = {r["step"]: r["loss"] for r in hist if r.get("loss") is not None}
    ref = {r["step"]: r["loss"] for r in history_of(published) if r.get("loss") is not None}
    common = sorted(set(mine) & set(ref))
    return {"steps": len(common), "identical": sum(mine[s] == ref[s] for s in common),
            "first_difference": next((s for s in common if mine[s] != ref[s]), None)}


def compare(metrics: dict, published: dict, tolerance: float, source: Path, hist: Optional[list] = None) -> dict:
    ref = published.get("val_loss")
    if not isinstance(ref, (int, float)):
        raise ValueError(f"{source}: field val_loss is {ref!r}; expected a number")
    diff = metrics["val_loss"] - ref
    out = {"file": str(source), "val_loss": ref, "diff": diff, "tolerance": tolerance,
           "verdict": "PASS" if abs(diff) <= tolerance else "FAIL",
           "machine": published.get("machine"), "accuracy": published.get("task_accuracy"),
           "commit": published.get("commit"), "training": {k: published.get(k) for k in TRAINING_FIELDS},
           "provenance": published_provenance(published)}
    if hist:
        out["losses"] = same_losses(hist, published)
    return out


TRAINING_FIELDS = ("tokens_per_s", "train_wall_s", "plan_bytes")
PROVENANCE = ("commit", "numpy", "python", "gpu", "backend", "kernels")  # what a bitwise rerun needs alike


def kernel_fingerprint() -> str:
    """sha256 of the kernel sources a run computes with: kernels/ (the CUDA files) and the NumPy
    reference (andrea/backends/ref/), each file's name and bytes, in name order."""
    import hashlib

    from ..backends import ref
    from ..paths import KERNEL_DIR

    h = hashlib.sha256()
    files = sorted(Path(KERNEL_DIR).glob("*.cu*")) + sorted(Path(ref.__file__).parent.glob("*.py"))
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def provenance(cfg: AndreaConfig, checkpoint_dir: Path) -> dict:
    """What this run was computed with (PROVENANCE): the archive's manifest.json environment where
    there is one (written beside the final checkpoint), the config's backend, the kernel sources."""
    man = Path(checkpoint_dir) / "manifest.json"
    env = {}
    if man.is_file():
        try:
            env = json.loads(man.read_text()).get("environment") or {}
        except (OSError, json.JSONDecodeError):
            env = {}
    commit = env.get("git_commit") or git_commit()
    return {"commit": commit[:12] if commit else None, "numpy": env.get("numpy"), "python": env.get("python"),
            "gpu": env.get("gpu"), "backend": cfg.backend.name, "kernels": kernel_fingerprint()}


def published_provenance(published: dict) -> dict:
    """The published reference's PROVENANCE fields: its "provenance" object, else the top-level
    commit and, from an "environment" object, numpy, python and gpu; None where it records none."""
    got = dict(published.get("provenance") or {})
    env = published.get("environment") or {}
    got.setdefault("commit", published.get("commit"))
    for k in ("numpy", "python", "gpu"):
        got.setdefault(k, env.get(k))
    got.setdefault("kernels", published.get("kernels"))
    return {k: (str(got[k])[:12] if k == "commit" and got.get(k) else got.get(k)) for k in PROVENANCE}


def bitwise_line(losses: dict, here: dict, there: dict) -> str:
    """Whether the run reproduced the published one bit for bit, and if not, what differs."""
    n, same = losses["steps"], losses["identical"]
    if same == n:
        return f"Bit for bit: **reproduced**, all {n} logged training losses equal the published run's."
    line = (f"Bit for bit: **not reproduced**, {same} of {n} logged training losses equal the published "
            f"run's (first difference at step {losses['first_difference']}).")
    differ = [f"{k} `{here[k]}` here, `{there[k]}` there" for k in PROVENANCE
              if here.get(k) is not None and there.get(k) is not None and here[k] != there[k]]
    unknown = [k for k in PROVENANCE if there.get(k) is None]
    if differ:
        line += " What differs: " + "; ".join(differ) + "."
    if unknown:
        line += (" The published reference does not record its " + ", ".join(unknown)
                 + (", so the cause cannot be named from the records." if not differ else "."))
    elif not differ:
        line += (" Commit, numpy, Python, GPU, backend and kernel sources are recorded alike: a difference "
                 "to investigate.")
    return line


def verdict_line(m: dict, c: dict) -> str:
    """The verdict and what it compared: the validation loss alone, its batches, the tolerance."""
    within = "within" if c["verdict"] == "PASS" else "not within"
    return (f"**{c['verdict']}**: validation loss {m['val_loss']:.4f} ({batches_words(m)}) {within} "
            f"{c['tolerance']} of the published {c['val_loss']:.4f} (difference {c['diff']:+.4f}); `{c['file']}`"
            + (f", measured on {c['machine']}" if c.get("machine") else "")
            + (f" at commit {c['commit']}" if c.get("commit") else "")
            + ". The verdict compares this one figure: not the task accuracy, the samples or the bits.")


def batches_words(m: dict) -> str:
    b = f"{m['val_batches']} batches"
    return b + (f" of {m['batch_size']} x {m['seq_len']} tokens" if m.get("batch_size") else "")


def under_baseline(acc: float, chance, constant) -> str:
    """A mark for an accuracy not above a baseline ("" when above both)."""
    marks = []
    if chance is not None and acc <= chance:
        marks.append(f"not above chance ({chance:.3f})")
    if constant is not None and acc <= constant:
        marks.append(f"not above the constant answer ({constant:.3f})")
    return "; ".join(marks)


def training_val(hist: list, step: int) -> Optional[float]:
    """Training's own validation loss at step (None when it measured none there)."""
    vals = [r["val_loss"] for r in hist if r.get("step") == step and r.get("val_loss") is not None]
    return vals[-1] if vals else None


def report_md(m: dict) -> str:
    ov = m.get("overrides") or []
    uni = f"| uniform guess, ln V (V = {m.get('tokenizer_vocab', '?')}) | {m['uniform_loss']:.4f} |"
    if m.get("tokenizer_vocab") is not None and m["tokenizer_vocab"] < m.get("model_vocab", 0):
        uni = (f"| uniform guess, ln V (V = {m['tokenizer_vocab']} tokens of the tokenizer; "
               f"model.vocab_size asked {m['model_vocab']}) | {m['uniform_loss']:.4f} |")
    L = [f"# {m['exp']}: evaluation", "",
         f"Checkpoint `{m['checkpoint']}` (step {m['step']}), config_hash `{m['config_hash'][:12]}`.", "",
         "Overrides: " + (" ".join(f"`{o}`" for o in ov) if ov else "none (the experiment's pinned config)."), "",
         "| metric | value |", "| --- | --- |",
         f"| validation loss (nats; {batches_words(m)}, eval.batches) | {m['val_loss']:.4f} |",
         uni,
         f"| perplexity | {m['perplexity']:.3f} |",
         f"| bits per byte | {m['bits_per_byte']:.4f} |",
         f"| held-out tokens | {m['val_tokens']:,} ({m['val_batches']} batches) |"]
    tv = m.get("training_val")
    if tv:
        L.append(f"| training's validation loss at step {m['step']} ({tv['batches']} batches, train.eval_batches) "
                 f"| {tv['val_loss']:.4f} |")
    t = m.get("tasks")
    if t:
        maj = "n/a" if t["majority_baseline"] is None else f"{t['majority_baseline']:.3f}"
        mark = under_baseline(t["accuracy"], t["chance"], t["majority_baseline"])
        L += [f"| task exact match | {t['accuracy']:.3f} of {t['n']}" + (f" (**{mark}**)" if mark else "") + " |",
              f"| uniform-guess chance | {t['chance']:.3f} |",
              f"| best constant answer per kind | {maj} |", "",
              "| task | n | exact match | chance | constant answer | against its baselines |",
              "| --- | --- | --- | --- | --- | --- |"]
        for k, p in t["per_kind"].items():
            maj = "n/a" if p["majority_baseline"] is None else f"{p['majority_baseline']:.3f}"
            mark = under_baseline(p["accuracy"], p["chance"], p["majority_baseline"])
            L.append(f"| {k} | {p['n']} | {p['accuracy']:.3f} | {p['chance']:.3f} | {maj} | "
                     + (f"**{mark}**" if mark else "above both") + " |")
    c = m.get("published")
    tr = m.get("training") or {}
    if any(v is not None for v in tr.values()):
        pub = (c or {}).get("training") or {}
        fmt = {"tokens_per_s": lambda v: f"{v:,.0f}", "train_wall_s": lambda v: f"{v:,.1f} s",
               "plan_bytes": lambda v: f"{v / 2**30:.3f} GiB"}
        names = {"tokens_per_s": "training tokens/s (median)", "train_wall_s": "training wall time",
                 "plan_bytes": "memory plan"}
        L += ["", "## Training", "", "| | this run | published |", "| --- | --- | --- |"]
        for k in TRAINING_FIELDS:
            L.append(f"| {names[k]} | {'n/a' if tr.get(k) is None else fmt[k](tr[k])} | "
                     f"{'n/a' if pub.get(k) is None else fmt[k](pub[k])} |")
    L += ["", "## Against the published run", ""]
    if c:
        L += [verdict_line(m, c)]
        ls = c.get("losses")
        if ls and ls["steps"]:
            L += ["", bitwise_line(ls, m.get("provenance") or {}, c.get("provenance") or {})]
    elif m.get("not_compared"):
        L += [f"Not compared: {m['not_compared']}."]
    else:
        L += ["No published run for this experiment (docs/published/<exp>.json)."]
    L += ["", "## Loss curve", "", "![loss curve](eval/loss.png)", "", "## Samples", ""]
    for s in m["samples"]:
        L += [f"- **{s['prompt']}** → `{s['completion']}`"]
    L += ["", f"Evaluated in {m['wall_s']:.1f} s on backend `{m['backend']}`.", ""]
    return "\n".join(L)


def find_checkpoint(d: Path) -> Path:
    """The checkpoint to evaluate in d: the archived step_XXXXXXXX.bin, or a finished run's trained/final.bin."""
    bins = sorted(d.glob("step_*.bin"))
    if not bins and (d / "final.bin").is_file():
        return d / "final.bin"
    if len(bins) != 1:
        raise FileNotFoundError(f"{d}: expected exactly one step_XXXXXXXX.bin (the archived final checkpoint) "
                                f"or a final.bin (a finished run's trained/), found {len(bins)} step files")
    return bins[0]


def evaluate(a) -> dict:
    from ..config import config_hash
    from ..data.tokenizer import load_tokenizer
    from ..core.engine import Engine

    t0 = time.time()
    cfg = load_run_config(a.config)
    tok = load_tokenizer(cfg.data.tokenizer)
    ckpt = find_checkpoint(a.checkpoint_dir)
    eng = Engine(cfg)
    c = eng.load_checkpoint(ckpt, config_hash(cfg))  # the path training resumes through, as checked
    m = {"exp": cfg.exp, "overrides": list(cfg.overrides), "checkpoint": str(ckpt), "step": c.step,
         "config_hash": config_hash(cfg), "backend": eng.be.name, **held_out_loss(eng, tok, cfg)}
    if m["tokenizer_vocab"] < cfg.model.vocab_size:
        print(f"andrea.pipeline.evaluate: WARNING: the tokenizer {cfg.data.tokenizer} has {m['tokenizer_vocab']} tokens, "
              f"model.vocab_size asks {cfg.model.vocab_size}: the uniform guess is ln {m['tokenizer_vocab']}",
              file=sys.stderr)
    dec = decoder(cfg, c.params)
    m["samples"] = sampling.sample_prompts(sampling.decoder_generate(dec), tok, cfg.eval)
    tasks = None
    if cfg.data.source == "synthetic" and cfg.eval.n_tasks > 0:
        tasks = task_accuracy(dec, tok, cfg, a.val_conversations, a.train_conversations)
        m["tasks"] = tasks["summary"]
    hist = history_of(json.loads(Path(a.loss).read_text())) if a.loss else []
    state_path = Path(a.loss).with_name(Path(a.loss).name.replace(".loss.json", ".state.json")) if a.loss else None
    state = json.loads(state_path.read_text()) if state_path and state_path.is_file() else None
    m["training"] = training_summary(hist, state)
    m["provenance"] = provenance(cfg, a.checkpoint_dir)
    tv = training_val(hist, c.step)
    if tv is not None:
        m["training_val"] = {"val_loss": tv, "batches": cfg.train.eval_batches}
    published = None
    if a.published and Path(a.published).is_file():
        published = json.loads(Path(a.published).read_text())
        differ = compared_overrides(cfg.overrides)
        if differ:  # the published run is of the pinned config: a verdict against it would mislead
            m["not_compared"] = f"overrides {' '.join(differ)} (the published run `{a.published}` is of the pinned config)"
        else:
            m["published"] = compare(m, published, cfg.eval.tolerance, Path(a.published), hist)
    # the standard tasks of eval.tasks (docs/EVALUATION.md), compared only where the run is
    m["benchmarks"] = task_report.for_report(cfg, c.params, tok, published if m.get("published") else None)
    out = Path(a.out_dir)
    plot(out / "eval" / "loss.png", cfg.exp, curves(hist), published, m["uniform_loss"],
         log_scale=a.log_scale or cfg.eval.log_scale)
    m["wall_s"] = time.time() - t0
    atomic_write(out / "eval" / "samples.json", json.dumps(m["samples"], indent=1) + "\n")
    atomic_write(out / "eval" / "synthetic.json", json.dumps(tasks["rows"] if tasks else [], indent=1) + "\n")
    atomic_write(out / "eval" / "metrics.json", json.dumps(m, indent=1) + "\n")
    atomic_write(out / "eval" / "tasks.json", json.dumps(m["benchmarks"], indent=1) + "\n")
    atomic_write(out / "report.md", report_md(m) + task_report.section(m["benchmarks"]))
    if a.write_published:
        write_published(Path(a.write_published), m, hist, a.machine, a.commit or git_commit())
    return m


def git_commit() -> Optional[str]:
    """The commit of the source tree this runs from, when it is a git checkout (else None)."""
    import subprocess
    try:
        r = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def write_published(path: Path, m: dict, hist: list, machine: str, commit: Optional[str] = None) -> None:
    """Freeze this evaluation as the published reference of its experiment."""
    keep = ("step", "loss", "val_loss")
    pub = {"exp": m["exp"], "val_loss": m["val_loss"], "perplexity": m["perplexity"],
           "bits_per_byte": m["bits_per_byte"], "step": m["step"], "config_hash": m["config_hash"],
           "task_accuracy": (m.get("tasks") or {}).get("accuracy"), "machine": machine, "commit": commit,
           **task_report.published_fields(m),
           "provenance": {**(m.get("provenance") or {}), **({"commit": commit[:12]} if commit else {})},
           **(m.get("training") or {}),
           "history": [{k: r[k] for k in keep if r.get(k) is not None} for r in hist]}
    atomic_write(path, json.dumps(pub, indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m andrea.pipeline.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=Path, help="resolved config of the run")
    ap.add_argument("--checkpoint-dir", required=True, type=Path, help="folder with the final step_*.bin + .json")
    ap.add_argument("--loss", type=Path, help="<exp>.loss.json of the run")
    ap.add_argument("--val-conversations", type=Path, help="megachat val.parquet (synthetic tasks)")
    ap.add_argument("--train-conversations", type=Path, help="megachat train.parquet (constant-answer baseline)")
    ap.add_argument("--published", type=Path, help="docs/published/<exp>.json, compared when it exists")
    ap.add_argument("--out-dir", required=True, type=Path)
    ap.add_argument("--write-published", type=Path, help="also write this run as a published reference")
    ap.add_argument("--machine", default="", help="machine description stored with --write-published")
    ap.add_argument("--commit", default="", help="commit stored with --write-published (default: git rev-parse)")
    ap.add_argument("--log-scale", action="store_true", help="logarithmic loss axis (also eval.log_scale=true)")
    a = ap.parse_args(argv)
    m = evaluate(a)
    t = m.get("tasks")
    print(f"andrea.pipeline.evaluate: {m['exp']}: val_loss {m['val_loss']:.4f} ({m['val_batches']} batches; "
          f"uniform {m['uniform_loss']:.4f}), "
          f"bpb {m['bits_per_byte']:.4f}" + (f", tasks {t['accuracy']:.3f} (chance {t['chance']:.3f})" if t else "")
          + (f", {m['published']['verdict']} vs published" if m.get("published") else "")
          + (f", not compared: {m['not_compared']}" if m.get("not_compared") else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
