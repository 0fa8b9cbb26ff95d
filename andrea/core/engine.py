"""The engine: memory plan, one arena allocated at start-up, the train step, AdamW and clipping.

    eng = Engine(cfg)                 # plans, allocates every buffer once, initialises weights
    eng.print_plan()                  # the memory plan as a table (stderr)
    rec = eng.train_step(step, batches)   # batches: grad_accum (x, y) int32 arrays of (B, T)
    st = eng.state()                  # what a checkpoint keeps (EngineState); eng.load_state(st)
    c = eng.load_checkpoint(path, config_hash(cfg))   # training's resume and evaluation

The step: the first microbatch's forward + backward WRITES the fp32 gradient buffer (its pass
starts it: model.backward(start=grads)), the others ADD into it (and k_loss_accum adds each loss
to the optimizer state); then, on the device with no host round trip,
k_grad_norm_partial and k_step_check find the global norm of the averaged, unscaled gradient and
apply the non-finite policy (a non-finite norm or loss skips the update, counted; fp16 also halves
the loss scale) and the loss-scale growth, and k_adamw_step unscales, clips, updates and casts the
compute copy in one pass (it leaves the grads, with or without ZeRO-1: the next step's first pass
writes them). On CUDA each microbatch and the optimizer part run
as CUDA graphs. The optimizer state (loss scale, streaks, skipped count, the last step's record)
lives on the device (numpy_ref.STATE_SLOTS); train_step returns a StepRecord that reads the step's
copy of it when first used, so the host need not wait for the step to finish.

Data parallelism (comm, docs/DISTRIBUTED.md): the gradients are summed over the ranks before the
norm; with zero1 (ZeRO-1) each rank keeps the Adam moments of its own shard of the flat buffers,
updates that shard and all-gathers the weights (Engine._optimizer).
"""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from . import model
from ..backends import get_backend
from ..backends.numpy_ref import (S_BAD, S_GOOD, S_LOSS, S_LOSS_SUM, S_LR, S_NORM, S_REC_SCALE, S_SCALE,
                                 S_SKIP, S_SKIPPED, S_STEP, STATE_LEN)
from .comm import SINGLE, shard_bounds
from ..config import FP8_RUN_SETTINGS, AndreaConfig

ALIGN = 256  # bytes; cuBLAS and vector loads want aligned starts
SCALE_GROWTH_INTERVAL = 2000  # good fp16 steps before the loss scale doubles (as torch's GradScaler)
MAX_LOSS_SCALE = 2.0 ** 24


def phase_of(cfg: AndreaConfig, step: int):
    """The phase (PhaseConfig or None) that 1-based step belongs to: the last one whose
    start_step is below it. A phase starting at S runs steps S+1, S+2, ...; the pivot checkpoint
    is the state after step S."""
    current = None
    for ph in cfg.train.phases:
        if step > ph.start_step:
            current = ph
    return current


def lr_at(cfg: AndreaConfig, step: int) -> float:
    """Learning rate of 1-based step: linear warm-up, then cosine to min_lr; a phase may set its
    own peak (scaled by the same curve)."""
    t = cfg.train
    ph = phase_of(cfg, step)
    peak = ph.lr if ph is not None and ph.lr is not None else t.lr
    if t.warmup_steps and step <= t.warmup_steps:
        return peak * step / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    floor = t.min_lr * peak / t.lr if t.lr else t.min_lr
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * frac))


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


