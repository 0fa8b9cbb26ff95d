# Evaluate the archived final checkpoint on the held-out split; compare with the published run
# (docs/published/<EXP>.json) when there is one.


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
        report="results/{exp}/report.md",
        metrics="results/{exp}/eval/metrics.json",
        plot="results/{exp}/eval/loss.png",
        samples="results/{exp}/eval/samples.json",
        tasks="results/{exp}/eval/tasks.json",
    params:
        published=published_arg,
        out_dir=run_dir,
    log:
        "results/{exp}/logs/evaluate.log",
    conda:
        ENV
    shell:
        "python3 -m andrea.evaluate --config {input.config} --checkpoint-dir {input.archive} --loss {input.loss} "
        "--val-conversations {input.val} --train-conversations {input.train} {params.published} "
        "--out-dir {params.out_dir} > {log} 2>&1"
