# Train one experiment through the proxy, then archive its final checkpoint.
#
# The train step starts from scratch every time it runs: Snakemake removes its outputs, the
# checkpoints folder included, before running it (a re-run means the config or the data changed,
# so old checkpoints are of another run), and after a failure unless --keep-incomplete is given.
# For long GPU runs pass --keep-incomplete. To finish a run that failed or was interrupted
# (its checkpoints kept): `python -m andrea.train experiment=<EXP> [the same overrides]` resumes
# from the newest checkpoint; then `snakemake --cleanup-metadata results/<EXP>/config.yaml
# results/<EXP>/<EXP>.loss.json results/<EXP>/checkpoints` marks train's outputs complete, and
# `snakemake --cores 1 results/<EXP>` archives and evaluates without training again.


rule train:
    input:
        config="results/{exp}/resolved/train.yaml",
        tokenizer=tokenizer_of,
        shards=shards_of,
    output:
        config="results/{exp}/config.yaml",
        loss="results/{exp}/{exp}.loss.json",
        checkpoints=directory("results/{exp}/checkpoints"),
    params:
        overrides=train_overrides,
    log:
        "results/{exp}/logs/train.log",
    conda:
        ENV
    shell:
        "python3 -m andrea.train experiment={wildcards.exp} {params.overrides} > {log} 2>&1"


rule archive:
    input:
        config="results/{exp}/config.yaml",
        checkpoints="results/{exp}/checkpoints",
        loss="results/{exp}/{exp}.loss.json",
        tokenizer=tokenizer_of,
        script="scripts/archive.py",
    output:
        directory("results/{exp}/archive/final"),
    log:
        "results/{exp}/logs/archive.log",
    conda:
        ENV
    shell:
        "python3 {input.script} --config {input.config} --checkpoints {input.checkpoints} "
        "--loss {input.loss} --tokenizer {input.tokenizer} --out {output} > {log} 2>&1"
