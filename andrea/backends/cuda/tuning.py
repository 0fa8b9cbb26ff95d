"""The CUDA backend's tuning: the launch-geometry knobs, fixed when a backend is made.

Each field changes how a kernel is launched (tile rows, blocks, vectors a thread), never what it
computes: every value gives the same bits as the default (the GPU tests run each against the
NumPy reference). The defaults are the measured winners (docs/BENCHMARKS.md, docs/FP8.md); the
benchmarks and dev/ tools time other values with `CudaBackend(tuning=Tuning(...))` or
`andrea.bench --set NAME=VALUE`. Settings that change a run's meaning are not here: they are
train.* config fields (train.precision, train.fp8_scaling, train.fp8_classifier, ...).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .geometry import EMBED_RANK_MAX

FP8_TILE_ROWS = (64, 128, 256)  # what fp8.cu's single-tensor cast kernels compile for (FP8_TILE_ROWS)


@dataclass(frozen=True)
class Tuning:
    # attention: the wgmma kernels of attention_hopper.cu (forward version 8, backward dQ version 10
    # and dK/dV version 7) on compute capability 9.0; False: version 4's mma.sync kernels
    # everywhere (the path other GPUs take; dev/cuda/harness.py times one against the other)
    hopper_attention: bool = True
    # blocks of the one-pass layer-norm backward (0: geometry.LN_BLOCKS or LN_BLOCKS_WIDE by the
    # row width)
    ln_blocks: int = 0
    # B*T up to which k_embed_bwd sorts its keys by rank (k_embed_sort_rank, O(N^2) comparisons
    # over the whole GPU); above it the one-block bitonic sort (k_embed_sort) is estimated to cost
    # less: ~14 us against 84 us measured at N = 8192, scaled, meet near N = 2^16
    embed_rank_max: int = EMBED_RANK_MAX
    # the classifier's row pass (loss.cu version 2): about this many 16-byte vectors of a row a
    # thread (0: version 1 for every row), the next row staged in shared memory while this one is
    # computed, and the blocks that walk the rows (0: as many as fit on the GPU)
    loss_vectors: int = 8
    loss_prefetch: bool = True
    loss_blocks: int = 0
    # train.precision=fp8: k_fp8_amax / k_fp8_gelu_amax run this many blocks an SM, each thread
    # taking many 16-byte vectors four at a time (0: one block per 256 vectors, the first grid)
    fp8_amax_blocks: int = 4
    # rows of the tile of the single-tensor cast-and-transpose kernels (64 columns): 64 measured
    # fastest (ANDREA-120M fp8 step on an H200: 14.75 ms against 15.37 with 128 and 17.27 with 256)
    fp8_tile_rows: int = 64
    # rows and warps of a block of k_layernorm_fwd_fp8 (8, 16 or 32; 4, 8, 16 or 32): 32 rows and
    # 16 warps write a whole 32-byte sector of a column of X^T a block (docs/FP8.md)
    fp8_layernorm_rows: int = 32
    fp8_layernorm_warps: int = 16

    def __post_init__(self):
        for name, allowed in (("fp8_tile_rows", FP8_TILE_ROWS), ("fp8_layernorm_rows", (8, 16, 32)),
                              ("fp8_layernorm_warps", (4, 8, 16, 32))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Tuning.{name} = {getattr(self, name)!r}: expected one of "
                                 f"{', '.join(map(str, allowed))}")
        for name in ("ln_blocks", "embed_rank_max", "loss_vectors", "loss_blocks", "fp8_amax_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Tuning.{name} = {v!r}: expected an integer >= 0")

    def with_settings(self, settings) -> "Tuning":
        """A copy with settings applied: {name: value}, values given as Python values or as the
        strings of a command line ("0", "1", "true", "128"); an unknown name is an error naming it."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes = {}
        for name, value in dict(settings).items():
            if name not in fields:
                raise ValueError(f"tuning setting {name!r}: expected one of {', '.join(fields)}")
            kind = type(getattr(self, name))
            if isinstance(value, str):
                text = value.strip().lower()
                if kind is bool:
                    if text not in ("0", "1", "true", "false"):
                        raise ValueError(f"tuning setting {name}={value!r}: expected 0, 1, true or false")
                    value = text in ("1", "true")
                else:
                    try:
                        value = int(text)
                    except ValueError:
                        raise ValueError(f"tuning setting {name}={value!r}: expected an integer") from None
            changes[name] = kind(value)
        return dataclasses.replace(self, **changes)


DEFAULT = Tuning()
