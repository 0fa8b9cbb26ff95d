"""The engine: one arena allocated at start-up, the train step, AdamW and clipping.

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
lives on the device (interface.STATE_SLOTS); train_step returns a StepRecord that reads the step's
copy of it when first used, so the host need not wait for the step to finish.

The memory plan and the arena are in plan.py (make_plan, Arena); EngineState, StepRecord and the
Engine's accessors of its optimizer state and resumable state (StateMixin) are in state.py.

Data parallelism (comm, docs/DISTRIBUTED.md): the gradients are summed over the ranks before the
norm, in buckets issued during the last microbatch's backward pass (buckets.py), or in one call
after it (ANDREA_DDP_BUCKET_MB=0); with zero1 (ZeRO-1) each rank keeps the Adam moments of its own shard of the flat buffers,
updates that shard and all-gathers the weights (Engine._optimizer).
"""
from __future__ import annotations

import math
import sys
from typing import Optional

import numpy as np

from . import model
from ..backends import get_backend
from ..backends.interface import S_LOSS_SUM, S_LR, S_STEP
from .buckets import make_buckets, said
from .comm import SINGLE, shard_bounds
from ..config import FP8_RUN_SETTINGS, AndreaConfig
from ..data.chat import IGNORE_INDEX
from .plan import Arena, fp8_backend, fp8_cached_weights, fp8_delayed_tensors, fp8_input_slots, make_plan
from .state import EngineState, StateMixin, StepRecord

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


def fp8_classifier_runs(cfg: AndreaConfig, level: int) -> bool:
    """Whether a train.precision=fp8 run's classifier runs in FP8: its fp8_classifier level (the
    backend's fp8_run(), from train.fp8_classifier), and sizes its FP8 products take
    (interface.Fp8Backend.fp8_classifier_fits: V, B*T and the logits chunk's rows multiples of 16)."""
    m, t = cfg.model, cfg.train
    if t.precision != "fp8" or not level:
        return False
    N = t.batch_size * t.seq_len
    return fp8_backend().fp8_classifier_fits(N, m.vocab_size, model.loss_chunk_rows(N, m.vocab_size))


