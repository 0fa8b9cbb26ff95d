# Evaluate the archived final checkpoint on the held-out split; compare with the published run
# (docs/published/<EXP>.json) when there is one and the run has no overrides. The report, the loss
# plot and the samples go into `snakemake --report results/report.html` as well. Its few lines (the
# result, any warning) go to the terminal too.


rule evaluate:
    input:
        config="results/{exp}/resolved/eval.yaml",
        archive="results/{exp}/archive/final",
        loss="results/{exp}/trained/{exp}.loss.json",
        tokenizer=tokenizer_of,
        shards=shards_of,
        val=split_of("val"),
        train=split_of("train"),
        published=published_of,
    output:
        report=report("results/{exp}/report.md", category="{exp}", labels={"run": "{exp}", "file": "report"}),
        metrics="results/{exp}/eval/metrics.json",
        plot=report("results/{exp}/eval/loss.png", category="{exp}", labels={"run": "{exp}", "file": "loss curve"}),
        samples=report("results/{exp}/eval/samples.json", category="{exp}", labels={"run": "{exp}", "file": "samples"}),
        synthetic="results/{exp}/eval/synthetic.json",  # the synthetic tasks' rows
        tasks="results/{exp}/eval/tasks.json",  # the standard tasks of eval.tasks from eval.task_data (docs/EVALUATION.md)
    params:
        published=published_arg,
        out_dir=run_dir,
    log:
        "results/{exp}/logs/evaluate.log",
    benchmark:
        "results/{exp}/benchmarks/evaluate.tsv"
    conda:
        ENV
    shell:
        "python3 -m andrea.pipeline.evaluate --config {input.config} --checkpoint-dir {input.archive} --loss {input.loss} "
        "--val-conversations {input.val} --train-conversations {input.train} {params.published} "
        "--out-dir {params.out_dir} 2>&1 | tee {log}"
