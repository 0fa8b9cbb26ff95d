"""The engine and the model: the parameter layout, the memory plan and arena, the train step,
checkpoints and the data-parallel ranks. Backends (andrea.backends) run its kernels."""