def compute_dtype(precision: str, base: str) -> str:
    """The dtype of activations and of the weights' compute copy. fp8 computes in bf16 outside the
    linear layers' FP8 products (docs/FP8.md)."""
    return {"fp32": base, "fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}[precision]


def fp8_cached_weights(m, classifier: bool = False) -> List[str]:
    """The parameters the FP8 weight cache keeps copies of: every linear layer's weight, in the
    order of the flat buffer (model.LAYER_MATRICES of each layer), and with the classifier in FP8
    the tied embedding wte (V, C) first."""
    return (["wte"] if classifier else []) + [f"h{l}.{n}" for l in range(m.n_layer) for n in model.LAYER_MATRICES]


def apply_fp8_settings(be, t) -> None:
    """The run's train.fp8_classifier, fp8_dlogits and fp8_dlogits_rounding (config.FP8_RUN_SETTINGS),
    where set (not None), become the backend's switches of those names before the engine reads
    them; unset, the backend's stand."""
    for key in FP8_RUN_SETTINGS:
        value = getattr(t, key)
        if value is not None and t.precision == "fp8":
            setattr(be, key, value)


def fp8_scaling(be) -> str:
    """The backend's fp8_scaling switch ("current" or "delayed"; a backend without FP8: current)."""
    value = getattr(be, "fp8_scaling", "current")
    if value not in ("current", "delayed"):
        raise ValueError(f"fp8_scaling = {value!r}: expected current or delayed")
    return value


def fp8_classifier_runs(cfg: AndreaConfig, switch: bool) -> bool:
    """Whether a train.precision=fp8 run's classifier runs in FP8: the backend's fp8_classifier
    switch, and sizes its FP8 products take (cuda/fp8.classifier_in_fp8: V and B*T multiples of 16)."""
    m, t = cfg.model, cfg.train
    if t.precision != "fp8" or not switch:
        return False
    from ..backends.cuda.fp8 import classifier_in_fp8
    return classifier_in_fp8(t.batch_size * t.seq_len, m.vocab_size)


# train.precision=fp8: the products whose input X the model saves for the backward pass (the
# same tensor in both passes), and the MLP's second one, whose input act = gelu(pre) both passes
# make from the saved pre, by weight: these have input slots (cuda/fp8.Fp8Ops.use_input_slots).
# act is the workspace of that name, shared by every layer (the slot only names it).
FP8_SLOT_INPUTS = {"qkv_w": "ln1", "attn_out_w": "atty", "mlp_w1": "ln2", "mlp_w2": "act"}


# train.precision=fp8 with delayed scaling (cuda/fp8.Fp8Ops.use_delayed_scales): the tensors whose
# scale comes from an amax history, as (role, weight) of the product that reads them: the MLP's act
# (the second product's input) and dact (the first's output gradient), the attention output (the
# projection's input), the output gradients of QKV, the projection and the MLP's second product
# (dqkv and the residual stream's two), and ln1 and ln2 (the inputs of QKV and of the MLP's first
# product, which their layer norms write as FP8 operands: k_layernorm_fwd_fp8). Their amax is taken
# by the pass that casts them.
FP8_DELAYED = (("act", "mlp_w2"), ("dy", "mlp_w1"), ("x", "attn_out_w"), ("dy", "qkv_w"), ("dy", "attn_out_w"),
               ("dy", "mlp_w2"), ("x", "qkv_w"), ("x", "mlp_w1"))


def fp8_delayed_tensors(m, slots: bool = True) -> List[tuple]:
    """(role, weight name) of every delayed scale, layer by layer: a row of the arena each. Without
    input slots (slots False) the inputs (role x: the attention output, ln1, ln2) keep current
    scaling (an input's delayed scale's 1/scale lives in its slot)."""
    return [(role, f"h{l}.{w}") for l in range(m.n_layer) for role, w in FP8_DELAYED if slots or role != "x"]


def fp8_input_slots(m) -> List[tuple]:
    """(weight name, layer, saved activation name) of every product with an FP8 input slot, in
    the order of the forward pass (layer 0's ln1 first: its quantisation starts a pass)."""
    return [(f"h{l}.{w}", l, x) for l in range(m.n_layer) for w, x in FP8_SLOT_INPUTS.items()]


def make_plan(cfg: AndreaConfig, dtype: str = "float32", n_partials: int = 64, shards: int = 0,
              fp8_weight_cache: bool = True, fp8_keep_xt: bool = True,
              fp8_producer_amax: bool = True, fp8_classifier: bool = False,
              fp8_delayed: bool = False) -> MemoryPlan:
    """Every buffer the engine will ever use, from the config alone. shards = N > 0: ZeRO-1 over N
    ranks (Engine): the flat buffers padded to a multiple of N, the Adam moments one rank's shard
    of padded/N, and the norm's partials one block per rank. fp8_weight_cache: with
    train.precision=fp8, the FP8 copies of the linear weights and their scales (the backend's
    fp8_weight_cache switch; cuda/fp8.weight_cache_rows). fp8_keep_xt, fp8_producer_amax: the
    backend's switches of those names; with either, the (amax, 1/scale) rows of the FP8 input
    slots, with fp8_keep_xt also the kept FP8 X^T of each (cuda/fp8.input_slot_rows).
    fp8_classifier: the classifier runs in FP8 (fp8_classifier_runs), so the cache holds wte too.
    fp8_delayed: the delayed scales of the MLP's act and dact (cuda/fp8.delayed_rows)."""
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
    if t.precision == "fp8" and fp8_weight_cache:
        from ..backends.cuda.fp8 import weight_cache_rows
        shapes = dict(model.param_shapes(m)[0])
        for name, shape, dt in weight_cache_rows([shapes[w] for w in fp8_cached_weights(m, fp8_classifier)]):
            plan.add(name, shape, dt, "fp8 weight cache")
    if t.precision == "fp8" and (fp8_keep_xt or fp8_producer_amax):
        from ..backends.cuda.fp8 import input_slot_rows
        shapes = dict(model.param_shapes(m)[0])
        for name, shape, dt in input_slot_rows([shapes[w] for w, _, _ in fp8_input_slots(m)], B * T, fp8_keep_xt):
            plan.add(name, shape, dt, "fp8 input slots")
    if t.precision == "fp8" and fp8_delayed:
        from ..backends.cuda.fp8 import delayed_rows
        for name, shape, dt in delayed_rows(len(fp8_delayed_tensors(m, fp8_keep_xt or fp8_producer_amax))):
            plan.add(name, shape, dt, "fp8 delayed scales")
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


class Engine:
    """Owns every buffer and the optimizer state of one model; runs steps on one backend."""

    def __init__(self, cfg: AndreaConfig, backend=None, dtype: str = "float32", comm=None, zero1: bool = False):
        self.cfg = cfg
        # data parallelism (andrea/core/comm.py): this engine is one rank of comm.size, each running
        # its own microbatches; the step sums the gradients over the ranks before the optimizer.
        # zero1: each rank keeps the Adam moments of its own shard of the flat buffers only
        # (ZeRO-1, docs/DISTRIBUTED.md); with one rank the shard is everything (same plan, same bits)
        self.comm = comm if comm is not None else SINGLE
        self.zero1 = bool(zero1)
        self.be = backend if backend is not None else get_backend(cfg.backend.name)
        t = cfg.train
        if t.precision not in self.be.precisions:
            raise ValueError(f"train.precision={t.precision} needs backend=cuda; backend {self.be.name} "
                             f"runs {', '.join(self.be.precisions)} (the NumPy reference: fp32, or "
                             "float64 in checks)")
        self.layout = model.ParamLayout.from_config(cfg.model)
        # fp8: FP8 copies of the linear weights, refreshed whenever the weights change (the
        # backend's switch, read once here)
        self.fp8_cache = t.precision == "fp8" and bool(self.be.fp8_weight_cache)
        # fp8: X^T of the saved inputs kept from the forward for the backward, and the amax of ln1
        # and ln2 from their layer norms (the backend's switches, read once here)
        self.fp8_keep_xt = t.precision == "fp8" and bool(self.be.fp8_keep_xt)
        self.fp8_producer_amax = t.precision == "fp8" and bool(self.be.fp8_producer_amax)
        # fp8: the classifier's products in FP8 as well (train.fp8_classifier / fp8_dlogits where the
        # run sets them, else the backend's switches; and sizes they take)
        apply_fp8_settings(self.be, t)
        self.fp8_classifier = fp8_classifier_runs(cfg, bool(self.be.fp8_classifier))
        # fp8: the MLP's act and dact scaled from an amax history (train.fp8_scaling, else the
        # backend's switch); _fp8_first: the record of a step that took the amax first, until read
        self.fp8_delayed = t.precision == "fp8" and fp8_scaling(self.be) == "delayed" and cfg.model.n_layer > 0
        self.fp8_scales, self._fp8_first = None, None  # the backend's DelayedScales (_allocate)
        self.plan = make_plan(cfg, dtype, self.be.grad_norm_partials, self.comm.size if self.zero1 else 0,
                              **self._fp8_switches())
        self.dtype = dtype
        self.mixed = t.precision != "fp32"
        self._allocate()
        self.comm.prepare(self.grads)
        self.comm.on_close(self.graphs.clear)  # graphs holding NCCL calls go before NCCL does
        self.loss_scale = float(t.loss_scale) if t.precision == "fp16" else 1.0
        self.init_params(t.seed)

    # ------------------------------------------------------------ set-up
    def _allocate(self):
        self.arena = Arena(self.be, self.plan.total())
        bufs = {r.name: self.arena.take(r.shape, r.dtype) for r in self.plan.rows}
        self.arena.seal()
        self.bufs = bufs
        self.params, self.grads = bufs["params"], bufs["grads"]
        self.m, self.v = bufs["adam_m"], bufs["adam_v"]
        self.params_c = bufs.get("params_c", self.params)
        self.optim_state, self.dloss = bufs["optim_state"], bufs["dloss"]
        # ZeRO-1: this rank's shard [lo, hi) of the (padded) flat buffers, the part its AdamW updates
        n, size = self.layout.n_params, self.comm.size
        self.lo, self.hi = (shard_bounds(n, size, self.comm.rank)[1:] if self.zero1 else (0, n))
        if self.zero1:
            P = self.be.grad_norm_partials
            self.shard = {"params": self.params[self.lo:self.hi], "grads": self.grads[self.lo:self.hi],
                          "partials": bufs["norm_partials"][self.comm.rank * P:(self.comm.rank + 1) * P]}
        self.p = self.layout.views(self.params_c)  # what the kernels read
        self.dp = self.layout.views(self.grads)
        shapes = model.activation_shapes(self.cfg.model, 1, 1)
        self.layers = [{k: bufs[f"h{l}.{k}"] for k in shapes} for l in range(self.cfg.model.n_layer)]
        self.g = {k: bufs[k] for k in model.global_shapes(self.cfg.model, 1, 1)}
        # the kernels' own scratch (CUDA: attention statistics, column partials, those a backward
        # pass of n_layer layers defers to its end, sort keys, the cuBLAS and cuBLASLt workspaces)
        # is allocated here too, not during step 1; the graph runner replays whole passes (CUDA
        # graphs; the CPU runs them as they are)
        m, t = self.cfg.model, self.cfg.train
        self.workspace = self.be.reserve_workspace(t.batch_size, t.seq_len, m.d_model, m.n_head,
                                                   self.params_c.dtype, fp8=t.precision == "fp8",
                                                   n_layer=m.n_layer, vocab=m.vocab_size)
        if self.fp8_cache:  # the products of the listed weights read these copies from now on
            self.be.use_fp8_weight_cache([self.p[w] for w in fp8_cached_weights(m, self.fp8_classifier)],
                                         bufs["fp8_wcache"], bufs["fp8_wmeta"], bufs["fp8_wtable"],
                                         alone=int(self.fp8_classifier))  # wte, refreshed on its own
        if (self.fp8_keep_xt or self.fp8_producer_amax) and m.n_layer:  # the inputs' amax and X^T live here
            slots = fp8_input_slots(m)
            self.be.use_fp8_input_slots([self.p[w] for w, _, _ in slots], [self.slot_input(l, x) for _, l, x in slots],
                                        bufs["fp8_xmeta"], bufs.get("fp8_xt"), self.fp8_producer_amax)
        if self.fp8_delayed:  # after the slots: act's slots take their 1/scale from these rows
            from ..backends.cuda.fp8 import META_STRIDE
            slots = self.fp8_keep_xt or self.fp8_producer_amax
            tensors = [(role, self.p[w]) for role, w in fp8_delayed_tensors(m, slots)]
            self.fp8_scales = self.be.use_fp8_delayed_scales(tensors, bufs["fp8_delayed"].reshape(-1, META_STRIDE))
        self.graphs = self.be.graph_runner()

    def slot_input(self, layer: int, name: str):
        """The array an FP8 input slot names (fp8_input_slots): layer's saved activation, or the
        global workspace of that name (act)."""
        return self.layers[layer][name] if name in self.layers[layer] else self.g[name]

    def _fp8_switches(self) -> dict:
        """make_plan's fp8 arguments: this engine's switches."""
        return {"fp8_weight_cache": self.fp8_cache, "fp8_keep_xt": self.fp8_keep_xt,
                "fp8_producer_amax": self.fp8_producer_amax, "fp8_classifier": self.fp8_classifier,
                "fp8_delayed": self.fp8_delayed}

    def init_params(self, seed: int):
        """Normal(0, init_std) matrices and embeddings, zero biases, unit layer-norm gains."""
        rng = np.random.default_rng(seed)
        host = np.zeros(self.layout.n_params, dtype=self.dtype)
        for name, off, shape in self.layout.entries:
            n = int(np.prod(shape))
            if len(shape) == 2:
                host[off:off + n] = rng.normal(0.0, self.cfg.train.init_std, n)
            elif name.endswith(("ln1_w", "ln2_w", "lnf_w")):
                host[off:off + n] = 1.0
        self.set_state(host)

    def set_state(self, params, m=None, v=None):
        """Load host arrays (of n_params each) into the device buffers (no new device buffers);
        under ZeRO-1 this rank keeps its shard of m and v."""
        n = self.layout.n_params
        self.be.write(self.params[:n], params)
        for buf, host in ((self.m, m), (self.v, v)):
            if host is None:
                buf.fill(0)
            elif self.zero1:  # the shard, the padding past n_params as zeros
                mine = np.zeros(self.hi - self.lo, dtype=buf.dtype)
                got = np.asarray(host)[self.lo:min(self.hi, n)]
                mine[:got.size] = got
                self.be.write(buf, mine)
            else:
                self.be.write(buf, host)
        self.grads.fill(0)
        if self.mixed:
            self.be.k_cast_params(self.params_c, self.params)
        self._refresh_fp8()
        self._load_fp8_history(None)

    def _load_fp8_history(self, history):
        """The delayed scales' amax history (None: empty, the next step takes its amax first)."""
        if self.fp8_delayed:
            self.fp8_scales.load(history)
            self._fp8_first = None

    def _fp8_settle(self):
        """Once the record of the step that took its amax first says it was not skipped, the
        history holds that amax and the steps after scale from it (waits for that step only)."""
        if self._fp8_first is not None:
            if not self._fp8_first["skipped"]:
                self.fp8_scales.live = True
            self._fp8_first = None

    def fp8_history(self):
        """The delayed scales' amax history ((n, 16) float32 as nested lists, newest first), or
        None: no delayed scales, or no step has recorded one yet."""
        if not self.fp8_delayed:
            return None
        self._fp8_settle()
        if not self.fp8_scales.live:
            return None
        return [[float(a) for a in row] for row in self.fp8_scales.history()]

    def _refresh_fp8(self):
        """The FP8 copies of the weights rewritten from the compute copy, wherever it changed: after
        a load and after every optimizer update (in its CUDA graph; a skipped step rewrites the
        same bytes)."""
        if self.fp8_cache:
            self.be.refresh_fp8_weight_cache()

    def host_state(self):
        """(params, m, v) as host float32 arrays of n_params, the checkpoint's three blocks. Under
        ZeRO-1 on several ranks a collective (every rank calls it): m and v are gathered from the
        ranks' shards on rank 0, and are None on the other ranks."""
        n = self.layout.n_params
        params = np.ascontiguousarray(self.be.to_numpy(self.params[:n]), dtype=np.float32)
        if not self.zero1:
            return (params, *(np.ascontiguousarray(self.be.to_numpy(a), dtype=np.float32) for a in (self.m, self.v)))
        m, v = (self.comm.gather(np.ascontiguousarray(self.be.to_numpy(a), dtype=np.float32)) for a in (self.m, self.v))
        return params, *((None if a is None else a[:n]) for a in (m, v))

    def state(self) -> "EngineState":
        """Everything a checkpoint keeps of this engine, as host copies (the engine goes on). Under
        ZeRO-1 on several ranks a collective, whose m and v are rank 0's alone (host_state)."""
        # the NumPy backend's host view is the buffer itself: copy it, so the state stays put
        params, m, v = (h.copy() if isinstance(a, np.ndarray) and h is not None and np.shares_memory(h, a) else h
                        for h, a in zip(self.host_state(), (self.params, self.m, self.v)))
        return EngineState(params, m, v, self.loss_scale, self.good_streak, self.bad_streak, self.skipped,
                           self.fp8_history())

    def state_counters(self, history: bool = True) -> dict:
        """The loss scale and the step counters, as in a checkpoint's sidecar (EngineState.counters),
        and (history) the delayed FP8 scales' amax history, which waits for the device."""
        c = {"loss_scale": self.loss_scale, "good_streak": self.good_streak, "bad_streak": self.bad_streak,
             "skipped": self.skipped}
        return {**c, "fp8_amax_history": self.fp8_history()} if history else c

    def load_state(self, st: "EngineState") -> None:
        """Continue from st: weights, Adam moments, loss scale, step counters and the delayed FP8
        scales' amax history (none: the next step takes its amax first) (no new buffers)."""
        self.set_state(st.params, st.m, st.v)
        self.loss_scale = float(st.loss_scale)
        self.good_streak, self.bad_streak, self.skipped = int(st.good_streak), int(st.bad_streak), int(st.skipped)
        self._load_fp8_history(st.fp8_amax_history)

    def print_plan(self, file=sys.stderr):
        t = self.cfg.train
        mc = self.cfg.model
        attn = self.be.attention_kernels(self.params_c.dtype, mc.d_model // mc.n_head)
        print(f"memory plan: {mc.name} B={t.batch_size} T={t.seq_len} "
              f"precision={t.precision} backend={self.be.name} params={self.layout.n_params:,} "
              f"attention={attn}", file=file)
        print(self.plan.table(), file=file, flush=True)
        ws = self.workspace.nbytes()
        if ws:
            print(f"{'kernel workspace':<22}{ws:>16,}{ws / 2**20:>12.1f}"
                  "  (backend scratch, outside the arena)", file=file, flush=True)
        if t.precision == "fp8":  # the FP8 operands and their scales, part of that workspace
            m = self.cfg.model
            for name, shape, dtype in self.be.workspace_rows(t.batch_size, t.seq_len, m.d_model, m.n_head,
                                                             self.params_c.dtype, fp8=True, vocab=m.vocab_size):
                if name.startswith("fp8_"):
                    b = int(np.prod(shape)) * np.dtype(dtype).itemsize
                    print(f"  {name:<20}{b:>16,}{b / 2**20:>12.1f}  {dtype} {shape}", file=file, flush=True)
        if self.comm.size > 1 and self.zero1:
            saved = make_plan(self.cfg, self.dtype, self.be.grad_norm_partials,
                              **self._fp8_switches()).total() - self.plan.total()
            print(f"data parallel: {self.comm.describe()}, ZeRO-1; the bytes above are per rank (each rank "
                  f"holds the whole model and its gradients, padded to {self.params.size:,} elements, and the "
                  f"Adam moments of its shard of {self.hi - self.lo:,}: {saved:,} bytes fewer than without "
                  f"ZeRO-1), {self.comm.size} ranks hold {self.comm.size * (self.plan.total() + ws):,} bytes "
                  "in all", file=file, flush=True)
        elif self.comm.size > 1:
            print(f"data parallel: {self.comm.describe()}; the bytes above are per rank (each rank holds "
                  f"the whole model, its gradients and Adam state), {self.comm.size} ranks hold "
                  f"{self.comm.size * (self.plan.total() + ws):,} bytes in all", file=file, flush=True)

    # ------------------------------------------------------------ the optimizer state (on the device)
    def _get(self, slot) -> float:
        return float(self.be.to_numpy(self.optim_state[slot:slot + 1])[0])

    def _set(self, slot, value):
        self.be.write(self.optim_state[slot:slot + 1], [value])

    @property
    def loss_scale(self) -> float:
        """The dynamic loss scale (1.0 unless fp16); setting it also sets the loss gradient."""
        return self._get(S_SCALE)

    @loss_scale.setter
    def loss_scale(self, value):
        self._set(S_SCALE, value)
        t = self.cfg.train
        self.be.write(self.dloss, [float(value) / (t.batch_size * t.seq_len)])

    good_streak = property(lambda self: int(self._get(S_GOOD)), lambda self, v: self._set(S_GOOD, v),
                           doc="consecutive finite steps, for loss-scale growth")
    bad_streak = property(lambda self: int(self._get(S_BAD)), lambda self, v: self._set(S_BAD, v),
                          doc="consecutive non-finite steps, for the abort policy")
    skipped = property(lambda self: int(self._get(S_SKIPPED)), lambda self, v: self._set(S_SKIPPED, v),
                       doc="total skipped steps")

    # ------------------------------------------------------------ the step
    def zero_grads(self):
        self.grads.fill(0)

    def forward(self, x, y):
        """Forward one microbatch; returns its mean loss (host float). With delayed FP8 scales it
        scales by the history and records nothing (a history is read as held once the step that
        first recorded one is known not skipped: _fp8_settle, so that an evaluation right after
        that step does not take its own amax into the scales' rows)."""
        self._fp8_settle()
        self.be.write(self.g["tokens"], x)
        self.be.write(self.g["targets"], y)
        model.forward(self.be, self.p, self.layers, self.g, self.cfg.model.n_head)
        return float(np.mean(self.be.to_numpy(self.g["losses"]), dtype=np.float64))

    def forward_backward(self, x, y) -> float:
        """Forward + backward of one microbatch; ADDS its gradient (times the loss scale, of the
        mean loss over its B*T positions) into the grads buffer; returns the mean loss (waits for
        the device). train_step does the same without waiting."""
        self._passes(x, y, accumulate=False)
        return float(np.mean(self.be.to_numpy(self.g["losses"]), dtype=np.float64))

    def _passes(self, x, y, accumulate=True, first=False):
        """Queue forward + backward of one microbatch (and, with accumulate, add its loss sum to
        the optimizer state). The loss gradient is read from the device (self.dloss). first: the
        step's first microbatch, whose backward pass writes the gradients instead of adding into
        them (param_grad_pass(start=grads)), so nothing zeroes them between steps."""
        be, nh = self.be, self.cfg.model.n_head
        be.upload(self.g["tokens"], x)
        be.upload(self.g["targets"], y)

        def passes():
            model.forward(be, self.p, self.layers, self.g, nh, loss=False)
            model.backward(be, self.p, self.dp, self.layers, self.g, nh, self.dloss,
                           start=self.grads if first else None)
            if accumulate:
                be.k_loss_accum(self.optim_state, self.g["losses"])
        live = None
        if self.fp8_delayed:  # a training step's passes record their amax for the delayed scales
            live, step_passes = self.fp8_scales.live, passes

            def passes():
                with self.fp8_scales.recording():
                    step_passes()
        # CUDA: both passes replay as one graph (hundreds of launches cost milliseconds of Python
        # otherwise); the key holds what the graph bakes in (this engine's buffers, and whether
        # the delayed scales have a history)
        self._run(("passes", accumulate, first, live), passes)

    def _optimizer(self, n_micro):
        """Queue the end of the step: the sum over the ranks, norm, non-finite policy, loss scale,
        clip + AdamW + cast. n_micro: this rank's microbatches (every rank runs as many)."""
        t, be, comm = self.cfg.train, self.be, self.comm
        partials = self.bufs["norm_partials"]
        loss_sum = self.optim_state[S_LOSS_SUM:S_LOSS_SUM + 1]
        n_micro *= comm.size  # the average is over every rank's microbatches

        def check():
            be.k_step_check(self.optim_state, self.dloss, partials, n_micro, t.batch_size * t.seq_len,
                            t.beta1, t.beta2, t.weight_decay, t.grad_clip, t.precision == "fp16",
                            SCALE_GROWTH_INTERVAL, MAX_LOSS_SCALE)

        def optimizer():
            comm.allreduce_sum(self.grads, loss_sum)  # nothing with one rank
            be.k_grad_norm_partial(partials, self.grads)
            check()
            # the grads are left as they are: the next step's first pass writes them
            be.k_adamw_step(self.params, self.params_c, self.grads, self.m, self.v, self.optim_state,
                            t.beta1, t.beta2, t.eps, self.layout.n_decay, zero_grads=False)
            self._refresh_fp8()
            self._roll_fp8()

        def sharded():  # ZeRO-1: this rank updates its shard, then every rank gets every shard
            sh = self.shard
            comm.allreduce_sum(loss_sum)
            comm.reduce_scatter_sum(self.grads)  # the shard of grads: the sum over the ranks
            be.k_grad_norm_partial(sh["partials"], sh["grads"])  # this rank's block of the partials
            comm.allgather(partials)  # every rank's block: the same norm and decisions everywhere
            check()
            # the decayed parameters are the first n_decay of the flat buffer: those in the shard
            n_decay = min(max(self.layout.n_decay - self.lo, 0), self.hi - self.lo)
            be.k_adamw_step(sh["params"], sh["params"], sh["grads"], self.m, self.v, self.optim_state,
                            t.beta1, t.beta2, t.eps, n_decay, zero_grads=False)
            comm.allgather(self.params)  # the fp32 master weights, whole on every rank
            if self.mixed:
                be.k_cast_params(self.params_c, self.params)
            self._refresh_fp8()
            self._roll_fp8()
        self._run(("optimizer", n_micro), sharded if self.zero1 else optimizer)

    def _roll_fp8(self):
        """The delayed scales' histories take this step's amax (unless it is skipped; on the
        device, in the optimizer's graph). With several ranks the step's amax is the largest of
        every rank's first, so every rank keeps the same histories (and rank 0's checkpoint holds
        them all)."""
        if self.fp8_delayed:
            self.comm.allreduce_max(self.fp8_scales.block)  # the other fields are equal on every rank
            self.fp8_scales.roll(self.optim_state)

    def _run(self, key, fn):
        self.graphs.run(key, fn)

    def train_step(self, step: int, batches) -> "StepRecord":
        """One optimizer step (1-based step number) over len(batches) microbatches. Queues the
        work and returns at once (the CUDA backend lets the host run a few steps ahead); the
        returned record waits for the step's results when first read."""
        lr = lr_at(self.cfg, step)
        self._fp8_settle()
        first_amax = self.fp8_delayed and not self.fp8_scales.live
        self.be.upload(self.optim_state[S_LR:S_STEP + 1], [lr, step])
        for i, (x, y) in enumerate(batches):
            self._passes(x, y, first=i == 0)  # the first microbatch's pass starts the gradients
        self._optimizer(len(batches))
        rec = StepRecord(step, lr, self.be.download_async(self.optim_state))
        if first_amax:  # the step took its amax first; read its record before the next
            self._fp8_first = rec
        return rec

    # ------------------------------------------------------------ inference
    def val_loss(self, batches) -> float:
        """Mean loss over (x, y) batches, without touching grads or optimizer state."""
        losses = [self.forward(x, y) for x, y in batches]
        if not losses:
            raise ValueError("val_loss: no batches")
        return float(np.mean(losses))

    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, seed=0, stop_ids=()):
        """Sample up to max_new_tokens after prompt_ids (greedy when temperature == 0). Runs the
        full fixed-size forward pass per token (no KV cache): simple, and the buffers stay fixed."""
        B, T = self.cfg.train.batch_size, self.cfg.train.seq_len
        rng = np.random.default_rng(seed)
        ids, out = list(prompt_ids)[-T:], []
        x = np.zeros((B, T), dtype=np.int32)
        for _ in range(max_new_tokens):
            ctx = ids[-T:]
            x[0, :] = 0
            x[0, :len(ctx)] = ctx
            self.forward(x, x)
            row = self.g["lnf"][0, len(ctx) - 1]  # the classifier keeps no logits: one row here
            logits = self.be.to_numpy(self.be.xp.matmul(self.p["wte"], row)).astype(np.float64)
            nxt = _pick(logits, temperature, rng)
            out.append(nxt)
            ids.append(nxt)
            if nxt in stop_ids:
                break
        return out

    def load_checkpoint(self, path, config_hash: Optional[str] = None):
        """Load a checkpoint: the one load path of training (resume) and evaluation. Checked: size,
        n_params, sha256 and, when config_hash is given, the sidecar's config hash (a checkpoint
        of other model or training settings is refused with a CheckpointError). Training and
        evaluation pass their run's config_hash; a tool that reshapes the batch for inference
        passes none. Returns the Checkpoint, whose sidecar also holds the data position."""
        from .checkpoint import CheckpointError, read_checkpoint, sidecar_path
        c = read_checkpoint(path, self.layout.n_params, config_hash)
        st = EngineState.from_checkpoint(c, self.state_counters(history=False))  # the sidecar's history only
        if self.fp8_delayed and st.fp8_amax_history is not None:  # the sidecar's, checked before any load
            from ..backends.cuda.fp8 import delayed_history_array
            n = self.fp8_scales.block.shape[0]
            try:
                rows = delayed_history_array(st.fp8_amax_history).shape[0]
            except ValueError as e:
                raise CheckpointError(f"checkpoint sidecar {sidecar_path(path)}: field {e}") from None
            if rows != n:  # written for another set of delayed scales (engine.FP8_DELAYED)
                print(f"checkpoint sidecar {sidecar_path(path)}: fp8_amax_history has {rows} rows, written for "
                      f"another set of delayed FP8 scales (this engine has {n}); the histories start over: the "
                      "next step takes each amax first", file=sys.stderr, flush=True)
                st.fp8_amax_history = None
        self.load_state(st)
        return c


@dataclass
class EngineState:
    """An engine's resumable state: host float32 weights and Adam moments, the dynamic loss scale
    and the counters of its growth and of the abort policy. A checkpoint holds exactly this (the
    arrays in its .bin, the counters in its sidecar)."""
    params: np.ndarray
    m: np.ndarray
    v: np.ndarray
    loss_scale: float
    good_streak: int
    bad_streak: int
    skipped: int
    # train.precision=fp8 with delayed scales: the amax history (n, 16), newest first; None where
    # there are none or no step recorded one (the next step takes its amax first)
    fp8_amax_history: Optional[list] = None

    def counters(self) -> dict:
        """The sidecar fields of this state (fp8_amax_history only where there is one)."""
        c = {"loss_scale": self.loss_scale, "good_streak": self.good_streak, "bad_streak": self.bad_streak,
             "skipped": self.skipped}
        if self.fp8_amax_history is not None:
            c["fp8_amax_history"] = self.fp8_amax_history
        return c

    @classmethod
    def from_checkpoint(cls, c, counters: dict) -> "EngineState":
        """The state checkpoint c holds; a counter its sidecar lacks (a checkpoint written by
        `andrea import` or by a test, not by a training run) is taken from counters."""
        s = {**counters, **{k: c.sidecar[k] for k in counters if k in c.sidecar}}
        return cls(c.params, c.m, c.v, float(s["loss_scale"]), int(s["good_streak"]), int(s["bad_streak"]),
                   int(s["skipped"]), c.sidecar.get("fp8_amax_history"))


class StepRecord(Mapping):
    """The record of one step: step, loss, lr, grad_norm, loss_scale (the scale the step ran
    with), skipped. The values come from the step's copy of the optimizer state, read when the
    record is first used."""

    KEYS = ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped")

    def __init__(self, step, lr, pending):
        self._step, self._lr, self._pending, self._rec = step, lr, pending, None

    def _values(self) -> dict:
        if self._rec is None:
            st = self._pending.get()
            self._rec = {"step": self._step, "loss": float(st[S_LOSS]), "lr": self._lr,
                         "grad_norm": float(st[S_NORM]), "loss_scale": float(st[S_REC_SCALE]),
                         "skipped": bool(st[S_SKIP])}
        return self._rec

    def __getitem__(self, key):
        return self._values()[key]

    def __iter__(self):
        return iter(self.KEYS)

    def __len__(self):
        return len(self.KEYS)


def _pick(logits, temperature, rng) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(len(p), p=p))

