"""ANDREA: small GPT language models trained by a hand-written engine, reproducibly."""

__version__ = "0.1.0"
