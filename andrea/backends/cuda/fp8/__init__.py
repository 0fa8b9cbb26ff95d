"""The FP8 layer of the CUDA backend (train.precision=fp8), below the launchers of ops/:

    plan.py    sizes, alignments and the plan rows (pure arithmetic), the device check
    quant.py   the quantisation launchers of kernels/fp8.cu (Quant)
    cache.py   the FP8 weight cache (WeightCache)
    scales.py  an input slot (InputSlot) and the delayed scales (DelayedScales)
    state.py   the FP8 state of one backend (Fp8: the launchers, the cache, slots and scales, the
               operands and the FP8 product)

The layers' FP8 forms live beside their 16-bit forms in ops/<op>.py.
"""
from .plan import (META_STRIDE, check_fp8_device, classifier_in_fp8, delayed_history_array, delayed_rows, fp8_rows,
                   input_slot_rows, weight_cache_rows)
from .state import Fp8

__all__ = ["Fp8", "META_STRIDE", "check_fp8_device", "classifier_in_fp8", "delayed_history_array", "delayed_rows",
           "fp8_rows", "input_slot_rows", "weight_cache_rows"]
