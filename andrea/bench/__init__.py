"""Benchmarks on the GPU: the training step (step.py, `python -m andrea.bench`), the FP8 linear
layers (fp8.py) and attention alone (attention.py), each against PyTorch in the same job."""
