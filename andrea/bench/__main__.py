"""python -m andrea.bench: the training-step benchmark (andrea.bench.step)."""
import sys

from .step import main

sys.exit(main())
