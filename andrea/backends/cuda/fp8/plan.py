"""The FP8 path's sizes, alignments and plan rows: pure arithmetic, no launches, no device
(the engine's memory plan calls these on any machine), plus the device check of
train.precision=fp8.
"""
from __future__ import annotations

import numpy as np

from ...interface import FP8_HIST
from ..runtime import cp

FP8_CUDA_TYPES = {"e4m3": 28, "e5m2": 29}  # cudaDataType_t CUDA_R_8F_E4M3, CUDA_R_8F_E5M2
FP8_MIN_CC = 89  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) or later
FP8_MULTIPLE = 16  # cuBLASLt's FP8 products want every dimension a multiple of 16
META_STRIDE = 64  # floats per tensor: amax at 0, 1/scale at 32 (128-byte aligned, for cuBLASLt)
# the input, the weight, the output gradient of a product; the classifier's input (lnf's output)
# and its dlogits
META_SLOTS = {"x": 0, "w": 1, "dy": 2, "cx": 3, "dz": 4}
TILE = 64  # the cast kernels' tile: 64 columns, 64 rows (the *_many kernel) or Tuning.fp8_tile_rows
TABLE_COLS = 5  # int64 per tensor of a *_many launch: address of x, of out, of out_t, R, K (fp8.cu)
CACHE_ALIGN = 256  # bytes: each cached copy starts aligned as cuBLASLt's heuristics assume
MANY_BLOCKS = 128  # blocks per tensor of the *_many kernels (grid-stride over the tensor)
ADAMW_AMAX_MAX = 256  # weights k_adamw_step_amax takes the amax of at most (optim.cu's ADAMW_AMAX_MAX)
# a delayed scale's row (META_STRIDE floats, fp8.cu k_fp8_delayed_roll): the amax it scales by at
# 0, the amax of the step under way at DELAYED_CUR, the last FP8_HIST steps' from DELAYED_HIST_AT
DELAYED_CUR, DELAYED_HIST_AT = 1, 2
FP8_SCALINGS = ("current", "delayed")


def _aligned(n: int) -> int:
    return -(-n // CACHE_ALIGN) * CACHE_ALIGN


def weight_cache_rows(shapes):
    """The arena rows of the FP8 weight cache for weights of these (R, K) shapes: the copies (W
    and W^T of each, CACHE_ALIGN-aligned, in one uint8 row), their (amax, 1/scale) rows and the
    table the *_many kernels read. Pure arithmetic: the memory plan calls it without a GPU."""
    n = len(shapes)
    data = sum(2 * _aligned(int(R) * int(K)) for R, K in shapes)
    return [("fp8_wcache", (data,), "uint8"), ("fp8_wmeta", (n * META_STRIDE,), "float32"),
            ("fp8_wtable", (n, TABLE_COLS), "int64")]


def input_slot_rows(shapes, N: int, keep_xt: bool):
    """The arena rows of the input slots of weights of these (OC, IC) shapes, for products of N
    rows: their (amax, 1/scale) rows and, with keep_xt, FP8 X^T (IC, N) of each input (one byte
    an element, CACHE_ALIGN-aligned, in one uint8 row). Pure arithmetic, as weight_cache_rows."""
    rows = [("fp8_xmeta", (len(shapes) * META_STRIDE,), "float32")]
    if keep_xt:
        rows.append(("fp8_xt", (sum(_aligned(int(K) * int(N)) for _, K in shapes),), "uint8"))
    return rows


def fp8_rows(B: int, T: int, C: int, vocab: int = 0, chunk_rows: int = 0):
    """The workspace rows of the FP8 path for this model shape: the widest operand of each role
    (the MLP's: B*T x 4C activations and gradients, a 4C x C weight) and the scales. vocab and
    chunk_rows (the rows R of the logits workspace): with the classifier in FP8
    (classifier_in_fp8): one chunk's input and its transpose, its FP8 dlogits (R, V), and room
    for the embedding (V, C) where the weight cache does not hold it."""
    N, H = B * T, 4 * C
    w = H * C
    rows = [("fp8_x", (N * H,), "uint8"), ("fp8_dy", (N * H,), "uint8"), ("fp8_dyt", (N * H,), "uint8")]
    if vocab and classifier_in_fp8(N, vocab, chunk_rows):
        R = chunk_rows
        w = max(w, vocab * C)
        rows += [("fp8_cx", (R * C,), "uint8"), ("fp8_cxt", (R * C,), "uint8"), ("fp8_dz", (R * vocab,), "uint8")]
    return rows + [("fp8_w", (w,), "uint8"), ("fp8_meta", (len(META_SLOTS) * META_STRIDE,), "float32")]


def delayed_rows(n: int):
    """The engine's arena rows of n delayed scales (the run's fp8_scaling "delayed"), one
    META_STRIDE row each (core.plan.fp8_delayed_tensors lists them)."""
    return [("fp8_delayed", (n * META_STRIDE,), "float32")] if n else []


def delayed_history_array(history, n=None) -> np.ndarray:
    """history (a checkpoint sidecar's fp8_amax_history: n lists of FP8_HIST amax, newest first) as
    a float32 (n, FP8_HIST) array (n None: any number of rows); a ValueError naming the field where
    it is not that, or holds a value that is not a finite, non-negative number."""
    want = f"({'n' if n is None else n}, {FP8_HIST}) amax values (a row a delayed scale, newest first)"
    try:
        h = np.asarray(history, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"fp8_amax_history: not an array of numbers; expected {want}") from None
    if h.ndim != 2 or h.shape[1] != FP8_HIST or (n is not None and h.shape[0] != n):
        raise ValueError(f"fp8_amax_history: shape {h.shape}; expected {want}")
    if not np.all(np.isfinite(h)) or (h < 0).any():
        raise ValueError("fp8_amax_history: a value is not finite or is negative; expected amax values >= 0")
    return h


def classifier_in_fp8(N: int, V: int, R: int) -> bool:
    """Whether the classifier's products can run in FP8 for N = B*T rows, V classes and chunks of R
    rows (the logits workspace, core.model.loss_chunk_rows): cuBLASLt's FP8 products and
    k_fp8_transpose want V and every chunk's rows (N and R) multiples of FP8_MULTIPLE; otherwise
    the classifier stays in bf16."""
    return R > 0 and V % FP8_MULTIPLE == 0 and N % FP8_MULTIPLE == 0 and R % FP8_MULTIPLE == 0


def check_fp8_device(B: int, T: int, C: int):
    """Raise a clear error where train.precision=fp8 cannot run: a GPU without FP8 tensor cores,
    or sizes cuBLASLt's FP8 products do not take."""
    dev = cp.cuda.Device()
    cc = int(dev.compute_capability)
    if cc < FP8_MIN_CC:
        name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        raise RuntimeError(f"train.precision=fp8 needs FP8 tensor cores (compute capability 8.9 or later); "
                           f"this GPU ({name}) is {cc // 10}.{cc % 10}: use precision fp16 or bf16")
    for what, v in (("model.d_model", C), ("train.batch_size * train.seq_len", B * T)):
        if v % FP8_MULTIPLE:
            raise ValueError(f"train.precision=fp8: {what} = {v} must be a multiple of {FP8_MULTIPLE} "
                             "(cuBLASLt's FP8 products)")
