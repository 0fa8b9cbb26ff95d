"""The launchers: every k_* operation of the backend interface on the GPU, in numpy_ref's order.

Same names, arguments and meaning as numpy_ref (read its docstring): forward kernels write,
backward kernels ADD into every gradient buffer, except an activation gradient given with
accumulate=False, which they write (the matrix products with beta = 0, the custom kernels with an
int flag, or a -D option, that skips the read of the old value). Each launcher checks shapes, dtypes and
contiguity first and raises naming the argument, then launches kernels of kernels/<op>.cu
(self.rt, a Runtime) and matrix products on cuBLAS (self.blas). Scratch beyond the arguments
comes from self.workspace. CudaOps is the half of CudaBackend (backend.py) that launches kernels.
"""
from __future__ import annotations

import contextlib
import functools
import math

import numpy as np

from ..numpy_ref import FP8_DLOGITS, FP8_DLOGITS_ROUNDING, STATE_LEN
from .colsum import DEFERRED, deferred_floats
from .cublas import CUBLAS_WORKSPACE, cuda_type
from .runtime import MAX_BLOCKS, THREADS, blocks, check, cp, i32, i64

COLSUM_CHUNKS = 64  # row chunks of the two-pass column sums (bias and layer-norm gradients)


def colsum_chunks(N: int) -> tuple:
    """(rows a chunk, chunks) of the two-pass column sums over N rows: COLSUM_CHUNKS chunks at
    most, each partial a row of the partials buffer."""
    rows = -(-N // COLSUM_CHUNKS)
    return rows, -(-N // rows)

LN_FUSED_MAXC = 1024  # widest row the one-pass layer-norm backward holds in registers
# blocks (and partial rows) of the one-pass layer-norm backward: 2 per SM of an H200 below
# LN_WIDE columns, 4 from there (measured in the step: 528 blocks 0.391 ms against 264's 0.453 at
# ANDREA-120M's 768 columns, slower at ANDREA-12M's 384: docs/BENCHMARKS.md)
LN_BLOCKS, LN_BLOCKS_WIDE, LN_WIDE = 264, 528, 768
STEP_CHECK_THREADS = 96  # SC_THREADS in optim.cu: the summing warp and the two that compute the powers
EMBED_RANK_MAX = 1 << 16  # see CudaOps.embed_rank_max
EMBED_RANK_KEYS = 32  # keys a block of k_embed_sort_rank ranks (ER_KEYS in embed.cu)
EMBED_WTE_WARPS = 8  # sorted slots (one warp each) a block of k_embed_bwd_wte takes (EW_WARPS in embed.cu)
# Attention version 4 (fused, kernels/attention.cu) runs for 16-bit compute dtypes, head
# sizes that are multiples of 16 up to 128, on GPUs of compute capability 8.0 or later (cp.async,
# ldmatrix, bf16 mma.sync) whose per-block shared-memory limit holds its tiles; float32, other
# head sizes and older GPUs take version 1 (scores materialised, cuBLAS). The backend's
# attention="materialised" forces version 1. (Versions 2 and 3 are in git history;
# dev/cuda/attention_bench.py times 3 against 4.)
FLASH_HEAD_SIZES = (16, 32, 48, 64, 80, 96, 112, 128)
FLASH_MIN_CC = 80


def flash_geometry(hs: int) -> dict:
    """Version 4's launch geometry for head size hs, as kernels/attention.cu defines it
    (each kernel traps if given less dynamic shared memory than it needs): query rows per forward
    block ("fwd_rows") and bytes of dynamic shared memory per kernel."""
    lds, bn = hs + 8, 64
    fwd_rows = 128 if hs <= 64 else 64
    bq = 64 if hs <= 64 else 32
    return {"fwd_rows": fwd_rows,
            "k_attn_flash_fwd": (fwd_rows + 4 * bn) * lds * 2,
            "k_attn_flash_bwd_dq": (2 * 64 + 4 * bn) * lds * 2,
            "k_attn_flash_bwd_dkv": (2 * bn + 4 * bq) * lds * 2 + 4 * bq * 4}


def hopper_geometry(hs: int) -> dict:
    """The launch of attention_hopper.cu's wgmma kernels for head size hs, as its macros define them
    by default (each kernel traps on another block size or less shared memory). Forward (version
    8): two warpgroups of 64 query rows a block ("fwd_rows"), key tiles of 64 staged three deep.
    Backward: dQ (version 10), two warpgroups of 64 query rows a block, key tiles of 64; dK/dV
    (version 7), one warpgroup of 64 keys a block at head size 64 (three blocks a multiprocessor),
    two elsewhere; query tiles of 64 (32 above head size 64) streamed by dK/dV."""
    kwg = 1 if hs == 64 else 2
    keys, rows, bq, bn = 64 * kwg, 128, (64 if hs <= 64 else 32), 64
    fwd_rows, fwd_bn, stages = 128, 64, 3
    return {"keys": keys, "rows": rows, "threads": 256, "dkv_threads": 128 * kwg, "fwd_rows": fwd_rows,
            "k_attn_flash_fwd": fwd_rows * hs * 2 + 2 * stages * fwd_bn * hs * 2,
            "k_attn_flash_bwd_dkv": 2 * keys * hs * 2 + 4 * bq * hs * 2 + 4 * bq * 4,
            "k_attn_flash_bwd_dq": 2 * rows * hs * 2 + 4 * bn * hs * 2}


@functools.lru_cache(maxsize=None)
def _device_takes_hopper(device_id: int, hs: int) -> bool:
    """Compute capability 9.0 (wgmma.mma_async, through the sm_90a build) and room for the tiles of
    versions 8 and 7 at head size hs; asked once per device and head size, not at every launch."""
    dev = cp.cuda.Device(device_id)
    if int(dev.compute_capability) != 90:
        return False
    smem = int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
    return max(v for k, v in hopper_geometry(hs).items() if k.startswith("k_")) <= smem


def _device_fits_flash(hs: int) -> bool:
    dev = cp.cuda.Device()
    cc, smem = int(dev.compute_capability), int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
    geo = flash_geometry(hs)
    return cc >= FLASH_MIN_CC and max(v for k, v in geo.items() if k.startswith("k_")) <= smem
ATTENTION_PATHS = ("fused", "materialised")


def attn_scale(hs: int):
    """The attention's softmax scale 1/sqrt(head size), as its kernels take it (float32)."""
    return np.float32(1.0 / math.sqrt(hs))


def adamw_args(params, pc, grads, m, v, state, beta1, beta2, eps, n_decay):
    """The arguments optim.cu's k_adamw_step and k_adamw_step_amax begin with."""
    f32 = np.float32
    return (params, pc, grads, m, v, state, i64(params.size), i64(n_decay), f32(beta1), f32(1.0 - beta1),
            f32(beta2), f32(1.0 - beta2), f32(eps))


def _attn_shapes(kernel, qkv, n_head):
    check(kernel, "qkv", qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    if C3 % 3 or C % n_head:
        raise ValueError(f"{kernel}: qkv last axis {C3} must be 3*C with C divisible by n_head={n_head}")
    return B, T, C, n_head, C // n_head


LOSS_THREADS_V1 = 512  # block of loss.cu's version 1 row pass (one row a block)
LOSS_ROW_REGS = 28  # registers of loss.cu's version 2 beyond its 4 a vector (ptxas: 60-64 at 8 vectors)


def loss_row_plan(V: int, itemsize: int, vectors: int = 8, prefetch: bool = True, smem_max: int = 232448):
    """The launch of loss.cu's version 2 row pass (the row held in registers) for rows of V
    elements of itemsize bytes: (vectors a thread, threads a block, bytes of dynamic shared
    memory), or None where version 1 runs instead: rows that are no whole 16-byte vectors, or
    too long for one block's registers (float32 at V = 50304). About `vectors` 16-byte vectors a
    thread, the block a multiple of 32 threads (at most 1024) that covers the row, then the
    fewest vectors a thread that still do; the next row staged in shared memory (two buffers)
    where prefetch is set and they fit in smem_max."""
    vec = 16 // itemsize
    if V % vec or V <= 0 or vectors <= 0:  # vectors 0: version 1 for every row (timing it)
        return None
    n = V // vec
    nv = max(1, min(vectors, -(-n // 32)))
    threads = 32 * -(-n // (32 * nv))
    if threads > 1024:
        threads = 1024
    nv = -(-n // threads)
    if 4 * nv + LOSS_ROW_REGS > (65536 // threads) // 8 * 8:
        return None
    smem = 2 * nv * threads * 16 if prefetch else 0
    return nv, threads, (smem if smem <= smem_max else 0)


@functools.lru_cache(maxsize=None)
def _sm_limits(device_id: int) -> dict:
    a = cp.cuda.Device(device_id).attributes
    return {"sms": int(a["MultiProcessorCount"]), "smem_optin": int(a["MaxSharedMemoryPerBlockOptin"]),
            "regs": int(a.get("MaxRegistersPerMultiprocessor", 65536)),
            "smem": int(a.get("MaxSharedMemoryPerMultiprocessor", 233472)),
            "threads": int(a.get("MaxThreadsPerMultiProcessor", 2048)),
            "blocks": int(a.get("MaxBlocksPerMultiprocessor", 32))}


def resident_blocks(num_regs: int, threads: int, smem: int, lim: dict) -> int:
    """Blocks of a kernel that fit on one SM at once (registers allocated 256 a warp, 1 KB of
    shared memory reserved a block): the grid of a kernel whose blocks walk the rows."""
    warps = -(-threads // 32)
    by_regs = lim["regs"] // (warps * (-(-num_regs * 32 // 256) * 256))
    by_smem = lim["smem"] // (smem + 1024)
    return max(1, min(by_regs, by_smem, lim["threads"] // threads, lim["blocks"]))


def _loss_checks(kernel, losses, lse, logits, inp, wte, targets):
    """Checks, and flat row views: x (N, C), targets, losses, lse (N,), logits as (R, V)."""
    V, C = wte.shape
    B, T = targets.shape
    ct = wte.dtype
    check(kernel, "targets", targets, dtype=np.int32)
    check(kernel, "losses", losses, (B, T), np.float32)
    check(kernel, "lse", lse, (B, T), np.float32)
    check(kernel, "logits", logits, dtype=ct)
    if logits.size % V or logits.size == 0:
        raise ValueError(f"{kernel}: logits has shape {logits.shape}; expected (R, {V}) rows of the vocab")
    check(kernel, "inp", inp, (B, T, C), ct)
    check(kernel, "wte", wte, dtype=ct)
    N = B * T
    return (inp.reshape(N, C), targets.reshape(N), losses.reshape(N), lse.reshape(N),
            logits.reshape(-1, V), N, V, C, ct)


def _dloss_args(kernel, dloss):
    """The row pass's (dloss_ptr, dloss) arguments: a (1,) float32 device array read when the
    kernel runs, or a float."""
    if isinstance(dloss, cp.ndarray):
        check(kernel, "dloss", dloss, (1,), np.float32)
        return dloss, np.float32(0)
    return np.uint64(0), np.float32(dloss)


class CudaOps:
    """The k_* launchers; CudaBackend sets rt, blas, lt, cublaslt, workspace and attention."""

    fp8 = None  # the FP8 launchers (cuda/fp8.Fp8Ops) once reserve_workspace(fp8=True) made them
    # train.precision=fp8: the engine keeps FP8 copies of the linear weights (W and W^T), written
    # once per optimizer step and read by every product (cuda/fp8.py, the plan's "fp8 weight cache");
    # False: each product quantises its weight itself (the same bytes, more launches). Read when an
    # Engine is made (CudaBackend(fp8_weight_cache=False), or set the attribute before)
    fp8_weight_cache = True
    # train.precision=fp8 with the weight cache: the optimizer's update also takes the cached
    # weights' amax as it writes their compute copy (optim.cu k_adamw_step_amax), so the cache's
    # refresh casts without its amax pass over them (the same amax: a maximum; docs/FP8.md)
    fp8_adamw_amax = True
    # train.precision=fp8, read when an Engine is made (dev/profile_kernels.py and andrea.bench.step
    # --set NAME=0): fp8_keep_xt, the forward product of each layer whose input the model saves
    # (ln1, the attention output, ln2) quantises it into X and X^T at once and keeps X^T (the
    # arena's "fp8 input slots") for the backward's weight-gradient product, which then does not
    # quantise X again; fp8_producer_amax, the layer norms writing ln1 and ln2 also reduce their
    # amax, so their products skip the k_fp8_amax pass. Both give the same bits as off (cuda/fp8.py;
    # the GPU tests passed on an H200). On: ANDREA-120M B=8 18.28 ms a step against 19.11 with
    # both off when they were measured; X^T of the four inputs of a layer (act's 4C wide) is 528.5
    # MB of the arena at that shape (docs/FP8.md)
    fp8_keep_xt = True
    fp8_producer_amax = True
    # train.precision=fp8: the classifier's products in FP8 too (cuda/fp8.py k_fp8_loss_*; the
    # embedding joins the weight cache), its dlogits in the format fp8_dlogits with the scale of its
    # bound |softmax - onehot| <= 1 (no amax pass), rounded onto the grid as fp8_dlogits_rounding
    # says. 1: the backward's two (dX, dW), the logits in bf16; 2: the logits too; 0: the
    # classifier in bf16 (cuBLAS). Read when an Engine is made, as the switches above. 2 by default:
    # with stochastic rounding ANDREA-12M and 120M-synthetic ended within 0.5% of fp16's loss (to
    # nearest: +1.04% with E4M3, +33% with E5M2 at 120M); docs/FP8.md "The classifier"
    fp8_classifier = 2
    fp8_dlogits = FP8_DLOGITS  # "e4m3" (numpy_ref)
    # how dlogits meet the FP8 grid: "stochastic" (loss.cu -DFP8_SR=1, random bits hashed from the
    # logits: no state) or "nearest"
    fp8_dlogits_rounding = FP8_DLOGITS_ROUNDING
    # train.precision=fp8: k_fp8_amax / k_fp8_gelu_amax run this many blocks an SM, each thread
    # taking many 16-byte vectors four at a time; 0: one block per 256 vectors up to MAX_BLOCKS,
    # one or two vectors a thread (the grid before; the same amax either way)
    fp8_amax_blocks = 4
    # train.precision=fp8: k_fp8_gelu_amax takes the GELU of every value of pre (True: its first
    # version) instead of the maximum of max(pre, 0) and one GELU a thread (the same bits; fp8.cu)
    fp8_gelu_amax_full = False
    # train.precision=fp8: the FP8 MLP's GELU and its slope in gelu.cuh's folded form (-DGELU_FMA=1:
    # 14 instructions a value in the dGELU pass against 22; the same function within float32's
    # rounding, other bits); False: the sigmoid form. ANDREA-120M fp8 on an H200: the two GELU
    # passes 0.07 ms a step faster (profile; A/Bs of the step -0.22, +0.02 and, replayed, -0.06 ms),
    # and its own parity runs, 12M and 120M within 0.3% of fp16 (docs/FP8.md)
    fp8_gelu_fma = True
    # train.precision=fp8: rows of the tile of k_fp8_cast_transpose / k_fp8_gelu_cast_transpose (64
    # columns; 64, 128 or 256 rows: each thread has rows / 32 loads in flight; the bytes are the
    # same). 64 measured fastest (ANDREA-120M fp8 step on an H200: 14.75 ms, against 15.37 with 128
    # and 17.27 with 256: fewer, larger blocks leave the SMs less to overlap; docs/FP8.md)
    fp8_tile_rows = 64
    # train.precision=fp8: the cast of the output gradient dY of a layer with a bias (QKV, the
    # attention projection, the MLP's second product) also writes the bias gradient's column
    # partials, one row a tile (k_fp8_cast_transpose_colsum), so the bias gradient reads dY no more;
    # False: k_fp8_cast_transpose, then the two-pass column sums (_colsum_add) read dY again. The
    # sums run in another order, so the bias gradients' last bits differ between the two
    fp8_cast_colsum = True
    # train.precision=fp8: how the scales of the MLP's act and dact are found (cuda/fp8.py,
    # docs/FP8.md). "current": from each tensor's own amax, a pass over it before its cast;
    # "delayed": from the largest amax of the last 16 optimizer steps (the engine's arena and the
    # checkpoint's sidecar keep the history), so the pass that makes the tensor casts it too and
    # no pass takes an amax first. Read when an Engine is made (train.fp8_scaling sets it per run)
    fp8_scaling = "delayed"
    # train.precision=fp8 with delayed scaling: the layer norms writing ln1 and ln2 write them as
    # their products' FP8 operands (and X^T) with the delayed scale, instead of in the compute dtype
    # for a cast after (k_layernorm_fwd_fp8; the same bytes). False: the layer norm, then the cast
    fp8_layernorm_cast = True
    # rows of a block of k_layernorm_fwd_fp8 (8, 16 or 32; the same bytes): ANDREA-120M fp8 B=8 on
    # an H200, one job: 12.89 ms a step with 16 rows and 8 warps, 12.94 with 32 and 8, 13.05 with 8
    # and 8 (its columns of X^T go out 8 bytes a block); docs/FP8.md
    fp8_layernorm_rows = 32
    # warps of a block of k_layernorm_fwd_fp8 (4, 8, 16 or 32; the same bytes): 32 rows and 16 warps
    # write 32 bytes of a column of X^T (a whole sector) a block at the occupancy of 16 rows and 8
    # warps. Measured against 16 and 8 in one process (dev/ab_settings.py, 2026-11-30, H200): the
    # same step (-0.002 ms, the paired median of 7 rounds); default as part of the set that won
    # together (below)
    fp8_layernorm_warps = 16
    # train.precision=fp8 with delayed scaling: the wgmma attention writes its outputs as the FP8
    # operands of the products that read them (attention_hopper.cu's _fp8 kernels; the same bytes):
    # the forward its output also as the attention projection's input and X^T, the backward dqkv
    # only as the QKV product's output gradient, its transpose and the bias's column partials (no
    # 16-bit dqkv, no cast of either). Needs T % 64 == 0 (else the casts run). ANDREA-120M fp8 B=8,
    # H200, one process (dev/ab_settings.py, 2026-11-30): 13.27 ms a step against 13.46 with the
    # casts (paired median -0.23 ms, 7 rounds); with the two switches below as well 13.07
    # (-0.33 ms); the same bits each way (docs/FP8.md)
    fp8_attention_cast = True
    # train.precision=fp8 with delayed scaling: the weight-gradient products (dW = dY^T X) run on a
    # stream of their own inside a backward pass, beside the chain of data gradients (the casts,
    # attention, layer norms) that does not wait for them; fp8(dY)^T then rotates through
    # fp8.WGRAD_RING buffers, and the pass's close joins the stream. The same products and bits.
    # Off by default: timed as the step's graphs replayed (dev/ab_settings.py --replay, 15 rounds,
    # ANDREA-120M on an H200) the step is 0.12 ms faster without it (paired median; earlier
    # A/Bs of whole steps: +0.06, -0.06 and -0.09); the wgrad products take the SMs the chain's
    # memory-bound kernels would leave idle, but slow the chain more than they save
    fp8_wgrad_stream = False

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (the Runtime's switch, cuda/pdl.py): each kernel that
        calls pdl_wait() first launched with the programmatic attribute on sm_90 and newer, so a
        grid starts while the one before it drains; the same bits. Read at every launch, so set
        it before an Engine captures its graphs."""
        return self.rt.pdl

    @pdl.setter
    def pdl(self, on) -> None:
        self.rt.pdl = bool(on)

    # the MLP backward's GELU derivative in cuBLASLt's dGELU epilogue (True) or in k_mlp_bwd_gelu
    # (fp8: k_fp8_dgelu_colsum_amax) after a plain product (False); docs/BENCHMARKS.md and
    # docs/FP8.md have the timings behind the default
    dgelu_epilogue = False
    # the fused attention on wgmma (attention_hopper.cu: the forward, version 8, and the backward's
    # dQ and dK/dV, version 7) on compute capability 9.0; False: version 4's mma.sync kernels
    # everywhere (dev/cuda/harness.py --set hopper_attention=0 times one against the other)
    hopper_attention = True
    # the GELU pass of the MLP backward also writes the first bias's column partials
    # (k_mlp_bwd_gelu_colsum; False: k_mlp_bwd_gelu, then k_colsum_partial reads dact again)
    gelu_colsum = True
    # blocks of the one-pass layer-norm backward (0: LN_BLOCKS or LN_BLOCKS_WIDE by the row width;
    # dev/cuda/harness.py --set ln_blocks=N)
    ln_blocks = 0
    # inside param_grad_pass, the final column sums of the bias and layer-norm weight gradients wait
    # for the end of the pass and run as one k_colsum_final_many (cuda/colsum.py); False: each runs
    # at once, as outside a pass (the same bits; dev/profile_kernels.py --set defer_colsums=0)
    defer_colsums = True
    # B*T up to which k_embed_bwd sorts its keys by rank (k_embed_sort_rank, O(N^2) comparisons over
    # the whole GPU); above it the one-block bitonic sort (k_embed_sort, O(N log^2 N) steps on one
    # SM) is estimated to cost less: ~14 us against 84 us measured at N = 8192, scaled, meet near
    # N = 2^16 (docs/BENCHMARKS.md; dev/cuda/harness.py embed main v1 at growing B*T measures it)
    embed_rank_max = EMBED_RANK_MAX
    # the classifier's row pass (loss.cu version 2): about this many 16-byte vectors of a row per
    # thread, the next row staged in shared memory while this one is computed, and (0: as many as
    # fit on the GPU) the blocks that walk the rows (dev/cuda/loss_rows.py --setting vectors=16,
    # --setting prefetch=0; tests cap the blocks so that each walks many rows; vectors 0: version 1
    # for every row). docs/BENCHMARKS.md has the timings behind the defaults
    loss_vectors = 8
    loss_prefetch = 1
    loss_blocks = 0

    def workspace_rows(self, B: int, T: int, C: int, n_head: int, act_dtype, fp8: bool = False, n_layer: int = 0,
                       vocab: int = 0):
        """[(name, shape, dtype)] of the scratch the kernels take for one model shape: what
        reserve_workspace allocates, for the engine's memory plan. fp8: with the FP8 operands
        and scales of train.precision=fp8 (cuda/fp8.py). n_layer: with the deferred column
        partials of a backward pass of that many layers (cuda/colsum.py; 0: none). vocab: with
        fp8 and CudaOps.fp8_classifier, the FP8 classifier's rows for that many classes."""
        act = np.dtype(act_dtype).name
        N, BH = B * T, B * n_head
        P = 1 << max(1, (N - 1).bit_length())
        if self.attention_variant(act_dtype, C // n_head) == "fused":
            rows = [("attn_D", (BH * T,), "float32")]
        else:
            rows = [("attn_scores", (BH * T * T,), "float32"), ("attn_probs", (BH * T * T,), act),
                    ("attn_heads", (3 * N * C,), act), ("attn_y", (N * C,), act),
                    ("attn_dheads", (3 * N * C,), "float32")]
        partial_rows = max(COLSUM_CHUNKS * 4, self._ln_grid(C))
        bias_chunks = COLSUM_CHUNKS  # partial rows of a bias gradient: more where the FP8 casts write them
        if fp8 and (self.fp8_cast_colsum or self.fp8_scaling == "delayed"):
            bias_chunks = max(bias_chunks, -(-N // int(self.fp8_tile_rows)))
        slot_rows = max(partial_rows, 4 * bias_chunks)  # the widest bias is the MLP's first, 4C
        rows += [("colsum_a", (slot_rows * C,), "float32"), ("colsum_b", (slot_rows * C,), "float32"),
                 ("embed_keys", (P,), "uint32"), ("cublas", (CUBLAS_WORKSPACE,), "uint8")]
        deferred = deferred_floats(n_layer, C, partial_rows, bias_chunks)
        if deferred:
            rows.append((DEFERRED, (deferred,), "float32"))
        if self.cublaslt:
            from .cublaslt import WORKSPACE_BYTES
            rows.append(("cublaslt", (WORKSPACE_BYTES,), "uint8"))
        if fp8:
            from .fp8 import fp8_rows
            rows += fp8_rows(B, T, C, vocab if self.fp8_classifier else 0, bool(self.fp8_wgrad_stream))
        return rows

    def _lt_matmul(self, D, A, B, ta, tb, M, N, K, lda, ldb, ldd, epilogue, bias=None, aux=None, aux_ld=0):
        """One cuBLASLt product with its epilogue; False when it does not apply (the caller falls
        back): cuBLASLt off or not loadable, or no algorithm for the problem."""
        lt = self.lt
        # cuBLASLt's heuristic assumes 256-byte aligned matrices (the arena's views and CuPy's pool are)
        if lt is None or any(x.data.ptr % 256 for x in (D, A, B)):
            return False
        from .cublaslt import NoAlgorithm
        ab, d = cuda_type(A.dtype), cuda_type(D.dtype)
        try:
            lt.matmul(D, A, B, ta, tb, M, N, K, lda, ldb, ldd, ab, d, epilogue, bias=bias,
                      bias_type=cuda_type(bias.dtype) if bias is not None else None, aux=aux, aux_ld=aux_ld)
        except NoAlgorithm:
            return False
        return True

    @contextlib.contextmanager
    def param_grad_pass(self, start=None):
        """A backward pass's parameter gradients (model.backward opens it): inside it the final
        column sums of the bias and layer-norm weight gradients wait, each set of partials in its
        own slice of the reserved buffer, and run as one launch when the outermost pass closes
        (cuda/colsum.py); the same bits as when each runs at once. Closing with an exception
        drops the waiting sums.
        start: the float32 buffer of parameter gradients this pass starts (the first microbatch
        of a step): its old contents count as zero, so the first contribution to each part of it
        is written, not added (products with beta 0, column sums that do not read the gradient,
        the embedding's gradients set to zero first), and what no kernel wrote is zeroed when the
        pass closes. So the optimizer need not zero the gradients after each step."""
        buf = self.workspace.reserved(DEFERRED, np.float32) if self.defer_colsums else None
        outer = self.colsums.depth == 0
        if outer:
            self._pg_start, self._pg_written = start, []
        self.colsums.open(buf)
        try:
            yield
        except BaseException:
            if self.fp8 is not None and outer:
                self.fp8.join_wgrad()
            self.colsums.close(flush=False)
            if outer:
                self._pg_start = None
            raise
        if self.fp8 is not None and outer:
            self.fp8.join_wgrad()  # the weight-gradient stream's products (CudaOps.fp8_wgrad_stream)
        self.colsums.close()
        if outer:
            self._zero_unwritten()

    _pg_start = None  # the gradient buffer an open pass starts (param_grad_pass(start=...)), or None
    _pg_written: list = []

    def _param_write(self, out) -> bool:
        """True if out (a parameter gradient) lies in the buffer the open pass starts and no kernel
        of the pass has written it yet: its first contribution is then written, not added. Marks
        it written either way."""
        st = self._pg_start
        if st is None:
            return False
        lo, hi = out.data.ptr, out.data.ptr + out.nbytes
        if not (st.data.ptr <= lo and hi <= st.data.ptr + st.nbytes):
            return False
        if any(a < hi and lo < b for a, b in self._pg_written):
            if not any(a <= lo and hi <= b for a, b in self._pg_written):
                raise RuntimeError("param_grad_pass: a gradient written in part by an earlier kernel of the pass")
            return False
        self._pg_written.append((lo, hi))
        return True

    def _zero_unwritten(self) -> None:
        """The end of a pass that started a gradient buffer: zero whatever no kernel wrote (e.g. a
        parameter the model did not use, the padding ZeRO-1 adds to the flat buffer)."""
        st, written = self._pg_start, sorted(self._pg_written)
        self._pg_start, self._pg_written = None, []
        if st is None:
            return
        stream = cp.cuda.get_current_stream().ptr
        pos, end = st.data.ptr, st.data.ptr + st.nbytes
        for a, b in written + [(end, end)]:
            if a > pos:
                cp.cuda.runtime.memsetAsync(pos, 0, a - pos, stream)
            pos = max(pos, b)

    def _colsum_partials(self, slot: str, chunks: int, Cc: int):
        """Where a kernel writes chunks x Cc float32 column partials: the next slice of the
        deferred buffer inside a parameter-gradient pass (while it has room), else workspace slot."""
        part = self.colsums.take(chunks * Cc)
        return part if part is not None else self.workspace.get(slot, chunks * Cc, np.float32)

    def _colsum_final(self, out, part, chunks: int, Cc: int):
        """out (Cc,) float32 += the in-order sum of part's chunks (k_colsum_final; written instead
        where the pass starts out: _param_write): now, or at the end of the pass where part is a
        slice of the deferred buffer."""
        self.colsums.finish(out, part, chunks, Cc, self._param_write(out))

    def _colsum_add(self, out, x, N: int, Cc: int, slot="colsum_a"):
        """out (Cc,) float32 += column sums of x (N, Cc), in two fixed-order passes."""
        rpc, chunks = colsum_chunks(N)
        part = self._colsum_partials(slot, chunks, Cc)
        vec = 16 // x.dtype.itemsize  # k_colsum_partial_vec: a 16-byte vector of columns a thread, same bits
        kernel, cols = ("k_colsum_partial_vec", 32 * vec) if Cc % vec == 0 and x.data.ptr % 16 == 0 \
            else ("k_colsum_partial", 32)
        self.rt.launch("linear.cu", kernel, x.dtype, (-(-Cc // cols), chunks), (32, 8),
                       (part, x, i64(N), i32(Cc), i32(rpc)))
        self._colsum_final(out, part, chunks, Cc)

    # ------------------------------------------------------------ embedding
    def k_embed_fwd(self, out, tokens, wte, wpe):
        """out (B,T,C) = wte[tokens] + wpe[:T]; tokens (B,T) int32."""
        B, T = tokens.shape
        V, C = wte.shape
        ct = wte.dtype
        check("k_embed_fwd", "tokens", tokens, dtype=np.int32)
        check("k_embed_fwd", "wte", wte, dtype=ct)
        check("k_embed_fwd", "wpe", wpe, dtype=ct)
        check("k_embed_fwd", "out", out, (B, T, C), ct)
        if wpe.shape[0] < T or wpe.shape[1] != C:
            raise ValueError(f"k_embed_fwd: wpe has shape {wpe.shape}, needs at least ({T}, {C})")
        N = B * T
        self.rt.launch("embed.cu", "k_embed_fwd", ct, min(N, MAX_BLOCKS), THREADS,
                       (out, tokens, wte, wpe, i32(N), i32(T), i32(C), i32(V)))

    def k_embed_bwd(self, dwte, dwpe, dout, tokens):
        """dwte[tokens] += dout, dwpe[:T] += sum over batch of dout; no atomics (sorted tokens)."""
        B, T = tokens.shape
        V, C = dwte.shape
        ct = dout.dtype
        check("k_embed_bwd", "tokens", tokens, dtype=np.int32)
        check("k_embed_bwd", "dwte", dwte, dtype=np.float32)
        check("k_embed_bwd", "dwpe", dwpe, dtype=np.float32)
        check("k_embed_bwd", "dout", dout, (B, T, C))
        N = B * T
        shift = max(1, (N - 1).bit_length())
        if V << shift >= 1 << 32:
            raise ValueError(f"k_embed_bwd: vocab {V} with B*T={N} overflows the 32-bit sort key")
        P = 1 << shift
        keys = self.workspace.get("embed_keys", P, np.uint32)
        if N <= self.embed_rank_max:
            self.rt.launch("embed.cu", "k_embed_sort_rank", ct, -(-N // EMBED_RANK_KEYS), THREADS,
                           (keys, tokens, i32(N), i32(P), i32(shift)))
        else:
            use_shared = P * 4 <= 48 * 1024
            self.rt.launch("embed.cu", "k_embed_sort", ct, 1, 1024,
                           (keys, tokens, i32(N), i32(P), i32(shift), i32(int(use_shared))),
                           shared_mem=P * 4 if use_shared else 0)
        stream = cp.cuda.get_current_stream().ptr
        for grad in (dwte, dwpe):  # a starting pass: the kernels below add, so zero first (the
            if self._param_write(grad):  # model's classifier has written the tied dwte before)
                cp.cuda.runtime.memsetAsync(grad.data.ptr, 0, grad.nbytes, stream)
        self.rt.launch("embed.cu", "k_embed_bwd_wte", ct, -(-N // EMBED_WTE_WARPS), 32 * EMBED_WTE_WARPS,
                       (dwte, keys, dout, i32(N), i32(C), i32(shift)))
        self.rt.launch("embed.cu", "k_embed_bwd_wpe", ct, -(-(T * C) // THREADS), THREADS,
                       (dwpe, dout, i32(B), i32(T), i32(C)))

    # ------------------------------------------------------------ layer norm
    def k_layernorm_fwd(self, out, mean, rstd, inp, weight, bias, amax=None):
        """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T) float32.
        amax: None, or float32 whose [0] gets max |out| (as k_fp8_amax; train.precision=fp8)."""
        C = inp.shape[-1]
        ct = inp.dtype
        for n, a in (("out", out), ("inp", inp)):
            check("k_layernorm_fwd", n, a, inp.shape, ct)
        for n, a in (("weight", weight), ("bias", bias)):
            check("k_layernorm_fwd", n, a, (C,), ct)
        for n, a in (("mean", mean), ("rstd", rstd)):
            check("k_layernorm_fwd", n, a, inp.shape[:-1], np.float32)
        N = inp.size // C
        if amax is None and self._layernorm_fwd_fp8(None, out, mean, rstd, inp, None, weight, bias):
            return
        am = self._ln_amax("k_layernorm_fwd", out, amax)
        if not self._layernorm_fwd_vec(None, out, mean, rstd, inp, None, weight, bias, am):
            self.rt.launch("layernorm.cu", "k_layernorm_fwd", ct, -(-N // 8), THREADS,
                           (out, mean, rstd, inp, weight, bias, i64(N), i32(C), am))

    def k_residual_layernorm_fwd(self, res, out, mean, rstd, a, b, weight, bias, amax=None):
        """res = a + b (the residual stream), then out = layer norm of res, in one pass. amax: as
        k_layernorm_fwd's (of out)."""
        C = a.shape[-1]
        ct = a.dtype
        for n, x in (("res", res), ("out", out), ("a", a), ("b", b)):
            check("k_residual_layernorm_fwd", n, x, a.shape, ct)
        for n, x in (("weight", weight), ("bias", bias)):
            check("k_residual_layernorm_fwd", n, x, (C,), ct)
        for n, x in (("mean", mean), ("rstd", rstd)):
            check("k_residual_layernorm_fwd", n, x, a.shape[:-1], np.float32)
        N = a.size // C
        if amax is None and self._layernorm_fwd_fp8(res, out, mean, rstd, a, b, weight, bias):
            return
        am = self._ln_amax("k_residual_layernorm_fwd", out, amax)
        if not self._layernorm_fwd_vec(res, out, mean, rstd, a, b, weight, bias, am):
            self.rt.launch("layernorm.cu", "k_residual_layernorm_fwd", ct, -(-N // 8), THREADS,
                           (res, out, mean, rstd, a, b, weight, bias, i64(N), i32(C), am))

    def _ln_amax(self, kernel, out, amax):
        """The layer-norm forward kernels' amax pointer: amax where given (its [0] zeroed here
        first), else, with train.precision=fp8, the input slot of the FP8 product that reads out
        (Fp8Ops.producer_amax: with CudaOps.fp8_producer_amax, for ln1 and ln2), else null."""
        if amax is not None:
            check(kernel, "amax", amax, dtype=np.float32)
            cp.cuda.runtime.memsetAsync(amax.data.ptr, 0, 4, cp.cuda.get_current_stream().ptr)
            return amax
        meta = self.fp8.producer_amax(out) if self.fp8 is not None else None
        return np.uint64(0) if meta is None else meta

    def _layernorm_fwd_fp8(self, res, out, mean, rstd, a, b, weight, bias) -> bool:
        """train.precision=fp8: where out is an input whose FP8 operand the layer norm may write
        itself (Fp8Ops.layernorm_operand: a delayed scale with a history, X^T kept), the layer norm
        writes that operand and X^T instead of out (k_layernorm_fwd_fp8; out is not written), for
        rows the vector kernel takes. False where it does not (the caller writes out)."""
        if self.fp8 is None or not self._ln_vec_rows(a, (res, out, a, b, weight, bias)):
            return False
        target = self.fp8.layernorm_operand(out)
        if target is None:
            return False
        q, q_t, row, rec = target
        self.fp8.k_layernorm_fwd_fp8(q, q_t, res, mean, rstd, a, b, weight, bias, row, rec)
        return True

    @staticmethod
    def _ln_vec_rows(a, bufs) -> bool:
        """Rows of a in whole 16-byte vectors, no wider than the vector kernels hold, every buffer
        16-byte aligned: what the layer norms' vector kernels take."""
        C = a.shape[-1]
        return C <= LN_FUSED_MAXC and C % (16 // a.dtype.itemsize) == 0 and all(
            x.data.ptr % 16 == 0 for x in bufs if x is not None)

    def _layernorm_fwd_vec(self, res, out, mean, rstd, a, b, weight, bias, amax) -> bool:
        """Version 2 of the layer-norm forward (16-byte loads, the row in registers, compiled for
        the row width) where the rows are whole aligned vectors; b None: no residual. False where
        it does not apply (the caller launches version 1)."""
        C = a.shape[-1]
        vec = 16 // a.dtype.itemsize
        if not self._ln_vec_rows(a, (res, out, a, b, weight, bias)):
            return False
        null = np.uint64(0)
        N = a.size // C
        self.rt.launch("layernorm.cu", "k_layernorm_fwd_vec", a.dtype, -(-N // 8), THREADS,
                       (null if res is None else res, out, mean, rstd, a, null if b is None else b, weight, bias,
                        i64(N), i32(C), amax), defs=(f"-DLN_MAXC={-(-C // (32 * vec)) * 32 * vec}",))
        return True

    def _ln_grid(self, C: int) -> int:
        """Blocks of the one-pass layer-norm backward over rows of C columns."""
        return self.ln_blocks or (LN_BLOCKS_WIDE if C >= LN_WIDE else LN_BLOCKS)

    def k_layernorm_bwd(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True):
        """Adds into dinp (B,T,C) (compute dtype; accumulate=False writes it), dweight, dbias (C,)
        float32."""
        C = inp.shape[-1]
        ct = inp.dtype
        for n, a in (("dinp", dinp), ("dout", dout), ("inp", inp)):
            check("k_layernorm_bwd", n, a, inp.shape, ct)
        check("k_layernorm_bwd", "weight", weight, (C,), ct)
        for n, a in (("dweight", dweight), ("dbias", dbias)):
            check("k_layernorm_bwd", n, a, (C,), np.float32)
        for n, a in (("mean", mean), ("rstd", rstd)):
            check("k_layernorm_bwd", n, a, inp.shape[:-1], np.float32)
        N = inp.size // C
        vec = 16 // inp.dtype.itemsize  # version 5 loads rows as whole 16-byte vectors
        if C <= LN_FUSED_MAXC and C % vec == 0 and all(a.data.ptr % 16 == 0 for a in (dinp, dout, inp, weight)):
            # version 5: rows, then columns, in each block; its partials of dweight/dbias added in block order
            rpb = -(-N // self._ln_grid(C))
            n_blocks = -(-N // rpb)
            pdw = self._colsum_partials("colsum_a", n_blocks, C)
            pdb = self._colsum_partials("colsum_b", n_blocks, C)
            self.rt.launch("layernorm.cu", "k_layernorm_bwd_fused", ct, n_blocks, THREADS,
                           (dinp, pdw, pdb, dout, inp, weight, mean, rstd, i64(N), i32(C), i32(rpb)),
                           defs=(f"-DLN_MAXC={-(-C // (32 * vec)) * 32 * vec}", f"-DLN_ACCUMULATE={int(bool(accumulate))}"))
            self._colsum_final(dweight, pdw, n_blocks, C)
            self._colsum_final(dbias, pdb, n_blocks, C)
            return
        # version 1: a row pass for dinp, then column partials added by k_colsum_final (version 2 of
        # the one-pass kernel is in git history; version 4, a grid sized to the SMs with its own
        # reduction tree, measured slower: docs/BENCHMARKS.md)
        self.rt.launch("layernorm.cu", "k_layernorm_bwd_dx", ct, -(-N // 8), THREADS,
                       (dinp, dout, inp, weight, mean, rstd, i64(N), i32(C), i32(int(accumulate))))
        rpb, n_blocks = colsum_chunks(N)
        pdw = self._colsum_partials("colsum_a", n_blocks, C)
        pdb = self._colsum_partials("colsum_b", n_blocks, C)
        self.rt.launch("layernorm.cu", "k_layernorm_bwd_partial", ct, (-(-C // 32), n_blocks), (32, 8),
                       (pdw, pdb, dout, inp, mean, rstd, i64(N), i32(C), i32(rpb)))
        self._colsum_final(dweight, pdw, n_blocks, C)
        self._colsum_final(dbias, pdb, n_blocks, C)

    # ------------------------------------------------------------ linear layers (shared)
    def _linear_fwd(self, kernel, out, inp, w, b, bias=True):
        """out (N, OC) = inp (N, IC) @ w (OC, IC).T (+ b). With the FP8 path on, the layers'
        products (those with a bias) run in FP8 (cuda/fp8.py)."""
        if bias and self.fp8 is not None:
            return self.fp8.k_fp8_linear_fwd(out, inp, w, b)
        OC, IC = w.shape
        ct = w.dtype
        check(kernel, "inp", inp, dtype=ct)
        check(kernel, "w", w, dtype=ct)
        if inp.shape[-1] != IC:
            raise ValueError(f"{kernel}: inp has shape {inp.shape}, its last axis must be {IC}")
        N = inp.size // IC
        check(kernel, "out", out, inp.shape[:-1] + (OC,), ct)
        if bias:
            check(kernel, "b", b, (OC,), ct)
            if self._lt_matmul(out, inp, w, False, True, N, OC, IC, IC, IC, OC, "bias", bias=b):
                return
        self.blas.gemm(out, inp, w, False, True, N, OC, IC, IC, IC, OC)
        if bias:
            self.rt.launch("linear.cu", "k_bias_add", ct, min(N, MAX_BLOCKS), THREADS, (out, b, i64(N), i32(OC)))

    def _linear_bwd(self, kernel, dinp, dw, db, dout, inp, w, accumulate=True, db_partials=None):
        """dinp (N, IC) += dout @ w (accumulate=False: =, beta 0); dw (OC, IC) += dout.T @ inp;
        db (OC,) += column sums of dout, or, with db_partials = (partials, chunks), of those column
        partials (k_colsum_partial's form) that the kernel which wrote dout also wrote."""
        if self.fp8 is not None:
            return self.fp8.k_fp8_linear_bwd(dinp, dw, db, dout, inp, w, accumulate=accumulate)
        OC, IC = w.shape
        ct = w.dtype
        N = inp.size // IC
        check(kernel, "inp", inp, dtype=ct)
        check(kernel, "dinp", dinp, inp.shape, ct)
        check(kernel, "dout", dout, inp.shape[:-1] + (OC,), ct)
        check(kernel, "dw", dw, (OC, IC), np.float32)
        check(kernel, "db", db, (OC,), np.float32)
        blas = self.blas
        blas.gemm(dinp, dout, w, False, False, N, IC, OC, OC, IC, IC, beta=1.0 if accumulate else 0.0)
        beta_w = 0.0 if self._param_write(dw) else 1.0  # written by the first kernel of a starting pass
        blas.gemm(dw, dout, inp, True, False, OC, IC, N, OC, IC, IC, beta=beta_w)
        if db_partials is None:
            self._colsum_add(db, dout, N, OC)
        else:
            part, chunks = db_partials
            self._colsum_final(db, part, chunks, OC)

    def k_attn_qkv_fwd(self, qkv, inp, w, b):
        """qkv (B,T,3C) = inp (B,T,C) @ w (3C,C).T + b (3C,)."""
        self._linear_fwd("k_attn_qkv_fwd", qkv, inp, w, b)

    def k_attn_qkv_bwd(self, dinp, dw, db, dqkv, inp, w, accumulate=True):
        """Adds into dinp (B,T,C), dw (3C,C), db (3C,); accumulate=False writes dinp."""
        self._linear_bwd("k_attn_qkv_bwd", dinp, dw, db, dqkv, inp, w, accumulate)

    # ------------------------------------------------------------ attention
    def attention_variant(self, dtype, head_size: int) -> str:
        """The path k_attn_fwd/_bwd take for this compute dtype and head size (arrays 16-byte
        aligned, as the engine's are): "fused" (version 4) or "materialised" (version 1)."""
        fused = (self.attention == "fused" and np.dtype(dtype) != np.float32
                 and head_size in FLASH_HEAD_SIZES and _device_fits_flash(head_size))
        return "fused" if fused else "materialised"

    def attention_kernels(self, dtype, head_size: int) -> str:
        """Which kernels k_attn_fwd/_bwd run for this dtype and head size, for the memory plan's line."""
        if self.attention_variant(dtype, head_size) != "fused":
            return "materialised (version 1: cuBLAS products, T x T scores)"
        if self._hopper(head_size):
            return "fused: wgmma, sm_90a (attention_hopper.cu: forward version 8, backward: dQ version 10, dK/dV version 7)"
        return "fused: mma.sync (version 4)"

    def _hopper(self, hs: int) -> bool:
        """The fused path's forward and the backward's dQ and dK/dV come from attention_hopper.cu
        (wgmma): compute capability 9.0, CudaOps.hopper_attention set, and the tiles fit the device."""
        return (self.hopper_attention and hs in FLASH_HEAD_SIZES
                and _device_takes_hopper(cp.cuda.Device().id, hs))

    def _fused(self, dtype, hs, *arrays) -> bool:
        """Version 4 applies: attention_variant says so, and every array is 16-byte aligned (its
        tiles are copied 16 bytes at a time)."""
        return (self.attention_variant(dtype, hs) == "fused"
                and all(a.data.ptr % 16 == 0 for a in arrays))

    def _attn_scores(self, qkv, B, T, C, NH, hs):
        """Split heads and compute S = Q K^T / sqrt(hs) (float32 workspace). Returns q, k, v, S."""
        ct = qkv.dtype
        N, BH = B * T, B * NH
        heads = self.workspace.get("attn_heads", 3 * N * C, ct)
        q, k, v = heads[:N * C], heads[N * C:2 * N * C], heads[2 * N * C:]
        self.rt.launch("attention.cu", "k_attn_split_heads", ct, min(B * T, MAX_BLOCKS), THREADS,
                       (q, k, v, qkv, i32(B), i32(T), i32(NH), i32(hs)))
        S = self.workspace.get("attn_scores", BH * T * T, np.float32)
        self.blas.gemm(S, q, k, False, True, T, T, hs, hs, hs, T, alpha=1.0 / math.sqrt(hs),
                       batch=BH, stride_a=T * hs, stride_b=T * hs, stride_c=T * T)
        return q, k, v, S

    def k_attn_fwd(self, out, lse, qkv, n_head):
        """Causal softmax(q k^T / sqrt(hs)) v into out (B,T,C); lse (B,NH,T) float32."""
        B, T, C, NH, hs = _attn_shapes("k_attn_fwd", qkv, n_head)
        ct = qkv.dtype
        check("k_attn_fwd", "out", out, (B, T, C), ct)
        check("k_attn_fwd", "lse", lse, (B, NH, T), np.float32)
        scale = attn_scale(hs)
        if self._fused(ct, hs, qkv, out):
            args = (out, lse, qkv, i32(B), i32(T), i32(NH), scale)
            if self._attn_fwd_fp8(out, lse, qkv, n_head, T, C, hs):
                return
            if self._hopper(hs):  # version 8: wgmma, 256 threads, 128 query rows a block
                geo = hopper_geometry(hs)
                self.rt.launch("attention_hopper.cu", "k_attn_flash_fwd", ct, (B * NH, -(-T // geo["fwd_rows"])),
                               geo["threads"], args, shared_mem=geo["k_attn_flash_fwd"], hs=hs, arch="sm_90a")
                return
            geo = flash_geometry(hs)
            self.rt.launch("attention.cu", "k_attn_flash_fwd", ct, (B * NH, -(-T // geo["fwd_rows"])), 128,
                           args, shared_mem=geo["k_attn_flash_fwd"], hs=hs)
            return
        q, k, v, S = self._attn_scores(qkv, B, T, C, NH, hs)
        BH = B * NH
        P = self.workspace.get("attn_probs", BH * T * T, ct)
        self.rt.launch("attention.cu", "k_attn_softmax", ct, -(-(BH * T) // 8), THREADS,
                       (P, lse, S, i64(BH * T), i32(T), i32(1)))
        y = self.workspace.get("attn_y", B * T * C, ct)
        self.blas.gemm(y, P, v, False, False, T, hs, T, T, hs, hs,
                       batch=BH, stride_a=T * T, stride_b=T * hs, stride_c=T * hs)
        self.rt.launch("attention.cu", "k_attn_merge_heads", ct, min(B * T, MAX_BLOCKS), THREADS,
                       (out, y, i32(B), i32(T), i32(NH), i32(hs)))

    def _attn_fp8_applies(self, T, C, hs) -> bool:
        """The FP8 attention kernels (CudaOps.fp8_attention_cast) can run: the FP8 path and the
        switch are on, and their shapes fit (Fp8Ops.attention_fits)."""
        return self.fp8 is not None and self.fp8_attention_cast and self.fp8.attention_fits(T, C, hs)

    def _attn_fwd_fp8(self, out, lse, qkv, n_head, T, C, hs) -> bool:
        """train.precision=fp8: where out is the input whose FP8 operand the attention may write
        itself (Fp8Ops.attention_operand), k_attn_fwd_fp8 writes out and that operand with X^T.
        False where it does not (the caller launches the forward)."""
        if not self._attn_fp8_applies(T, C, hs):
            return False
        target = self.fp8.attention_operand(out)
        if target is None:
            return False
        q, q_t, row, rec = target
        self.fp8.k_attn_fwd_fp8(out, lse, q, q_t, row, rec, qkv, n_head)
        return True

    def _attn_bwd_fp8(self, dqkv, dout, qkv, out, lse, n_head, T, C, hs) -> bool:
        """train.precision=fp8: where dqkv is the output gradient the QKV product's backward will
        take in FP8 (Fp8Ops.attention_grad_operand), k_attn_bwd_fp8 writes it so, with its column
        partials and amax, and not dqkv. False where it does not (the caller writes dqkv)."""
        if not self._attn_fp8_applies(T, C, hs):
            return False
        target = self.fp8.attention_grad_operand(dqkv, qkv)
        if target is None:
            return False
        q, q_t, row, rec, partial, fmt = target
        self.fp8.k_attn_bwd_fp8(q, q_t, partial, row, rec, dout, qkv, out, lse, n_head, fmt)
        return True

    def k_attn_bwd(self, dqkv, dout, qkv, out, lse, n_head, accumulate=True):
        """Adds into dqkv (B,T,3C) (accumulate=False: writes it); recomputes P from S and the
        saved lse."""
        B, T, C, NH, hs = _attn_shapes("k_attn_bwd", qkv, n_head)
        ct = qkv.dtype
        check("k_attn_bwd", "dqkv", dqkv, qkv.shape, ct)
        check("k_attn_bwd", "dout", dout, (B, T, C), ct)
        check("k_attn_bwd", "out", out, (B, T, C), ct)
        check("k_attn_bwd", "lse", lse, (B, NH, T), np.float32)
        blas, N, BH = self.blas, B * T, B * NH
        if self.fp8 is not None:
            self.fp8.drop_pending_dy()  # an earlier backward's, never taken: not this dqkv's
        if self._fused(ct, hs, dqkv, qkv, dout, out):
            if not accumulate and self._attn_bwd_fp8(dqkv, dout, qkv, out, lse, n_head, T, C, hs):
                return
            scale = attn_scale(hs)
            D = self.workspace.get("attn_D", BH * T, np.float32)
            dims = (i32(B), i32(T), i32(NH), scale, i32(int(accumulate)))
            if self._hopper(hs):  # wgmma: the dQ kernel (version 10) writes D, which dK/dV (version 7) reads
                geo, hop = hopper_geometry(hs), dict(hs=hs, arch="sm_90a")
                self.rt.launch("attention_hopper.cu", "k_attn_flash_bwd_dq", ct, (BH, -(-T // geo["rows"])),
                               geo["threads"], (dqkv, qkv, dout, out, lse, D) + dims,
                               shared_mem=geo["k_attn_flash_bwd_dq"], **hop)
                self.rt.launch("attention_hopper.cu", "k_attn_flash_bwd_dkv", ct, (BH, -(-T // geo["keys"])),
                               geo["dkv_threads"], (dqkv, qkv, dout, lse, D) + dims,
                               shared_mem=geo["k_attn_flash_bwd_dkv"], **hop)
                return
            self.rt.launch("attention.cu", "k_attn_flash_D", ct, -(-(BH * T) // THREADS), THREADS,
                           (D, dout, out, i32(B), i32(T), i32(NH)), hs=hs)
            args = (dqkv, qkv, dout, lse, D) + dims
            geo = flash_geometry(hs)
            for kernel in ("k_attn_flash_bwd_dq", "k_attn_flash_bwd_dkv"):  # 64 query / key rows a block
                self.rt.launch("attention.cu", kernel, ct, (BH, -(-T // 64)), 128, args,
                               shared_mem=geo[kernel], hs=hs)
            return
        q, k, v, S = self._attn_scores(qkv, B, T, C, NH, hs)
        P = self.workspace.get("attn_probs", BH * T * T, ct)
        self.rt.launch("attention.cu", "k_attn_softmax", ct, -(-(BH * T) // 8), THREADS,
                       (P, lse, S, i64(BH * T), i32(T), i32(0)))
        dy = self.workspace.get("attn_y", N * C, ct)
        self.rt.launch("attention.cu", "k_attn_split_dout", ct, min(B * T, MAX_BLOCKS), THREADS,
                       (dy, dout, i32(B), i32(T), i32(NH), i32(hs)))
        dh = self.workspace.get("attn_dheads", 3 * N * C, np.float32)
        dq, dk, dv = dh[:N * C], dh[N * C:2 * N * C], dh[2 * N * C:]
        th, tt = T * hs, T * T
        blas.gemm(dv, P, dy, True, False, T, hs, T, T, hs, hs, batch=BH, stride_a=tt, stride_b=th, stride_c=th)
        blas.gemm(S, dy, v, False, True, T, T, hs, hs, hs, T, batch=BH, stride_a=th, stride_b=th, stride_c=tt)
        self.rt.launch("attention.cu", "k_attn_dscores", ct, -(-(BH * T) // 8), THREADS,
                       (P, S, dout, out, i64(BH * T), i32(T), i32(NH), i32(hs), attn_scale(hs)))
        blas.gemm(dq, P, k, False, False, T, hs, T, T, hs, hs, batch=BH, stride_a=tt, stride_b=th, stride_c=th)
        blas.gemm(dk, P, q, True, False, T, hs, T, T, hs, hs, batch=BH, stride_a=tt, stride_b=th, stride_c=th)
        self.rt.launch("attention.cu", "k_attn_merge_grads", ct, min(B * T, MAX_BLOCKS), THREADS,
                       (dqkv, dq, dk, dv, i32(B), i32(T), i32(NH), i32(hs), i32(int(accumulate))))

    def k_attn_decode_fwd(self, out, kcache, vcache, qkv, pos, n_head):
        """One new position against the KV cache (inference only): writes its k, v into row pos of
        kcache, vcache (B,ctx,C), then out (B,1,C) = its causal attention over rows 0..pos."""
        B, T, C, NH, hs = _attn_shapes("k_attn_decode_fwd", qkv, n_head)
        ct = qkv.dtype
        if T != 1:
            raise ValueError(f"k_attn_decode_fwd: qkv has {T} positions, expected 1 (shape (B, 1, 3C))")
        ctx = kcache.shape[1] if kcache.ndim == 3 else 0
        check("k_attn_decode_fwd", "kcache", kcache, (B, ctx, C), ct)
        check("k_attn_decode_fwd", "vcache", vcache, (B, ctx, C), ct)
        check("k_attn_decode_fwd", "out", out, (B, 1, C), ct)
        if not 0 <= pos < ctx:
            raise ValueError(f"k_attn_decode_fwd: pos {pos} outside the cache's {ctx} rows")
        self.rt.launch("decode.cu", "k_attn_decode_fwd", ct, (NH, B), 128,
                       (out, kcache, vcache, qkv, i32(NH), i32(hs), i32(ctx), i32(pos),
                        attn_scale(hs)),
                       shared_mem=4 * (ctx + hs + 32))

    def k_attn_out_fwd(self, out, inp, w, b):
        """out (B,T,C) = inp (B,T,C) @ w (C,C).T + b: the output projection W_O."""
        self._linear_fwd("k_attn_out_fwd", out, inp, w, b)

    def k_attn_out_bwd(self, dinp, dw, db, dout, inp, w, accumulate=True):
        """Adds into dinp (B,T,C), dw (C,C), db (C,); accumulate=False writes dinp."""
        self._linear_bwd("k_attn_out_bwd", dinp, dw, db, dout, inp, w, accumulate)

    # ------------------------------------------------------------ MLP
    def k_mlp_fwd(self, out, pre, act, inp, w1, b1, w2, b2):
        """out (B,T,C) = gelu_tanh(inp @ w1.T + b1) @ w2.T + b2; saves pre (B,T,4C); act workspace."""
        if self.fp8 is not None:
            return self.fp8.k_fp8_mlp_fwd(out, pre, act, inp, w1, b1, w2, b2)
        H, C = w1.shape
        ct = w1.dtype
        check("k_mlp_fwd", "pre", pre, inp.shape[:-1] + (H,), ct)
        check("k_mlp_fwd", "act", act, pre.shape, ct)
        check("k_mlp_fwd", "b1", b1, (H,), ct)
        check("k_mlp_fwd", "w2", w2, (C, H), ct)
        check("k_mlp_fwd", "inp", inp, dtype=ct)
        N = inp.size // C
        # cuBLASLt: act = gelu(inp @ w1.T + b1) with pre saved by the epilogue, in one product
        if not self._lt_matmul(act, inp, w1, False, True, N, H, C, C, C, H, "gelu_aux_bias", bias=b1,
                               aux=pre, aux_ld=H):
            self._linear_fwd("k_mlp_fwd", pre, inp, w1, None, bias=False)
            self.rt.launch("mlp.cu", "k_mlp_fwd_bias_gelu", ct, min(N, MAX_BLOCKS), THREADS, (pre, act, b1, i64(N), i32(H)))
        self._linear_fwd("k_mlp_fwd", out, act, w2, b2)

    def k_mlp_bwd(self, dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, accumulate=True):
        """Adds into dinp, dw1 (4C,C), db1, dw2 (C,4C), db2 (accumulate=False writes dinp). act,
        dact (B,T,4C) are workspace."""
        if self.fp8 is not None:
            return self.fp8.k_fp8_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact,
                                          accumulate=accumulate)
        H, C = w1.shape
        ct = w1.dtype
        for n, a in (("pre", pre), ("act", act), ("dact", dact)):
            check("k_mlp_bwd", n, a, inp.shape[:-1] + (H,), ct)
        check("k_mlp_bwd", "w2", w2, (C, H), ct)
        check("k_mlp_bwd", "dout", dout, inp.shape, ct)
        check("k_mlp_bwd", "dw2", dw2, (C, H), np.float32)
        check("k_mlp_bwd", "db2", db2, (C,), np.float32)
        N = inp.size // C
        blas, gelu_grid = self.blas, blocks(-(-N * H // 8))  # 16-byte vectors of 8 halves
        db1_done = None  # (partials, chunks) when the GELU pass wrote db1's column partials
        # dact = (dout @ w2) * gelu'(pre) (overwrites) and act = gelu(pre) for dw2: the product, then
        # one pass over pre for both (or cuBLASLt's dGELU epilogue where dgelu_epilogue is set)
        if self.dgelu_epilogue and self._lt_matmul(dact, dout, w2, False, False, N, H, C, C, H, H, "dgelu",
                                                   aux=pre, aux_ld=H):
            self.rt.launch("mlp.cu", "k_mlp_bwd_gelu", ct, gelu_grid, THREADS, (act, np.uint64(0), pre, i64(N * H)))
        else:
            blas.gemm(dact, dout, w2, False, False, N, H, C, C, H, H)
            vec = 16 // np.dtype(ct).itemsize
            if self.gelu_colsum and H % vec == 0 and all(a.data.ptr % 16 == 0 for a in (act, dact, pre)):
                # the pass also writes db1's column partials, so the sums do not read dact again
                rpc, chunks = colsum_chunks(N)
                part = self._colsum_partials("colsum_b", chunks, H)  # colsum_a: db2's below
                self.rt.launch("mlp.cu", "k_mlp_bwd_gelu_colsum", ct, (-(-H // (32 * vec)), chunks), (32, 8),
                               (part, act, dact, pre, i64(N), i32(H), i32(rpc)))
                db1_done = (part, chunks)
            else:
                self.rt.launch("mlp.cu", "k_mlp_bwd_gelu", ct, gelu_grid, THREADS, (act, dact, pre, i64(N * H)))
        blas.gemm(dw2, dout, act, True, False, C, H, N, C, H, H, beta=0.0 if self._param_write(dw2) else 1.0)
        self._colsum_add(db2, dout, N, C)
        self._linear_bwd("k_mlp_bwd", dinp, dw1, db1, dact, inp, w1, accumulate, db_partials=db1_done)

    # ------------------------------------------------------------ residual
    def k_residual_add(self, out, a, b):
        """out = a + b."""
        for n, x in (("out", out), ("a", a), ("b", b)):
            check("k_residual_add", n, x, a.shape, a.dtype)
        self.rt.launch("residual.cu", "k_residual_add", a.dtype, blocks(a.size), THREADS, (out, a, b, i64(a.size)))

    def k_residual_add_bwd(self, da, db, dout):
        """da += dout, db += dout."""
        for n, x in (("da", da), ("db", db), ("dout", dout)):
            check("k_residual_add_bwd", n, x, dout.shape, dout.dtype)
        self.rt.launch("residual.cu", "k_residual_add_bwd", dout.dtype, blocks(dout.size), THREADS,
                       (da, db, dout, i64(dout.size)))

    # ------------------------------------------------------------ loss
    def _loss_rows(self, bwd: bool, n: int, z, ct, args, fp8_defs=None):
        """The row pass over the n rows of chunk z (n, V): version 2 where loss_row_plan has one,
        else version 1 (the same lse bits in k_loss_fwd and k_loss_bwd either way: both take the
        same path for the same V, dtype and alignment). fp8_defs: the FP8 classifier's row pass
        (loss_bwd_fp8 / loss_bwd_fp8_regs, args ending in q8 and its 1/scale; cuda/fp8.py),
        compiled with these defines (the format)."""
        lim = _sm_limits(z.device.id)
        plan = None if z.data.ptr % 16 else loss_row_plan(z.shape[1], np.dtype(ct).itemsize, self.loss_vectors,
                                                          bool(self.loss_prefetch), lim["smem_optin"])
        kernel = "loss_bwd_fp8" if fp8_defs is not None else "loss_bwd" if bwd else "loss_fwd"
        extra = tuple(fp8_defs or ())
        if plan is None:
            self.rt.launch("loss.cu", kernel, ct, n, LOSS_THREADS_V1, args, defs=extra)
            return
        nv, threads, smem = plan
        defs = (f"-DLOSS_NV={nv}", f"-DLOSS_THREADS={threads}", f"-DLOSS_PREFETCH={int(smem > 0)}") + extra
        f = self.rt.function("loss.cu", kernel + "_regs", ct, defs)
        grid = min(n, self.loss_blocks or lim["sms"] * resident_blocks(f.num_regs, threads, smem, lim))
        self.rt.launch("loss.cu", kernel + "_regs", ct, grid, threads, args, shared_mem=smem, defs=defs)

    def _fp8_classifier(self, inp, wte) -> int:
        """How many of the classifier's products run in FP8 (CudaOps.fp8_classifier: 0, 1 the
        backward's, 2 all): train.precision=fp8 (the FP8 launchers exist) and sizes its FP8
        products take (fp8.classifier_in_fp8), else 0."""
        if self.fp8 is None or not self.fp8_classifier:
            return 0
        from .fp8 import classifier_in_fp8
        return int(self.fp8_classifier) if classifier_in_fp8(inp.size // inp.shape[-1], wte.shape[0]) else 0

    def k_loss_fwd(self, losses, lse, logits, inp, wte, targets):
        """Writes losses, lse (B,T); logits (R, V) is workspace: chunks of R rows of inp @ wte.T
        (with the FP8 classifier's logits, fp8_classifier 2: fp8.k_fp8_loss_fwd)."""
        if self._fp8_classifier(inp, wte) == 2:
            return self.fp8.k_fp8_loss_fwd(losses, lse, logits, inp, wte, targets)
        x, tg, lf, lsef, z_all, N, V, C, ct = _loss_checks("k_loss_fwd", losses, lse, logits, inp, wte, targets)
        R = z_all.shape[0]
        for r0 in range(0, N, R):
            n = min(R, N - r0)
            z = z_all[:n]
            self.blas.gemm(z, x[r0:r0 + n], wte, False, True, n, V, C, C, C, V)
            self._loss_rows(False, n, z, ct, (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V)))

    def k_loss_bwd(self, losses, lse, dinp, dwte, logits, inp, wte, targets, dloss, accumulate=True):
        """The fused classifier (numpy_ref.k_loss_bwd): per chunk of R rows the logits product, loss,
        lse and dlogits in place, then dinp (B,T,C) += dlogits @ wte (accumulate=False: =, beta 0;
        each chunk writes its own rows) and dwte (V,C) += dlogits.T @ inp. dloss: a float, or a (1,)
        float32 device array read when the kernel runs. With the FP8 classifier, fp8.k_fp8_loss_bwd."""
        level = self._fp8_classifier(inp, wte)
        if level:
            return self.fp8.k_fp8_loss_bwd(losses, lse, dinp, dwte, logits, inp, wte, targets, dloss,
                                           accumulate=accumulate, fp8_logits=level == 2)
        x, tg, lf, lsef, z_all, N, V, C, ct = _loss_checks("k_loss_bwd", losses, lse, logits, inp, wte, targets)
        check("k_loss_bwd", "dinp", dinp, inp.shape, ct)
        check("k_loss_bwd", "dwte", dwte, (V, C), np.float32)
        dl = _dloss_args("k_loss_bwd", dloss)
        blas, dx, R = self.blas, dinp.reshape(N, C), z_all.shape[0]
        beta = 1.0 if accumulate else 0.0
        beta_w = 0.0 if self._param_write(dwte) else 1.0  # the first chunk starts dwte in a starting pass
        for r0 in range(0, N, R):
            n = min(R, N - r0)
            z = z_all[:n]
            blas.gemm(z, x[r0:r0 + n], wte, False, True, n, V, C, C, C, V)
            self._loss_rows(True, n, z, ct, (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V)) + dl)
            blas.gemm(dx[r0:r0 + n], z, wte, False, False, n, C, V, V, C, C, beta=beta)
            blas.gemm(dwte, z, x[r0:r0 + n], True, False, V, C, n, V, C, C, beta=beta_w if r0 == 0 else 1.0)

    # ------------------------------------------------------------ clipping and the optimizer
    def k_grad_norm_partial(self, partials, grads):
        """partials[i] = sum of squares of the i-th of len(partials) equal chunks of grads."""
        check("k_grad_norm_partial", "partials", partials, dtype=np.float32)
        check("k_grad_norm_partial", "grads", grads, dtype=np.float32)
        self.rt.launch("optim.cu", "k_grad_norm_partial", np.float32, partials.shape[0], THREADS,
                       (partials, grads, i64(grads.size)))

    def k_loss_accum(self, state, losses):
        """state[S_LOSS_SUM] += sum of losses in float64 (one block)."""
        check("k_loss_accum", "state", state, (STATE_LEN,), np.float64)
        check("k_loss_accum", "losses", losses, dtype=np.float32)
        self.rt.launch("optim.cu", "k_loss_accum", np.float32, 1, 1024, (state, losses, i64(losses.size)))

    def k_step_check(self, state, dloss, partials, n_micro, n_pos, beta1, beta2, weight_decay, max_norm,
                     fp16, growth_interval, max_scale):
        """The end-of-step bookkeeping of numpy_ref.k_step_check, by one device thread (its block
        loads the partials and computes the bias corrections' powers alongside)."""
        check("k_step_check", "state", state, (STATE_LEN,), np.float64)
        check("k_step_check", "dloss", dloss, (1,), np.float32)
        check("k_step_check", "partials", partials, dtype=np.float32)
        f64 = np.float64
        self.rt.launch("optim.cu", "k_step_check", np.float32, 1, STEP_CHECK_THREADS,
                       (state, dloss, partials, i32(partials.size), i32(n_micro), f64(n_pos), f64(beta1),
                        f64(beta2), f64(weight_decay), f64(max_norm), i32(int(bool(fp16))),
                        f64(growth_interval), f64(max_scale)))

    def k_adamw_step(self, params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay, zero_grads=True):
        """Clip + AdamW + cast (+ zeroing of grads) in one pass, as numpy_ref.k_adamw_step."""
        for n, a in (("params", params), ("grads", grads), ("m", m), ("v", v)):
            check("k_adamw_step", n, a, params.shape, np.float32)
        check("k_adamw_step", "state", state, (STATE_LEN,), np.float64)
        cast = params_c is not None and params_c is not params
        if cast:
            check("k_adamw_step", "params_c", params_c, params.shape)
        pc = params_c if cast else params
        args = adamw_args(params, pc, grads, m, v, state, beta1, beta2, eps, n_decay)
        if cast and self.fp8 is not None and self.fp8_adamw_amax and self.fp8.adamw_amax_fits(pc, (params, grads, m, v)):
            self.fp8.k_adamw_step_amax(args, zero_grads)  # and the FP8 weight cache's amax
            return
        self.rt.launch("optim.cu", "k_adamw_step", pc.dtype, blocks(params.size), THREADS,
                       args + (i32(int(cast)), i32(int(bool(zero_grads)))))

    def k_cast_params(self, dst, src):
        """dst (compute dtype) = src (float32 master weights), a flat copy."""
        check("k_cast_params", "src", src, dtype=np.float32)
        check("k_cast_params", "dst", dst, src.shape)
        self.rt.launch("optim.cu", "k_cast_params", dst.dtype, blocks(src.size), THREADS, (dst, src, i64(src.size)))
