"""The memory plan: every buffer the engine will ever use, from the config alone, and the arena
they are carved from (one allocation at start-up; the step loop allocates nothing).

    plan = make_plan(cfg)             # MemoryPlan: rows of (name, shape, dtype, group)
    print(plan.table())               # bytes by group, and the aligned total
    arena = Arena(be, plan.total())   # then arena.take(shape, dtype) per row, arena.seal()

The Engine (engine.py) makes its plan here and allocates it; inference (andrea/use/inference.py)
uses the arena too, and the workflow sizes a run's memory from make_plan before it starts. With
train.precision=fp8 the plan holds the FP8 rows the CUDA backend asks for (the weight cache, the
input slots, the delayed scales), listed by the fp8_* helpers below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np

from . import model
from ..backends import backend_class
from ..backends.interface import STATE_LEN
from .comm import shard_bounds
from ..config import AndreaConfig

ALIGN = 256  # bytes; cuBLAS and vector loads want aligned starts


@dataclass
class PlanRow:
    name: str
    shape: tuple
    dtype: str
    group: str  # weights, grads, adam_m, adam_v, activations, workspace, ...

    @property
    def nbytes(self) -> int:
        n = dtype_name_size(self.dtype)[1]
        for s in self.shape:
            n *= s
        return n


# Formats numpy knows by name only once ml_dtypes is imported (the CUDA backend imports it); the plan
# is also made where it is not, e.g. by the workflow sizing a bf16 or fp8 run's memory before it starts.
EXTRA_DTYPES = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_name_size(dtype) -> tuple:
    """(name, bytes per element) of a numpy dtype or a dtype name, including EXTRA_DTYPES's names."""
    if isinstance(dtype, str) and dtype in EXTRA_DTYPES:
        return dtype, EXTRA_DTYPES[dtype]
    d = np.dtype(dtype)
    return d.name, d.itemsize


