"""The pipeline around the runs: configs composed outside Hydra, run names, evaluation and its
report, published references, comparisons, the live dashboard."""
