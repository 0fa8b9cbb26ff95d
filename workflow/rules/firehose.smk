# The Firehose comparison (docs/FIREHOSE-BANDIT.md, Evidence): ANDREA-12M-firehose trained with each
# mixer (an "arm") from several seeds, each run evaluated, then one table, one plot and the verdict
# against the published comparison, docs/published/ANDREA-12M-firehose-mixers.json:
#
#   snakemake --cores 4 firehose        # 9 runs of 2,000 steps on one GPU, one at a time (gpu=1)
#
# Runs live in results/ANDREA-12M-firehose/mixers/<EXP>-<arm>-seed<N>/, named with exp=, so they
# never touch the pinned run results/ANDREA-12M-firehose/ (the progress bandit, seed 1).

from types import SimpleNamespace

FIREHOSE_EXP = "ANDREA-12M-firehose"
FIREHOSE_DIR = f"results/{FIREHOSE_EXP}/mixers"
FIREHOSE_PUBLISHED = f"docs/published/{FIREHOSE_EXP}-mixers.json"
# the arms: overrides of the experiment (the bandit's loss reward is ODM's, on its own scale)
FIREHOSE_ARMS = {
    "uniform": ["mixer=uniform"],
    "loss": ["data.mixer.reward=loss", "data.mixer.reward_scale=1.0"],
    "progress": ["data.mixer.reward=progress"],
}
FIREHOSE_SEEDS = (1, 2, 3)
_FH = SimpleNamespace(exp=FIREHOSE_EXP)
_FH_RUN = f"{FIREHOSE_DIR}/{FIREHOSE_EXP}-{{arm}}-seed{{seed}}"


wildcard_constraints:
    arm="|".join(FIREHOSE_ARMS),
    seed=r"\d+",


rule firehose_train:
    input:
        tokenizer=lambda w: tokenizer_of(_FH),
        shards=lambda w: shards_of(_FH),
    output:
        checkpoint=f"{_FH_RUN}/trained/final.bin",
        loss=f"{_FH_RUN}/trained/{FIREHOSE_EXP}-{{arm}}-seed{{seed}}.loss.json",
        config=f"{_FH_RUN}/trained/config.yaml",
    params:
        exp=FIREHOSE_EXP,
        results_dir=lambda w, output: str(Path(output.checkpoint).parents[2]),
        overrides=lambda w: " ".join(FIREHOSE_ARMS[w.arm]),
    resources:
        gpu=1,
    log:
        f"{FIREHOSE_DIR}/logs/{{arm}}-seed{{seed}}-train.log",
    conda:
        ENV
    shell:
        "python3 -m andrea.train --new-run-on-change experiment={params.exp} "
        "exp={params.exp}-{wildcards.arm}-seed{wildcards.seed} results_dir={params.results_dir} "
        "{params.overrides} train.seed={wildcards.seed} > {log} 2>&1"


rule firehose_evaluate:
    input:
        checkpoint=rules.firehose_train.output.checkpoint,
        loss=rules.firehose_train.output.loss,
        config=rules.firehose_train.output.config,
        val=lambda w: split_of("val")(_FH),
        train=lambda w: split_of("train")(_FH),
    output:
        f"{_FH_RUN}/eval/metrics.json",
    params:
        run=lambda w, output: str(Path(output[0]).parent.parent),
    log:
        f"{FIREHOSE_DIR}/logs/{{arm}}-seed{{seed}}-evaluate.log",
    conda:
        ENV
    shell:
        "python3 -m andrea.pipeline.evaluate --config {input.config} --checkpoint-dir {params.run}/trained "
        "--loss {input.loss} --val-conversations {input.val} --train-conversations {input.train} "
        "--out-dir {params.run} > {log} 2>&1"


rule firehose_report:
    input:
        metrics=expand(f"{_FH_RUN}/eval/metrics.json", arm=list(FIREHOSE_ARMS), seed=FIREHOSE_SEEDS),
        script="scripts/firehose-report.py",
    output:
        table=f"{FIREHOSE_DIR}/mixers.md",
        plot=report(f"{FIREHOSE_DIR}/mixers.png", category=FIREHOSE_EXP, labels={"file": "mixers"}),
        report=f"{FIREHOSE_DIR}/report.md",
    params:
        runs=lambda w, output: str(Path(output.table).parent),
        published=lambda w: f"--published {FIREHOSE_PUBLISHED}" if (REPO / FIREHOSE_PUBLISHED).is_file() else "",
    log:
        f"{FIREHOSE_DIR}/logs/report.log",
    conda:
        ENV
    shell:
        "python3 {input.script} --runs {params.runs} --noise noise --table {output.table} --plot {output.plot} "
        "--report {output.report} {params.published} 2>&1 | tee {log}"


rule:
    name:
        "firehose"
    input:
        rules.firehose_report.output.report,
