"""Inputs for every kernel of the backend interface, by kernel file: what the harness checks.

A case is a kernel name and a function (rng, dt, size) -> list of arguments, each one of:
  In(x, kind)       an input; x is float64 already rounded to its device dtype (or int32)
  Out(shape, kind)  a forward output: NaN-filled on the device, compared with the reference
  Acc(x, kind)      a gradient buffer the kernel adds into: prefilled at random, the ADDED part
                    is compared with what the reference adds to zeros
  InOut(x, kind)    an input the kernel overwrites (loss_bwd's logits): compared afterwards
  Scratch(shape, kind)  workspace the kernel may use freely: not compared
  a plain number    passed as is (n_head, dloss, lr, ...)
kind is "ct" (the compute dtype), "f32", "f64" (the optimizer state), "i32" or "u64" (the sampler's seeds). Saved forward values that a backward kernel
reads (mean/rstd, out/lse, pre, logits/lse) come from the float64 reference forward.
A case's kwargs go to both the reference and the backend: the backward kernels are checked once
more with accumulate=False (`written`), their activation gradient then an Out (NaN-filled).
`tol` on Out/Acc/InOut overrides the dtype's tolerance where the tests use another one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from andrea.backends import ref


@dataclass
class In:
    x: np.ndarray
    kind: str = "ct"


@dataclass
class Out:
    shape: tuple
    kind: str = "ct"
    tol: Optional[float] = None


@dataclass
class Acc:
    want_shape: tuple
    kind: str = "f32"
    tol: Optional[float] = None


@dataclass
class InOut:
    x: np.ndarray
    kind: str = "ct"
    tol: Optional[float] = None


@dataclass
class Scratch:
    shape: tuple
    kind: str = "ct"


@dataclass
class Case:
    kernel: str
    make: Callable  # (rng, dt, size) -> list of arguments
    size: Optional[dict] = None  # the check size, if not CHECK_SIZE
    kwargs: dict = field(default_factory=dict)  # keyword arguments of both calls (accumulate=False)

    @property
    def label(self) -> str:
        """The kernel name, with the keyword arguments where there are any."""
        return " ".join([self.kernel] + [f"{k}={v}" for k, v in self.kwargs.items()])


def written(kernel: str, make, size=None) -> Case:
    """The case of a backward kernel in its write mode: accumulate=False, and the activation
    gradient (its compute-dtype Acc) an Out, NaN-filled, compared with what the reference writes."""
    def make_written(rng, dt, s):
        args = make(rng, dt, s)
        i = next(i for i, a in enumerate(args) if isinstance(a, Acc) and a.kind == "ct")
        args[i] = Out(args[i].want_shape, "ct", args[i].tol)
        return args
    return Case(kernel, make_written, size, {"accumulate": False})


# sizes that divide nothing: T=77 ends mid-tile, C=200 and V=1001 are no multiples of 32 or 64,
# n_head=5 gives head size 40; attention's second size takes the fused path in 16-bit (hs 64)
CHECK_SIZE = {"B": 2, "T": 77, "C": 200, "NH": 5, "V": 1001}
FUSED_SIZE = {"B": 3, "T": 130, "C": 128, "NH": 2, "V": 1001}
VEC_SIZE = {"B": 2, "T": 77, "C": 200, "NH": 5, "V": 1000}  # V in whole 16-byte vectors: loss.cu's vector path
TIME_SIZE = {"B": 8, "T": 1024, "C": 768, "NH": 12, "V": 50304}  # ANDREA-120M's step shapes


def rnd(rng, shape, dt, scale=1.0, shift=0.0):
    """float64 values already rounded to dt, so the reference sees the device's inputs. For
    timing (a TimingRng) float32 values: nothing is compared, and 120M shapes are large."""
    if isinstance(rng, TimingRng):
        return rng.standard_normal(shape) * np.float32(scale) + np.float32(shift)
    return (rng.standard_normal(shape) * scale + shift).astype(dt).astype(np.float64)


class TimingRng:
    """The generator the cases get when only timing: float32 normals. Backward cases then make
    their saved forward values up instead of running the float64 reference at 120M shapes."""

    def __init__(self, rng):
        self.rng = rng

    def standard_normal(self, shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    def integers(self, lo, hi, shape):
        return self.rng.integers(lo, hi, shape)


def saved(rng, kernel, args, outs):
    """Run the reference forward `kernel` on args (float64) and return outs (its outputs),
    or, when timing, outs as they are filled with made-up values of the right scale."""
    if isinstance(rng, TimingRng):
        for o in outs:
            o[...] = rng.standard_normal(o.shape)
        return outs
    getattr(ref, kernel)(*args)
    return outs


def tokens(rng, s):
    t = rng.integers(0, s["V"], (s["B"], s["T"])).astype(np.int32)
    t[0, :20] = 7  # a run of one token, and one shared across the batch
    t[-1, 5] = 7
    return t


# ------------------------------------------------------------ embed.cu
def embed_fwd(rng, dt, s):
    B, T, C, V = s["B"], s["T"], s["C"], s["V"]
    return [Out((B, T, C)), In(tokens(rng, s), "i32"), In(rnd(rng, (V, C), dt)), In(rnd(rng, (T + 5, C), dt))]


def embed_bwd(rng, dt, s):
    B, T, C, V = s["B"], s["T"], s["C"], s["V"]
    return [Acc((V, C)), Acc((T, C)), In(rnd(rng, (B, T, C), dt)), In(tokens(rng, s), "i32")]


# ------------------------------------------------------------ layernorm.cu
def layernorm_fwd(rng, dt, s):
    B, T, C = s["B"], s["T"], s["C"]
    return [Out((B, T, C)), Out((B, T), "f32", 1e-5), Out((B, T), "f32", 1e-5 if dt == np.float32 else 1e-3),
            In(rnd(rng, (B, T, C), dt, 2.0, 0.5)), In(rnd(rng, (C,), dt, 0.5, 1.0)), In(rnd(rng, (C,), dt, 0.1))]


def residual_layernorm_fwd(rng, dt, s):
    B, T, C = s["B"], s["T"], s["C"]
    # the kernel rounds the residual sum to the compute dtype before its mean; the reference sums
    # exactly, so in 16 bits the mean differs by that rounding: the dtype's tolerance, as in the tests
    return [Out((B, T, C)), Out((B, T, C)), Out((B, T), "f32", 1e-5 if dt == np.float32 else None),
            Out((B, T), "f32", 1e-5 if dt == np.float32 else 1e-3), In(rnd(rng, (B, T, C), dt, 2.0, 0.5)),
            In(rnd(rng, (B, T, C), dt)), In(rnd(rng, (C,), dt, 0.5, 1.0)), In(rnd(rng, (C,), dt, 0.1))]


def layernorm_bwd(rng, dt, s):
    B, T, C = s["B"], s["T"], s["C"]
    inp, w, b = rnd(rng, (B, T, C), dt, 2.0, 0.5), rnd(rng, (C,), dt, 0.5, 1.0), rnd(rng, (C,), dt, 0.1)
    out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))
    saved(rng, "k_layernorm_fwd", (out, mean, rstd, inp, w, b), (mean, rstd))
    return [Acc((B, T, C), "ct"), Acc((C,)), Acc((C,)), In(rnd(rng, (B, T, C), dt)), In(inp), In(w),
            In(mean.astype(np.float32).astype(np.float64), "f32"), In(rstd.astype(np.float32).astype(np.float64), "f32")]


# ------------------------------------------------------------ linear.cu (the attention projections)
def linear_fwd(oc_mult):
    def make(rng, dt, s):
        B, T, C = s["B"], s["T"], s["C"]
        oc = oc_mult * C
        return [Out((B, T, oc)), In(rnd(rng, (B, T, C), dt)), In(rnd(rng, (oc, C), dt, 0.05)), In(rnd(rng, (oc,), dt, 0.1))]
    return make


def linear_bwd(oc_mult):
    def make(rng, dt, s):
        B, T, C = s["B"], s["T"], s["C"]
        oc = oc_mult * C
        return [Acc((B, T, C), "ct"), Acc((oc, C)), Acc((oc,)), In(rnd(rng, (B, T, oc), dt)),
                In(rnd(rng, (B, T, C), dt)), In(rnd(rng, (oc, C), dt, 0.05))]
    return make


# ------------------------------------------------------------ attention.cu
def attn_fwd(rng, dt, s):
    B, T, C, NH = s["B"], s["T"], s["C"], s["NH"]
    return [Out((B, T, C)), Out((B, NH, T), "f32", 1e-5 if dt == np.float32 else 1e-3),
            In(rnd(rng, (B, T, 3 * C), dt)), NH]


def attn_bwd(rng, dt, s):
    B, T, C, NH = s["B"], s["T"], s["C"], s["NH"]
    qkv = rnd(rng, (B, T, 3 * C), dt)
    out, lse = np.zeros((B, T, C)), np.zeros((B, NH, T))
    saved(rng, "k_attn_fwd", (out, lse, qkv, NH), (out, lse))
    return [Acc((B, T, 3 * C), "ct"), In(rnd(rng, (B, T, C), dt)), In(qkv), In(out.astype(dt).astype(np.float64)),
            In(lse.astype(np.float32).astype(np.float64), "f32"), NH]


def attn_decode_fwd(rng, dt, s):
    """One new position (pos = T - 1) against a cache of T + 5 rows: rows past pos hold
    garbage the kernel must neither read nor change."""
    B, T, C, NH = s["B"], s["T"], s["C"], s["NH"]
    ctx = T + 5
    return [Out((B, 1, C)), InOut(rnd(rng, (B, ctx, C), dt)), InOut(rnd(rng, (B, ctx, C), dt)),
            In(rnd(rng, (B, 1, 3 * C), dt)), T - 1, NH]


# ------------------------------------------------------------ decode.cu (inference)
def _slots(s):
    """An odd slot count at the check size (5), at most DECODE_GEMV_ROWS (the few-row products'
    limit) at the timing size."""
    from andrea.backends.interface import DECODE_GEMV_ROWS
    return min(s["B"] + 3, DECODE_GEMV_ROWS)


def decode_embed_fwd(rng, dt, s):
    N, T, C, V = _slots(s), s["T"], s["C"], s["V"]
    return [Out((N, 1, C)), In(rng.integers(0, V, (N,)).astype(np.int32), "i32"),
            In(rng.integers(0, T, (N,)).astype(np.int32), "i32"), In(rnd(rng, (V, C), dt)), In(rnd(rng, (T, C), dt))]


def attn_decode_batch_fwd(rng, dt, s):
    """Each slot at its own position; cache rows past it hold garbage the kernel must not read."""
    N, T, C, NH = _slots(s), s["T"], s["C"], s["NH"]
    return [Out((N, 1, C)), InOut(rnd(rng, (N, T, C), dt)), InOut(rnd(rng, (N, T, C), dt)),
            In(rnd(rng, (N, 1, 3 * C), dt)), In(rng.integers(0, T, (N,)).astype(np.int32), "i32"), NH]


def attn_shared_fwd(rng, dt, s):
    """Options of one to three rows after contexts of T - 3, T // 2 + 1 and 1 rows, the contexts one
    after another in saved (the scorer's shared-context option pass)."""
    T, C, NH = s["T"], s["C"], s["NH"]
    groups = [(T - 3, (3, 1)), (T // 2 + 1, (2,)), (1, (1, 2))]
    pre, plen, first, at = [], [], [], 0
    for p, opts in groups:
        for rows in opts:
            f = len(pre)
            pre += [at] * rows
            plen += [p] * rows
            first += [f] * rows
        at += p
    R = len(pre)
    ints = [In(np.array(a, np.int32), "i32") for a in (pre, plen, first)]
    return [Out((R, 1, C)), In(rnd(rng, (R, 1, 3 * C), dt)), In(rnd(rng, (at, 3 * C), dt)), *ints, NH, T + 3]


def decode_cache_fill(rng, dt, s):
    N, T, C, L = _slots(s), s["T"], s["C"], 2
    return [InOut(rnd(rng, (L, N, T + 3, C), dt)), InOut(rnd(rng, (L, N, T + 3, C), dt)),
            In(rnd(rng, (L, 1, T, 3 * C), dt)), 2, T - 5]


def decode_linear_fwd(mult, gelu):
    def make(rng, dt, s):
        N, C = _slots(s), s["C"]
        return [Out((N, 1, mult * C)), In(rnd(rng, (N, 1, C), dt)), In(rnd(rng, (mult * C, C), dt, 0.07)),
                In(rnd(rng, (mult * C,), dt, 0.1)), gelu]
    return make


def decode_ln_linear_fwd(residual, mult, gelu):
    def make(rng, dt, s):
        N, C = _slots(s), s["C"]
        res = Out((N, 1, C)) if residual else Scratch((N, 1, C))
        b = In(rnd(rng, (N, 1, C), dt)) if residual else None
        return [Out((N, 1, mult * C)), res, In(rnd(rng, (N, 1, C), dt)), b, In(rnd(rng, (C,), dt, 0.1, 1.0)),
                In(rnd(rng, (C,), dt, 0.1)), In(rnd(rng, (mult * C, C), dt, 0.07)), In(rnd(rng, (mult * C,), dt, 0.1)),
                gelu]
    return make


def decode_logits_fwd(extra):
    def make(rng, dt, s):
        N, C, V = _slots(s) + extra, s["C"], s["V"]
        return [Out((N, V), "f32"), In(rnd(rng, (N, 1, C), dt)), In(rnd(rng, (V, C), dt, 0.1))]
    return make


def sample_fwd(rng, dt, s):
    """Greedy, plain temperature, top_k, top_p, a free slot, and a slot at the end of its window:
    the tokens and lengths must be the reference's exactly (a tolerance of 1e-9: any other token fails)."""
    N, T, V = 6, s["T"], s["V"]
    lengths = np.array([3, 10, 0, T - 1, 7, 20], dtype=np.int32)
    return [InOut(np.zeros(N, dtype=np.int32), "i32", 1e-9), InOut(lengths, "i32", 1e-9),
            In(rnd(rng, (N, V), np.float32, 2.0), "f32"), In(np.array([0, 0.8, 1.0, 1.3, 0.5, 2.0]), "f32"),
            In(np.array([0, 0, 50, 0, 10, 0], dtype=np.int32), "i32"), In(np.array([1, 1, 1, 0.5, 1, 0.9]), "f32"),
            In(np.array([0, 1, 2, 3, 12345, 2 ** 40 + 7], dtype=np.uint64), "u64"),
            In(np.array([1, 1, 1, 1, 0, 1], dtype=np.int32), "i32"), T]


# ------------------------------------------------------------ mlp.cu
def mlp_fwd(rng, dt, s):
    B, T, C = s["B"], s["T"], s["C"]
    H = 4 * C
    return [Out((B, T, C)), Out((B, T, H)), Scratch((B, T, H)), In(rnd(rng, (B, T, C), dt)),
            In(rnd(rng, (H, C), dt, 0.07)), In(rnd(rng, (H,), dt, 0.1)), In(rnd(rng, (C, H), dt, 0.035)),
            In(rnd(rng, (C,), dt, 0.1))]


def mlp_bwd(rng, dt, s):
    B, T, C = s["B"], s["T"], s["C"]
    H = 4 * C
    return [Acc((B, T, C), "ct"), Acc((H, C)), Acc((H,)), Acc((C, H)), Acc((C,)), In(rnd(rng, (B, T, C), dt)),
            In(rnd(rng, (B, T, C), dt)), In(rnd(rng, (B, T, H), dt)), In(rnd(rng, (H, C), dt, 0.07)),
            In(rnd(rng, (C, H), dt, 0.035)), Scratch((B, T, H)), Scratch((B, T, H))]


# ------------------------------------------------------------ residual.cu
def residual_fwd(rng, dt, s):
    shape = (s["B"], s["T"], s["C"])
    return [Out(shape), In(rnd(rng, shape, dt)), In(rnd(rng, shape, dt))]


def residual_bwd(rng, dt, s):
    shape = (s["B"], s["T"], s["C"])
    return [Acc(shape, "ct"), Acc(shape, "ct"), In(rnd(rng, shape, dt))]


# ------------------------------------------------------------ loss.cu (the classifier, in chunks of R rows)
def chunk_rows(s):
    """R rows of logits workspace: fewer than B*T at the check size, so the chunking is exercised."""
    N = s["B"] * s["T"]
    return 50 if N < 1000 else min(N, 2048)


def loss_fwd(rng, dt, s):
    B, T, C, V = s["B"], s["T"], s["C"], s["V"]
    return [Out((B, T), "f32"), Out((B, T), "f32"), Scratch((chunk_rows(s), V)), In(rnd(rng, (B, T, C), dt)),
            In(rnd(rng, (V, C), dt, 0.1)), In(rng.integers(0, V, (B, T)).astype(np.int32), "i32")]


def loss_bwd(rng, dt, s):
    B, T, C, V = s["B"], s["T"], s["C"], s["V"]
    return [Out((B, T), "f32"), Out((B, T), "f32"), Acc((B, T, C), "ct"), Acc((V, C)),
            Scratch((chunk_rows(s), V)), In(rnd(rng, (B, T, C), dt)), In(rnd(rng, (V, C), dt, 0.1)),
            In(rng.integers(0, V, (B, T)).astype(np.int32), "i32"), 1.0 / 7]


# ------------------------------------------------------------ optim.cu (float32 whatever dt is)
N_OPT = 100_003  # not a multiple of the partial count: the last chunk is short


def state(**slots):
    """An optimizer state vector (interface.STATE_SLOTS) with these slots set."""
    x = np.zeros(ref.STATE_LEN)
    for name, value in slots.items():
        x[getattr(ref, name)] = value
    return x


def grad_norm_partial(rng, dt, s):
    return [Out((64,), "f32", 1e-5), In(rnd(rng, (N_OPT,), np.float32, 0.3), "f32")]


def grad_norm_final(rng, dt, s):
    """The global norm from the 1024 partials the CUDA backend's k_grad_norm_partial fills."""
    return [InOut(state(S_SCALE=1.0), "f64", 1e-6), In(np.abs(rnd(rng, (1024,), np.float32, 1e5)), "f32")]


def grad_scale(rng, dt, s):
    """A clip (norm 4 above max_norm 1) of a flat float32 gradient."""
    return [InOut(rnd(rng, (N_OPT,), np.float32, 0.3), "f32", 1e-6), In(state(S_NORM=4.0), "f64"), 1.0]


def loss_accum(rng, dt, s):
    return [InOut(state(S_LOSS_SUM=3.5, S_SCALE=1.0), "f64", 1e-6),
            In(np.abs(rnd(rng, (s["B"], s["T"]), np.float32)), "f32")]


def step_check(rng, dt, s):
    """A finite step of fp16 training that clips (loss scale 1024, step 7 after 2 skipped), with
    the 1024 partials the CUDA backend's k_grad_norm_partial fills (what the timing should see)."""
    st = state(S_SCALE=1024.0, S_LOSS_SUM=2.0 * 154 * 5.1, S_LR=3e-3, S_STEP=7, S_SKIPPED=2, S_GOOD=5)
    return [InOut(st, "f64", 1e-6), Out((1,), "f32", 1e-6), In(np.abs(rnd(rng, (1024,), np.float32, 1e5)), "f32"),
            2, 154, 0.9, 0.95, 0.1, 1.0, True, 2000, 2.0 ** 24]


def adamw_step(rng, dt, s):
    n = 50_001
    st = state(S_SKIP=0.0, S_CLIP=0.5, S_DECAY=1 - 3e-4, S_STEP_SIZE=3e-3, S_VHAT=1.5)
    return [InOut(rnd(rng, (n,), np.float32), "f32", 1e-6), Out((n,), "ct"), InOut(rnd(rng, (n,), np.float32, 0.01), "f32"),
            InOut(rnd(rng, (n,), np.float32, 0.001), "f32", 1e-6),
            InOut(np.abs(rnd(rng, (n,), np.float32, 1e-5)), "f32", 1e-6), In(st, "f64"), 0.9, 0.95, 1e-8, 30_000]


def cast_params(rng, dt, s):
    return [Out((10_007,), "ct"), In(rnd(rng, (10_007,), np.float32), "f32")]


CASES: Dict[str, List[Case]] = {
    "embed": [Case("k_embed_fwd", embed_fwd), Case("k_embed_bwd", embed_bwd)],
    "layernorm": [Case("k_layernorm_fwd", layernorm_fwd), Case("k_residual_layernorm_fwd", residual_layernorm_fwd),
                  Case("k_layernorm_bwd", layernorm_bwd), written("k_layernorm_bwd", layernorm_bwd)],
    "linear": [Case("k_attn_qkv_fwd", linear_fwd(3)), Case("k_attn_qkv_bwd", linear_bwd(3)),
               written("k_attn_qkv_bwd", linear_bwd(3)),
               Case("k_attn_out_fwd", linear_fwd(1)), Case("k_attn_out_bwd", linear_bwd(1)),
               written("k_attn_out_bwd", linear_bwd(1))],
    "attention": [Case("k_attn_fwd", attn_fwd), Case("k_attn_bwd", attn_bwd), written("k_attn_bwd", attn_bwd),
                  Case("k_attn_fwd", attn_fwd, FUSED_SIZE), Case("k_attn_bwd", attn_bwd, FUSED_SIZE),
                  written("k_attn_bwd", attn_bwd, FUSED_SIZE), Case("k_attn_decode_fwd", attn_decode_fwd)],
    "decode": [Case("k_decode_embed_fwd", decode_embed_fwd), Case("k_attn_decode_batch_fwd", attn_decode_batch_fwd),
               Case("k_attn_decode_batch_fwd", attn_decode_batch_fwd, FUSED_SIZE),  # hs 64: the 16-byte path
               Case("k_attn_shared_fwd", attn_shared_fwd), Case("k_attn_shared_fwd", attn_shared_fwd, FUSED_SIZE),
               Case("k_decode_cache_fill", decode_cache_fill),
               Case("k_decode_linear_fwd", decode_linear_fwd(3, False)),
               Case("k_decode_linear_fwd", decode_linear_fwd(4, True)),
               Case("k_decode_ln_linear_fwd", decode_ln_linear_fwd(True, 3, False)),
               Case("k_decode_ln_linear_fwd", decode_ln_linear_fwd(False, 4, True)),
               Case("k_decode_logits_fwd", decode_logits_fwd(0)), Case("k_decode_logits_fwd", decode_logits_fwd(8)),
               Case("k_sample_fwd", sample_fwd)],
    "mlp": [Case("k_mlp_fwd", mlp_fwd), Case("k_mlp_bwd", mlp_bwd), written("k_mlp_bwd", mlp_bwd)],
    "residual": [Case("k_residual_add", residual_fwd), Case("k_residual_add_bwd", residual_bwd)],
    "loss": [Case("k_loss_fwd", loss_fwd), Case("k_loss_bwd", loss_bwd), written("k_loss_bwd", loss_bwd),
             Case("k_loss_fwd", loss_fwd, VEC_SIZE), Case("k_loss_bwd", loss_bwd, VEC_SIZE),
             written("k_loss_bwd", loss_bwd, VEC_SIZE)],
    "optim": [Case("k_grad_norm_partial", grad_norm_partial), Case("k_grad_norm_final", grad_norm_final),
              Case("k_grad_scale", grad_scale), Case("k_loss_accum", loss_accum),
              Case("k_step_check", step_check), Case("k_adamw_step", adamw_step),
              Case("k_cast_params", cast_params)],
}
