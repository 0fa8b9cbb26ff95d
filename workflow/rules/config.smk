# Stage files: the part of the resolved config each step depends on (see common.smk). The text
# is a param, so Snakemake rewrites a stage file exactly when its part of the config changed.

wildcard_constraints:
    exp="|".join(re.escape(e) for e in EXPERIMENTS),
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
    run:
        write_stage(output[0], params.text, log[0])


rule experiment_stage_config:
    output:
        "results/{exp}/resolved/{part}.yaml",
    params:
        text=exp_stage_text,
    log:
        "results/{exp}/logs/{part}-config.log",
    localrule: True
    run:
        write_stage(output[0], params.text, log[0])
