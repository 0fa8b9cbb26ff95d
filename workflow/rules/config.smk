# Stage files: the part of the resolved config each step depends on (see common.smk). The text
# is a param, so Snakemake rewrites a stage file exactly when its part of the config changed.
# They are shell jobs on purpose: Snakemake runs those in its own process, where the targets of
# this invocation (which decide between experiments sharing a data folder) are known. A `run:`
# job would re-parse the workflow in a subprocess without them, and take seconds for a tiny file.

wildcard_constraints:
    exp="|".join(re.escape(r) for r in sorted(set(RUNS.values()) | set(OTHER_RUNS))),
    vocab=r"\d+",
    stage="pull|prep",
    part="train|eval",


rule data_stage_config:
    output:
        "{root}/config/{stage}.yaml",
    params:
        text=data_stage_text,
    log:
        "{root}/logs/{stage}-config.log",
    localrule: True
    conda:
        ENV
    shell:
        "printf '%s' {params.text:q} > {output}.tmp && mv {output}.tmp {output} && echo wrote {output} > {log}"


rule experiment_stage_config:
    output:
        "results/{exp}/resolved/{part}.yaml",
    params:
        text=exp_stage_text,
    log:
        "results/{exp}/logs/{part}-config.log",
    localrule: True
    conda:
        ENV
    shell:
        "printf '%s' {params.text:q} > {output}.tmp && mv {output}.tmp {output} && echo wrote {output} > {log}"
