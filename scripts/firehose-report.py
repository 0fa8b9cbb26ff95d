"""Compare data mixers from their runs' records: a table (markdown) and a plot (PNG).

    python scripts/firehose-report.py --runs results/ANDREA-12M-firehose/mixers \
        --table mixers.md --plot mixers.png --report report.md \
        [--published docs/published/ANDREA-12M-firehose-mixers.json] [--write-published FILE --machine TEXT]

Each run folder under --runs (any depth) with a config.yaml and a <exp>.loss.json is one run; its
arm is data.mixer.kind (plus the reward for the bandit), its seed train.seed. Per run: the last
held-out loss of every group (group_val_loss), their mean over the groups other than --noise, and
the share of steps drawn from each group, and (when the run was evaluated: <run>/eval/metrics.json)
its task exact match. The table is the mean (and, over seeds, the spread) per arm at equal steps;
the plot shows each arm's mixture over the steps and the noise group's share.

Against a published comparison (--published): an arm PASSes when its mean learnable held-out loss
is within --tolerance (nats) of the published arm's and its noise share within --share-tolerance;
the comparison PASSes when every published arm does.
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
        if run.name == "trained":  # a finished run's copy of its own config (andrea.train): counted once
            continue
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
        metrics = run / "eval" / "metrics.json"
        if metrics.is_file():
            tasks = json.loads(metrics.read_text()).get("tasks") or {}
            row["tasks"] = tasks.get("accuracy")
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
    cols = ["val_learnable_mean", *learnable, f"share_{noise}"] + (["tasks"] if "tasks" in runs else [])
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
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in cells])


def compare(table: pd.DataFrame, published: dict, noise: str, tol: float, share_tol: float) -> pd.DataFrame:
    """Per published arm: this table's figures beside the published ones and the verdict."""
    ref = pd.DataFrame(published["arms"]).set_index("arm")
    missing = sorted(set(ref.index) - set(table.index))
    if missing:
        raise SystemExit(f"firehose-report: the published comparison has arms {missing} that no run here has")
    share = f"share_{noise}"
    out = pd.DataFrame({"val_learnable_mean": table.loc[ref.index, "val_learnable_mean"],
                        "published_val": ref["val_learnable_mean"],
                        share: table.loc[ref.index, share], f"published_{share}": ref[share]})
    ok = ((out["val_learnable_mean"] - out["published_val"]).abs() <= tol) & \
         ((out[share] - out[f"published_{share}"]).abs() <= share_tol)
    out["verdict"] = ok.map({True: "PASS", False: "FAIL"})
    return out


def report_md(table: pd.DataFrame, verdict: pd.DataFrame | None, published: Path | None, plot_name: str | None,
              tol: float, share_tol: float) -> str:
    L = ["# The Firehose comparison", "", "Per arm (mean over seeds; spread = max - min over seeds of the mean "
         "learnable held-out loss):", "", markdown(table), ""]
    if plot_name:
        L += [f"![mixtures]({plot_name})", ""]
    L += ["## Against the published comparison", ""]
    if verdict is None:
        L += ["No published comparison (docs/published/ANDREA-12M-firehose-mixers.json)."]
    else:
        overall = "PASS" if (verdict["verdict"] == "PASS").all() else "FAIL"
        L += [f"**{overall}** against `{published}` (tolerances: {tol} nats on the mean learnable held-out loss, "
              f"{share_tol} on the noise share):", "", markdown(verdict.round(4))]
    return "\n".join(L) + "\n"


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
    from andrea.util.atomic import atomic_savefig
    atomic_savefig(fig, path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, type=Path)
    ap.add_argument("--table", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--noise", default="noise", help="the unlearnable group's name")
    ap.add_argument("--report", type=Path, help="markdown report: table, plot, verdict")
    ap.add_argument("--published", type=Path, help="published comparison to judge against")
    ap.add_argument("--tolerance", type=float, default=0.05, help="nats, mean learnable held-out loss")
    ap.add_argument("--share-tolerance", type=float, default=0.05, help="absolute, the noise group's share")
    ap.add_argument("--write-published", type=Path, help="freeze this comparison as the published one")
    ap.add_argument("--machine", default="", help="stored with --write-published")
    ap.add_argument("--commit", default="", help="stored with --write-published")
    a = ap.parse_args(argv)
    from andrea.util.atomic import atomic_write
    runs, mixes = load_runs(a.runs)
    table = summary(runs, a.noise)
    text = markdown(table)
    print(text)
    if a.table:
        atomic_write(a.table, text + "\n")
    if a.plot:
        plot(mixes, a.plot, a.noise)
    verdict = None
    if a.published:
        pub = json.loads(a.published.read_text())
        if not isinstance(pub.get("arms"), list):
            raise SystemExit(f"firehose-report: {a.published}: field arms is missing; expected a list of per-arm rows")
        verdict = compare(table, pub, a.noise, a.tolerance, a.share_tolerance)
        print(markdown(verdict.round(4)))
    if a.report:
        rel = None if not a.plot else (a.plot.name if a.plot.parent == a.report.parent else str(a.plot))
        atomic_write(a.report, report_md(table, verdict, a.published, rel, a.tolerance, a.share_tolerance))
    if a.write_published:
        pub = {"comparison": "firehose mixers", "runs": str(a.runs), "machine": a.machine, "commit": a.commit or None,
               "arms": table.reset_index().to_dict(orient="records")}
        atomic_write(a.write_published, json.dumps(pub, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