class Engine(StateMixin):
    """Owns every buffer and the optimizer state of one model; runs steps on one backend."""

    def __init__(self, cfg: AndreaConfig, backend=None, dtype: str = "float32", comm=None, zero1: bool = False,
                 bucket_bytes: Optional[int] = None):
        self.cfg = cfg
        # data parallelism (andrea/core/comm.py): this engine is one rank of comm.size, each running
        # its own microbatches; the step sums the gradients over the ranks before the optimizer.
        # zero1: each rank keeps the Adam moments of its own shard of the flat buffers only
        # (ZeRO-1, docs/DISTRIBUTED.md); with one rank the shard is everything (same plan, same bits).
        # bucket_bytes: the sum's bucket cap, issued during the last backward pass (buckets.py;
        # None: ANDREA_DDP_BUCKET_MB, 0: one sum after it)
        self.comm = comm if comm is not None else SINGLE
        self.zero1 = bool(zero1)
        self.be = backend if backend is not None else get_backend(cfg.backend.name)
        t = cfg.train
        if t.precision not in self.be.precisions:
            raise ValueError(f"train.precision={t.precision} needs backend=cuda; backend {self.be.name} "
                             f"runs {', '.join(self.be.precisions)} (the NumPy reference: fp32, or "
                             "float64 in checks)")
        self.layout = model.ParamLayout.from_config(cfg.model)
        # rows of the classifier's logits workspace (the plan's "logits"; the backend's FP8 rows too)
        self.chunk_rows = model.loss_chunk_rows(t.batch_size * t.seq_len, cfg.model.vocab_size)
        # fp8 (the backend's interface.Fp8Backend members): FP8 copies of the linear weights,
        # refreshed whenever the weights change, and input slots (the inputs' amax, X^T kept from
        # the forward for the backward); the run's FP8 settings (train.fp8_classifier, fp8_dlogits,
        # fp8_dlogits_rounding, fp8_scaling; unset: the backend's defaults) given to the backend
        fp8 = t.precision == "fp8"
        self.fp8_cache = fp8
        run = {}
        if fp8:
            self.be.set_fp8_run(**{key: getattr(t, key) for key in FP8_RUN_SETTINGS})
            run = self.be.fp8_run()
        # the classifier's products in FP8 as well where the run's level and the sizes say so
        self.fp8_classifier = fp8 and fp8_classifier_runs(cfg, run["fp8_classifier"])
        # the tensors scaled from an amax history (fp8_scaling delayed); _fp8_first: the record of a
        # step that took the amax first, until read
        self.fp8_delayed = fp8 and run["fp8_scaling"] == "delayed" and cfg.model.n_layer > 0
        self.fp8_scales, self._fp8_first = None, None  # the backend's DelayedScales (_allocate)
        self.plan = make_plan(cfg, dtype, self.be.grad_norm_partials, self.comm.size if self.zero1 else 0,
                              fp8_classifier=self.fp8_classifier, fp8_delayed=self.fp8_delayed)
        self.dtype = dtype
        self.mixed = t.precision != "fp32"
        self._allocate()
        self.comm.prepare(self.grads)
        self.buckets = make_buckets(self.comm, self.grads, self.layout, cfg.model.n_layer, self.zero1, bucket_bytes)
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
                                                   n_layer=m.n_layer, vocab=m.vocab_size,
                                                   chunk_rows=self.chunk_rows)
        if self.fp8_cache:  # the products of the listed weights read these copies from now on
            self.be.use_fp8_weight_cache([self.p[w] for w in fp8_cached_weights(m, self.fp8_classifier)],
                                         bufs["fp8_wcache"], bufs["fp8_wmeta"], bufs["fp8_wtable"],
                                         alone=int(self.fp8_classifier))  # wte, refreshed on its own
        if self.fp8_cache and m.n_layer:  # the inputs' amax and X^T live here
            slots = fp8_input_slots(m)
            self.be.use_fp8_input_slots([self.p[w] for w, _, _ in slots], [self.slot_input(l, x) for _, l, x in slots],
                                        bufs["fp8_xmeta"], bufs.get("fp8_xt"), True)
        if self.fp8_delayed:  # after the slots: act's slots take their 1/scale from these rows
            tensors = [(role, self.p[w]) for role, w in fp8_delayed_tensors(m)]
            self.fp8_scales = self.be.use_fp8_delayed_scales(tensors, bufs["fp8_delayed"])
        self.graphs = self.be.graph_runner()

    def slot_input(self, layer: int, name: str):
        """The array an FP8 input slot names (fp8_input_slots): layer's saved activation, or the
        global workspace of that name (act)."""
        return self.layers[layer][name] if name in self.layers[layer] else self.g[name]

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
                                                             self.params_c.dtype, fp8=True, vocab=m.vocab_size,
                                                             chunk_rows=self.chunk_rows):
                if name.startswith("fp8_"):
                    b = int(np.prod(shape)) * np.dtype(dtype).itemsize
                    print(f"  {name:<20}{b:>16,}{b / 2**20:>12.1f}  {dtype} {shape}", file=file, flush=True)
        if self.comm.size > 1 and self.zero1:
            unsharded = make_plan(self.cfg, self.dtype, self.be.grad_norm_partials,
                                  fp8_classifier=self.fp8_classifier, fp8_delayed=self.fp8_delayed)
            saved = unsharded.total() - self.plan.total()
            print(f"data parallel: {self.comm.describe()}, ZeRO-1{said(self.buckets)}; the bytes above are per "
                  f"rank (each rank holds the whole model and its gradients, padded to {self.params.size:,} "
                  f"elements, and the Adam moments of its shard of {self.hi - self.lo:,}: {saved:,} bytes fewer "
                  f"than without ZeRO-1), {self.comm.size} ranks hold {self.comm.size * (self.plan.total() + ws):,} "
                  "bytes in all", file=file, flush=True)
        elif self.comm.size > 1:
            print(f"data parallel: {self.comm.describe()}{said(self.buckets)}; the bytes above are per rank "
                  f"(each rank holds the whole model, its gradients and Adam state), {self.comm.size} ranks hold "
                  f"{self.comm.size * (self.plan.total() + ws):,} bytes in all", file=file, flush=True)

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

    def _passes(self, x, y, accumulate=True, first=False, last=False):
        """Queue forward + backward of one microbatch (and, with accumulate, add its loss sum to
        the optimizer state). The loss gradient is read from the device (self.dloss). first: the
        step's first microbatch, whose backward pass writes the gradients instead of adding into
        them (param_grad_pass(start=grads)), so nothing zeroes them between steps. last: the step's
        last microbatch, whose pass issues the sums over the ranks in buckets (self.buckets)."""
        be, nh = self.be, self.cfg.model.n_head
        be.upload(self.g["tokens"], x)
        be.upload(self.g["targets"], y)
        ready = self.buckets.ready if last and self.buckets else None

        def passes():
            model.forward(be, self.p, self.layers, self.g, nh, loss=False)
            model.backward(be, self.p, self.dp, self.layers, self.g, nh, self.dloss,
                           start=self.grads if first else None, ready=ready)
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
        self._run(("passes", accumulate, first, live, ready is not None), passes)

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
            comm.allreduce_sum(loss_sum, *(() if self.buckets else (self.grads,)))  # nothing with one rank
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
            if not self.buckets:  # else summed during the last backward pass
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
        returned record waits for the step's results when first read. In a phase of
        loss_on=assistant each batch is (x, y, keep) and the loss is the mean over the kept
        targets of the whole step (_answer_targets); otherwise (x, y), any keep left unused."""
        lr = lr_at(self.cfg, step)
        self._fp8_settle()
        first_amax = self.fp8_delayed and not self.fp8_scales.live
        self.be.upload(self.optim_state[S_LR:S_STEP + 1], [lr, step])
        ph = phase_of(self.cfg, step)
        mean = 1.0  # the loss gradient's correction to the mean over the counted targets
        if ph is not None and ph.loss_on == "assistant":
            batches, mean = self._answer_targets(batches)
            self.dloss *= np.float32(mean)  # queued before the passes read it; k_step_check rewrites it
        for i, (x, y, *_) in enumerate(batches):
            self._passes(x, y, first=i == 0, last=i == len(batches) - 1)  # the first starts the gradients
        if mean != 1.0:
            self.optim_state[S_LOSS_SUM:S_LOSS_SUM + 1] *= mean  # the recorded loss: that same mean
        self._optimizer(len(batches))
        rec = StepRecord(step, lr, self.be.download_async(self.optim_state))
        if first_amax:  # the step took its amax first; read its record before the next
            self._fp8_first = rec
        return rec

    def _answer_targets(self, batches):
        """A loss_on=assistant step: each microbatch's targets outside the answers (the loader's
        keep) set to IGNORE_INDEX, and the factor that turns the step's mean over all its positions
        into the mean over the counted ones, on every rank (n_micro * B*T / counted): the gradient
        is then torch's cross_entropy(ignore_index=-1) over the whole step's batch, whatever its
        microbatches and ranks. A step with no counted target keeps the factor 1 (zero gradient)."""
        if any(len(b) < 3 for b in batches):
            raise ValueError("train.phases[].loss_on=assistant: the batches carry no answer mask; "
                             "expected the loader of data.loader.train_loader for this config")
        out = [(x, np.where(keep, y, IGNORE_INDEX).astype(np.int32)) for x, y, keep in batches]
        counted = sum(int(keep.sum()) for _, _, keep in batches)
        if self.comm.size > 1:  # every rank's count: rank 0 adds them up and tells the others
            every = self.comm.gather(np.array([counted], dtype=np.int64))
            counted = self.comm.bcast(None if every is None else int(every.sum()))
        n_pos = len(batches) * self.comm.size * self.cfg.train.batch_size * self.cfg.train.seq_len
        return out, (n_pos / counted if counted else 1.0)

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
            n = self.fp8_scales.block.shape[0]
            try:
                rows = self.be.fp8_history_rows(st.fp8_amax_history)
            except ValueError as e:
                raise CheckpointError(f"checkpoint sidecar {sidecar_path(path)}: field {e}") from None
            if rows != n:  # written for another set of delayed scales (plan.FP8_DELAYED)
                print(f"checkpoint sidecar {sidecar_path(path)}: fp8_amax_history has {rows} rows, written for "
                      f"another set of delayed FP8 scales (this engine has {n}); the histories start over: the "
                      "next step takes each amax first", file=sys.stderr, flush=True)
                st.fp8_amax_history = None
        self.load_state(st)
        return c


def _pick(logits, temperature, rng) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(len(p), p=p))
