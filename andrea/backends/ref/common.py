"""Helpers the reference kernels share (as kernels/common.cuh is for the CUDA ones)."""
from __future__ import annotations


def _put(dst, x, accumulate):
    """dst += x, or dst = x (accumulate False: dst is not read)."""
    if accumulate:
        dst += x
    else:
        dst[...] = x
