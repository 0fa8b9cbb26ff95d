"""Standard in-context benchmarks (ARC, PIQA, LAMBADA, Winogrande, ... and the CORE suite) scored on
a trained run with the engine's own kernels: `python -m andrea.tasks RUN --tasks core --task-data DIR`.
docs/EVALUATION.md has the tasks, the suites and how to read the numbers."""
