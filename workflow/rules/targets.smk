# Targets besides `all` (in the Snakefile, where the default target must be). `results/<EXP>` names an experiment's folder; no rule can output that folder (its
# steps write inside it, and Snakemake forbids an output that contains another rule's), so each
# experiment gets a target rule of that name instead: `snakemake --cores 1 results/ANDREA-12M`.


for _exp in EXPERIMENTS:

    rule:
        name:
            f"results/{_exp}"
        input:
            experiment_targets([_exp]),
