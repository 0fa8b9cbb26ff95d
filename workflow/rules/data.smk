# Data steps: one raw pull per data root (<data.dir>/<data.source>), one megachat mix, one
# tokenizer and one set of token shards per vocabulary size. Each step's script and the andrea
# module holding its logic are inputs too: editing them re-runs the step. The lines of a step's
# log that say "warning" are repeated on the terminal (an unreachable hub, a tokenizer smaller
# than asked), not only kept in the log.


# The raw conversations of a data root, whatever its source: synthetic tasks generated from a seed,
# a local mirror, or Hermes 3 from the hub (scripts/pull-hermes3.py does all three).
rule pull_conversations:
    input:
        pull_inputs,
        config="{root}/config/pull.yaml",
        script="scripts/pull-hermes3.py",
        code="andrea/data/synthetic.py",
    output:
        conversations="{root}/raw/conversations.parquet",
        report="{root}/raw/pull-report.json",
    log:
        "{root}/logs/pull.log",
    benchmark:
        "{root}/benchmarks/pull.tsv"
    conda:
        ENV
    shell:
        "python3 {input.script} --config {input.config} --out {output.conversations} "
        "--report {output.report} > {log} 2>&1 && (grep -i -h warning {log} >&2 || true)"


rule prep_megachat:
    input:
        config="{root}/config/prep.yaml",
        conversations="{root}/raw/conversations.parquet",
        script="scripts/prep-megachat.py",
        code="andrea/data/chat.py",
    output:
        train="{root}/megachat/train.parquet",
        val="{root}/megachat/val.parquet",
        report="{root}/megachat/report.json",
    log:
        "{root}/logs/prep.log",
    benchmark:
        "{root}/benchmarks/prep.tsv"
    conda:
        ENV
    shell:
        "python3 {input.script} --config {input.config} --inputs {input.conversations} "
        "--train {output.train} --val {output.val} --report {output.report} > {log} 2>&1 && (grep -i -h warning {log} >&2 || true)"


rule train_tokenizer:
    input:
        train="{root}/megachat/train.parquet",
        script="scripts/train-tokenizer.py",
        code="andrea/data/tokenizer.py",
    output:
        "{root}/tok{vocab}/tokenizer.json",
    params:
        vocab="{vocab}",
    log:
        "{root}/logs/tokenizer-{vocab}.log",
    benchmark:
        "{root}/benchmarks/tokenizer-{vocab}.tsv"
    conda:
        ENV
    shell:
        "python3 {input.script} --train {input.train} --vocab-size {params.vocab} --out {output} > {log} 2>&1 && (grep -i -h warning {log} >&2 || true)"


rule tokenize:
    input:
        tokenizer="{root}/tok{vocab}/tokenizer.json",
        train="{root}/megachat/train.parquet",
        val="{root}/megachat/val.parquet",
        script="scripts/tokenize-shards.py",
    output:
        "{root}/tok{vocab}/shards.json",
    params:
        out_dir=parent_of_output,
    threads: 4
    log:
        "{root}/logs/tokenize-{vocab}.log",
    benchmark:
        "{root}/benchmarks/tokenize-{vocab}.tsv"
    conda:
        ENV
    shell:
        "python3 {input.script} --tokenizer {input.tokenizer} --train {input.train} --val {input.val} "
        "--out-dir {params.out_dir} --manifest {output} --threads {threads} > {log} 2>&1"


# Data groups for the mixer (docs/FIREHOSE-BANDIT.md): one set of shards per synthetic task kind
# (the prep step's `task` column) plus a group of random tokens, under tok<V>/mix/groups/<name>/.
# Its own folder, so the ungrouped shards above are never rewritten by it.
rule tokenize_groups:
    input:
        tokenizer="{root}/tok{vocab}/tokenizer.json",
        train="{root}/megachat/train.parquet",
        val="{root}/megachat/val.parquet",
        script="scripts/tokenize-shards.py",
    output:
        "{root}/tok{vocab}/mix/groups.json",
    params:
        out_dir=parent_of_output,
    threads: 4
    log:
        "{root}/logs/tokenize-groups-{vocab}.log",
    conda:
        ENV
    shell:
        "python3 {input.script} --tokenizer {input.tokenizer} --train {input.train} --val {input.val} "
        "--out-dir {params.out_dir} --manifest {output} --threads {threads} --group-by field:task "
        "--noise-group noise --noise-tokens 8000000 --noise-seed 0 > {log} 2>&1"