@dataclass
class MemoryPlan:
    rows: List[PlanRow] = field(default_factory=list)

    def add(self, name, shape, dtype, group):
        self.rows.append(PlanRow(name, tuple(shape), dtype_name_size(dtype)[0], group))

    def total(self) -> int:
        return sum(-(-r.nbytes // ALIGN) * ALIGN for r in self.rows)

    def by_group(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for r in self.rows:
            out[r.group] = out.get(r.group, 0) + r.nbytes
        return out

    def table(self) -> str:
        lines = [f"{'buffer group':<22}{'bytes':>16}{'MiB':>12}"]
        for g, b in self.by_group().items():
            lines.append(f"{g:<22}{b:>16,}{b / 2**20:>12.1f}")
        t = self.total()
        lines.append(f"{'total (aligned)':<22}{t:>16,}{t / 2**20:>12.1f}")
        return "\n".join(lines)


def fp8_backend():
    """The class of the backend that runs train.precision=fp8 (interface.Fp8Backend: CUDA): its
    plan rows and size checks are pure arithmetic, asked of the class (no GPU, no instance)."""
    return backend_class("cuda")


def compute_dtype(precision: str, base: str) -> str:
    """The dtype of activations and of the weights' compute copy. fp8 computes in bf16 outside the
    linear layers' FP8 products (docs/FP8.md)."""
    return {"fp32": base, "fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}[precision]


def fp8_cached_weights(m, classifier: bool = False) -> List[str]:
    """The parameters the FP8 weight cache keeps copies of: every linear layer's weight, in the
    order of the flat buffer (model.LAYER_MATRICES of each layer), and with the classifier in FP8
    the tied embedding wte (V, C) first."""
    return (["wte"] if classifier else []) + [f"h{l}.{n}" for l in range(m.n_layer) for n in model.LAYER_MATRICES]


# train.precision=fp8: the products whose input X the model saves for the backward pass (the
# same tensor in both passes), and the MLP's second one, whose input act = gelu(pre) both passes
# make from the saved pre, by weight: these have input slots (the backend's use_fp8_input_slots).
# act is the workspace of that name, shared by every layer (the slot only names it).
FP8_SLOT_INPUTS = {"qkv_w": "ln1", "attn_out_w": "atty", "mlp_w1": "ln2", "mlp_w2": "act"}


# train.precision=fp8 with delayed scaling (the backend's use_fp8_delayed_scales): the tensors whose
# scale comes from an amax history, as (role, weight) of the product that reads them: the MLP's act
# (the second product's input) and dact (the first's output gradient), the attention output (the
# projection's input), the output gradients of QKV, the projection and the MLP's second product
# (dqkv and the residual stream's two), and ln1 and ln2 (the inputs of QKV and of the MLP's first
# product, which their layer norms write as FP8 operands: k_layernorm_fwd_fp8). Their amax is taken
# by the pass that casts them.
FP8_DELAYED = (("act", "mlp_w2"), ("dy", "mlp_w1"), ("x", "attn_out_w"), ("dy", "qkv_w"), ("dy", "attn_out_w"),
               ("dy", "mlp_w2"), ("x", "qkv_w"), ("x", "mlp_w1"))


def fp8_delayed_tensors(m) -> List[tuple]:
    """(role, weight name) of every delayed scale, layer by layer: a row of the arena each (an
    input's delayed scale, role x, takes its 1/scale in the input's slot)."""
    return [(role, f"h{l}.{w}") for l in range(m.n_layer) for role, w in FP8_DELAYED]


def fp8_input_slots(m) -> List[tuple]:
    """(weight name, layer, saved activation name) of every product with an FP8 input slot, in
    the order of the forward pass (layer 0's ln1 first: its quantisation starts a pass)."""
    return [(f"h{l}.{w}", l, x) for l in range(m.n_layer) for w, x in FP8_SLOT_INPUTS.items()]


def make_plan(cfg: AndreaConfig, dtype: str = "float32", n_partials: int = 64, shards: int = 0,
              fp8_classifier: bool = False, fp8_delayed: bool = False) -> MemoryPlan:
    """Every buffer the engine will ever use, from the config alone. shards = N > 0: ZeRO-1 over N
    ranks (Engine): the flat buffers padded to a multiple of N, the Adam moments one rank's shard
    of padded/N, and the norm's partials one block per rank. With train.precision=fp8, the rows
    the FP8 backend asks for (interface.Fp8Backend.fp8_arena_rows, on the CUDA backend's class, so
    no GPU is needed): the FP8 copies of the linear weights and their scales, the input slots
    with their kept FP8 X^T, and with fp8_delayed the delayed scales (fp8_delayed_tensors).
    fp8_classifier: the classifier runs in FP8 (engine.fp8_classifier_runs), so the cache holds
    wte too."""
    m, t = cfg.model, cfg.train
    B, T = t.batch_size, t.seq_len
    act = compute_dtype(t.precision, dtype)
    f32 = "float32" if dtype == "float32" else dtype  # float64 in gradient checks
    n = model.ParamLayout.from_config(m).n_params
    flat, moments = n, n
    if shards:
        flat, _, per = shard_bounds(n, shards, 0)
        moments, n_partials = per, n_partials * shards
    plan = MemoryPlan()
    plan.add("params", (flat,), dtype, "weights")
    if act != dtype:
        plan.add("params_c", (flat,), act, "weights (compute copy)")
    plan.add("grads", (flat,), dtype, "grads")
    plan.add("adam_m", (moments,), dtype, "adam_m")
    plan.add("adam_v", (moments,), dtype, "adam_v")
    kinds = {"act": act, "f32": f32, "i32": "int32"}
    for l in range(m.n_layer):
        for name, (shape, kind) in model.activation_shapes(m, B, T).items():
            plan.add(f"h{l}.{name}", shape, kinds[kind], "activations (layers)")
    for name, (shape, kind) in model.global_shapes(m, B, T).items():
        group = "workspace" if name in model.WORKSPACE else "activations (other)"
        plan.add(name, shape, kinds[kind], group)
    plan.add("norm_partials", (n_partials,), f32, "workspace")
    plan.add("optim_state", (STATE_LEN,), "float64", "workspace")
    plan.add("dloss", (1,), f32, "workspace")
    if t.precision == "fp8":
        shapes = dict(model.param_shapes(m)[0])
        rows = fp8_backend().fp8_arena_rows([shapes[w] for w in fp8_cached_weights(m, fp8_classifier)],
                                            [shapes[w] for w, _, _ in fp8_input_slots(m)], B * T,
                                            len(fp8_delayed_tensors(m)) if fp8_delayed else 0)
        for name, shape, dt, group in rows:
            plan.add(name, shape, dt, group)
    return plan


class Arena:
    """One allocation carved into aligned views. After seal(), asking for more is an error:
    the step loop cannot allocate a buffer."""

    def __init__(self, xp, nbytes: int):
        self.xp = xp
        self.buf = xp.zeros(nbytes, dtype=np.uint8)
        self.offset = 0
        self.sealed = False
        self.n_views = 0

    def take(self, shape, dtype):
        if self.sealed:
            raise RuntimeError("Arena.take after seal(): the step loop must not allocate buffers")
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        if self.offset + n > self.buf.size:
            raise RuntimeError(f"arena overflow: {self.offset + n} > {self.buf.size} bytes; plan is wrong")
        view = self.buf[self.offset:self.offset + n].view(dt).reshape(shape)
        self.offset += -(-n // ALIGN) * ALIGN
        self.n_views += 1
        return view

    def seal(self):
        self.sealed = True
