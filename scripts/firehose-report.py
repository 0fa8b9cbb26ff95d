"""Compare data mixers from their runs' records: a table (markdown) and a plot (PNG).

    python scripts/firehose-report.py --runs results/ANDREA-firehose/sweep \
        --table results/ANDREA-firehose/mixers.md --plot docs/firehose-pilot.png

Each run folder under --runs (any depth) with a config.yaml and a <exp>.loss.json is one run; its
arm is data.mixer.kind (plus the reward for the bandit), its seed train.seed. Per run: the last
held-out loss of every group (group_val_loss), their mean over the groups other than --noise, and
the share of steps drawn from each group. The table is the mean (and, over seeds, the spread) per
arm at equal steps; the plot shows each arm's mixture over the steps and the noise group's share.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import yaml


def load_runs(root: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per run, one row per run x logged step x group with its probability)."""
    rows, mixes = [], []
    for cfg_path in sorted(root.rglob("config.yaml")):
        run = cfg_path.parent
        cfg = yaml.safe_load(cfg_path.read_text())
        loss_path = run / f"{cfg['exp']}.loss.json"
        if not loss_path.is_file():
            continue
        hist = json.loads(loss_path.read_text())["history"]
        mx = cfg["data"]["mixer"]
        arm = mx["kind"] if mx["kind"] != "bandit" else f"bandit-{mx['reward']}"
        steps = pd.DataFrame([h for h in hist if "group" in h])
        vals = [h for h in hist if h.get("group_val_loss")]
        if steps.empty or not vals:
            raise SystemExit(f"firehose-report: {loss_path}: no per-group records (group, group_val_loss); "
                             "was it trained with data.groups and train.eval_every?")
        last = vals[-1]
        row = {"run": run.name, "arm": arm, "seed": cfg["train"]["seed"], "steps": int(steps["step"].max()),
               "val_step": last["step"]}
        row.update({f"val_{g}": v for g, v in last["group_val_loss"].items()})
        row.update({f"share_{g}": s for g, s in steps["group"].value_counts(normalize=True).items()})
        rows.append(row)
        m = pd.DataFrame([{"step": h["step"], **h["mix"]} for h in hist if "mix" in h])
        m = m.melt(id_vars="step", var_name="group", value_name="p")
        m["arm"], m["seed"] = arm, row["seed"]
        mixes.append(m)
    if not rows:
        raise SystemExit(f"firehose-report: no runs (config.yaml + <exp>.loss.json) under {root}")
    return pd.DataFrame(rows), pd.concat(mixes, ignore_index=True)


def summary(runs: pd.DataFrame, noise: str) -> pd.DataFrame:
    val_cols = [c for c in runs if c.startswith("val_") and c != "val_step"]
    share_cols = [c for c in runs if c.startswith("share_")]
    runs = runs.copy()
    runs[share_cols] = runs[share_cols].fillna(0.0)
    learnable = [c for c in val_cols if c != f"val_{noise}"]
    runs["val_learnable_mean"] = runs[learnable].mean(axis=1)
    cols = ["val_learnable_mean", *learnable, f"share_{noise}"]
    g = runs.groupby("arm")
    table = g[cols].mean()
    table["val_learnable_spread"] = g["val_learnable_mean"].agg(lambda s: s.max() - s.min())
    table.insert(0, "seeds", g["seed"].nunique())
    table.insert(1, "steps", g["steps"].max())
    return table.round(3)


def markdown(df: pd.DataFrame) -> str:
    """A pipe table of df (its index as the first column)."""
    df = df.reset_index()
    cells = df.astype(str).values.tolist()
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])


def plot(mixes: pd.DataFrame, path: Path, noise: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean = mixes.groupby(["arm", "step", "group"], sort=False)["p"].mean().unstack("group")
    arms = list(dict.fromkeys(mixes["arm"]))
    fig, axes = plt.subplots(1, len(arms) + 1, figsize=(4 * (len(arms) + 1), 3.2), sharey=True)
    for ax, arm in zip(axes, arms):
        m = mean.loc[arm]
        ax.stackplot(m.index, *[m[c] for c in m.columns], labels=list(m.columns))
        ax.set_title(f"{arm}: mixture")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("probability (mean over seeds)")
    axes[0].legend(loc="lower left", fontsize=7)
    ax = axes[-1]
    for arm in arms:
        ax.plot(mean.loc[arm].index, mean.loc[arm][noise], label=arm)
    ax.set_title(f"p({noise})")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, type=Path)
    ap.add_argument("--table", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--noise", default="noise", help="the unlearnable group's name")
    a = ap.parse_args(argv)
    runs, mixes = load_runs(a.runs)
    text = markdown(summary(runs, a.noise))
    print(text)
    if a.table:
        from andrea.atomic import atomic_write
        atomic_write(a.table, text + "\n")
    if a.plot:
        plot(mixes, a.plot, a.noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
