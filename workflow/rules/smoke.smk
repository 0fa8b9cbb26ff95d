# The GPU smoke test: the whole DAG for ANDREA-12M-synthetic-smoke (300 steps of ANDREA-12M on the
# synthetic tasks, CUDA backend), a couple of minutes on one GPU, no network:
#
#   snakemake --cores 1 smoke-gpu
#
# Its data folder and pull settings are ANDREA-12M-synthetic's, so that run reuses the data.

SMOKE_EXP = "ANDREA-12M-synthetic-smoke"


rule:
    name:
        "smoke-gpu"
    input:
        experiment_targets([SMOKE_EXP]),
