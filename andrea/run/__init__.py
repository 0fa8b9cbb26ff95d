"""One training run: the engine process (runner), what it says and how it exits (protocol), the
proxy that supervises it and keeps its records, and the single-host data-parallel launch."""
