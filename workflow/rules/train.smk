# Train one experiment through the proxy, then archive its final checkpoint.
#
# train's outputs are what a finished run produces, results/<EXP>/trained/ (final.bin and
# final.json, links to the final checkpoint and its sidecar; the completed history; config.yaml),
# never the checkpoints or the live records, so Snakemake never deletes resume state. A train
# job that is stopped (Ctrl-C, SIGTERM, a preemption) exits 75 and counts as failed; running
# the same command again resumes from the newest valid checkpoint of the same config and ends
# with the same bytes as an uninterrupted run, and `--retries N` does that by itself. A changed
# model or training setting moves the old run to results/<EXP>/previous/ (never deleted) and
# starts afresh. With the workflow config ranks = N > 1 the run is data-parallel over N ranks
# (python -m andrea.train --ranks N, or `<launcher> -n N` with config launcher=srun on Slurm).


rule train:
    input:
        config="results/{exp}/resolved/train.yaml",
        tokenizer=tokenizer_of,
        shards=shards_of,
    output:
        checkpoint="results/{exp}/trained/final.bin",
        sidecar="results/{exp}/trained/final.json",
        loss="results/{exp}/trained/{exp}.loss.json",
        config="results/{exp}/trained/config.yaml",
    params:
        args=train_args,
        launch=train_launch,
    resources:
        gpu=train_gpus,
        mem_mb=train_mem_mb,
        # data parallelism (config ranks, launcher; docs/DISTRIBUTED.md): Slurm tasks, one per rank
        tasks=train_slurm_tasks,
        tasks_per_gpu=train_slurm_tasks_per_gpu,
        mpi=train_mpi,
        nodes=train_slurm_nodes,
    log:
        "results/{exp}/logs/train.log",
    benchmark:
        "results/{exp}/benchmarks/train.tsv"
    conda:
        ENV
    # the progress bar (step, loss, tokens/s, ETA) and the dashboard command go to the terminal too
    shell:
        "{params.launch} --new-run-on-change {params.args} 2>&1 | tee {log}"


rule archive:
    input:
        config="results/{exp}/trained/config.yaml",
        checkpoint="results/{exp}/trained/final.bin",
        loss="results/{exp}/trained/{exp}.loss.json",
        tokenizer=tokenizer_of,
        script="scripts/archive.py",
    output:
        directory("results/{exp}/archive/final"),
    log:
        "results/{exp}/logs/archive.log",
    benchmark:
        "results/{exp}/benchmarks/archive.tsv"
    conda:
        ENV
    shell:
        "python3 {input.script} --config {input.config} --checkpoint {input.checkpoint} "
        "--loss {input.loss} --tokenizer {input.tokenizer} --out {output} > {log} 2>&1"
