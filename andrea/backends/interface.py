"""The backend interface, written down once: what the engine, the model and the benchmark may use.

Two implementations: NumpyBackend (numpy_backend.py, the reference kernels of ref/ on the
CPU) and CudaBackend (cuda/, kernels/*.cu on one GPU). Both implement every member below with
the same names and signatures; tests/test_backend_interface.py checks it. `get_backend` (in
__init__.py) returns a new object per call: one per engine.

Kernel conventions (ref/__init__.py's docstring has them in full): shapes B batch, T sequence, C
d_model, NH heads, hs = C // NH, V vocab; linear weights are (out, in) and compute inp @ w.T + b.
Forward kernels WRITE their outputs; backward kernels ADD into every gradient buffer, except the
activation gradient (dinp, dqkv: the first gradient argument) of a backward kernel called with
accumulate=False, which is WRITTEN without being read (model.backward: the first writer of each
buffer, so nothing is zeroed before it); parameter gradients always add, and inside a
param_grad_pass() some of those additions may wait for the end of the pass. Arrays are
the backend's own (NumPy or CuPy), C-contiguous, in the compute dtype unless a kernel says
float32 (statistics, gradients, master weights, optimizer state).

After the imports: the constants the engine and both backends share (the optimizer
state vector's layout, the FP8 formats and their defaults).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Hashable, List, Protocol, Tuple, runtime_checkable

WorkspaceRow = Tuple[str, tuple, str]  # (name, shape, dtype name)

# ---------------------------------------------------------------- shared constants
# Slots of the optimizer state, a float64 array of STATE_LEN the engine keeps on the device (the
# enum at the top of kernels/optim.cu lists the same names in the same order):
# carried from step to step: the dynamic loss scale, the good and bad streaks, the skipped count,
# the running loss sum of the step's microbatches; the record of the last step (mean loss, norm,
# the loss scale it ran with, 1.0 if skipped); the float32 scalars of k_adamw_step; the learning
# rate and the 1-based step number, written by the host before the step.
STATE_SLOTS = ("S_SCALE", "S_GOOD", "S_BAD", "S_SKIPPED", "S_LOSS_SUM",
               "S_LOSS", "S_NORM", "S_REC_SCALE", "S_SKIP",
               "S_CLIP", "S_DECAY", "S_STEP_SIZE", "S_VHAT",
               "S_LR", "S_STEP")
(S_SCALE, S_GOOD, S_BAD, S_SKIPPED, S_LOSS_SUM, S_LOSS, S_NORM, S_REC_SCALE, S_SKIP,
 S_CLIP, S_DECAY, S_STEP_SIZE, S_VHAT, S_LR, S_STEP) = range(len(STATE_SLOTS))
STATE_LEN = 16  # one spare slot

# The FP8 formats of train.precision=fp8 (ref/fp8.py, kernels/fp8.cu, cuda/fp8/; docs/FP8.md)
# and which tensors take which by default.
FP8_FORMATS = {  # name: (mantissa bits, exponent bias, largest finite value)
    "e4m3": (3, 7, 448.0),
    "e5m2": (2, 15, 57344.0),
}
FP8_FWD = "e4m3"  # weights and activations
FP8_GRAD = "e4m3"  # output gradients (the backend's default; "e5m2" the alternative, docs/FP8.md)
FP8_DLOGITS = "e4m3"  # the classifier's dlogits (the backend's default, docs/FP8.md "The classifier")
FP8_DLOGITS_ROUNDING = "stochastic"  # how dlogits meet the grid: "stochastic" or "nearest" (the same)
FP8_ROUNDINGS = ("nearest", "stochastic")
# Delayed scaling (cuda/fp8/, docs/FP8.md): a tensor's scale comes from the largest amax of the
# last FP8_HIST optimizer steps (a row of the engine's "fp8_delayed" block: [0] that amax, [1] the
# amax of the step under way, [2, 2 + FP8_HIST) the history, newest first), and the kernel that
# makes the tensor casts it and reduces its amax into [1].
FP8_HIST = 16
# The few-row products (k_decode_linear_fwd, k_decode_ln_linear_fwd: a warp an output column,
# kernels/decode.cu) take at most this many rows
DECODE_GEMV_ROWS = 8
# ... and the batched decoder runs them for at most this many slots, above it the training's linear
# layers on cuBLAS: each row's dot products run in turn, so their time grows with the rows, where
# cuBLAS's hardly does. H200, fp16, every slot busy, 100 tokens each (dev/decode_ab.py --slots,
# docs/BENCHMARKS.md 2026-12-03): ANDREA-120M 2,709 against 2,225 tokens/s at 1 slot, 4,246 against
# 4,317 at 2, 6,983 against 15,542 at 8; ANDREA-12M 7,234 against 6,204 at 1, 11,928 against 12,440 at 2
DECODE_GEMV_SLOTS = 1
# ... and only for models this wide at most (the widest measured): on an H200 (fp16, one slot, 200
# tokens, one job, decode.cu version 2) the few-row kernels decoded ANDREA-12M (d_model 384) at
# 6,897 tokens/s against cuBLAS's 6,445 and ANDREA-120M (768) at 2,678 against 2,208
# (docs/BENCHMARKS.md, 2026-12-03; version 1 lost at 768, 1,430 against 1,521)
DECODE_GEMV_MAX_C = 768


def fp8_rounding(rounding):
    """rounding checked ("nearest" or "stochastic"; None: FP8_DLOGITS_ROUNDING)."""
    rounding = FP8_DLOGITS_ROUNDING if rounding is None else rounding
    if rounding not in FP8_ROUNDINGS:
        raise ValueError(f"FP8 rounding {rounding!r}: expected one of {', '.join(FP8_ROUNDINGS)}")
    return rounding



@runtime_checkable
class Workspace(Protocol):
    """Scratch the kernels take beyond their arguments, for one model shape."""

    def nbytes(self) -> int:
        """Bytes held for the kernels (0 where they need none)."""


@runtime_checkable
class GraphRunner(Protocol):
    """Runs whole passes; on CUDA as CUDA graphs replayed by key, on the CPU eagerly."""

    def run(self, key: Hashable, fn: Callable[[], None]) -> None:
        """fn() (backend kernels only: no host syncs, no allocation), replayed from a graph
        recorded for key where the backend has graphs. key stands for everything fn bakes in
        (buffer addresses, host scalars)."""

    def clear(self) -> None:
        """Forget every recorded graph (before the communicator they call is torn down)."""


@runtime_checkable
class Backend(Protocol):
    # ------------------------------------------------------------ what it is
    name: str  # "numpy" or "cuda": for records and messages, never to choose code paths
    precisions: Tuple[str, ...]  # train.precision values it runs ("fp32", "fp16", "bf16", "fp8")
    grad_norm_partials: int  # length of the partials buffer k_grad_norm_partial fills
    xp: Any  # the array module (numpy or cupy), for small array arithmetic outside the kernels
    attention: str  # attention path chosen at construction: "fused" or "materialised"

    def attention_variant(self, dtype, head_size: int) -> str:
        """The path k_attn_fwd/_bwd take for this compute dtype and head size: "fused" or
        "materialised"."""

    def attention_kernels(self, dtype, head_size: int) -> str:
        """Which kernels k_attn_fwd/_bwd run for this compute dtype and head size, in words (the
        memory plan's line)."""

    def used_cublaslt(self) -> bool:
        """Whether any matrix product so far ran through cuBLASLt with a fused epilogue (CUDA,
        constructed with cublaslt=True, where cuBLASLt had an algorithm for the problem)."""

    # ------------------------------------------------------------ arrays and the device
    def empty(self, shape, dtype) -> Any:
        """A new uninitialised array of the backend."""

    def zeros(self, shape, dtype) -> Any:
        """A new zero-filled array of the backend."""

    def upload(self, dst, src) -> None:
        """Copy host array src into the existing array dst (same size; converted to dst's
        dtype; no new buffer). CUDA queues the copy on the current stream without waiting for
        the device; src may be reused at once."""

    def write(self, dst, src) -> None:
        """dst = src now: the host waits for the copy (large one-off copies: weights, optimizer
        state; upload's pinned buffers are for the small per-step ones)."""

    def download_async(self, a) -> Any:
        """A copy of a on its way to the host; its get() waits for it and returns the array."""

    def to_numpy(self, a) -> Any:
        """A host NumPy array with a's values (waits for the work that writes a)."""

    def synchronize(self) -> None:
        """Wait for all queued work."""

    # ------------------------------------------------------------ workspace and graphs
    def workspace_rows(self, B: int, T: int, C: int, n_head: int, act_dtype, fp8: bool = False,
                       n_layer: int = 0, vocab: int = 0, chunk_rows: int = 0) -> List[WorkspaceRow]:
        """The scratch buffers the kernels take for this model shape (fp8: with the FP8 operands
        and scales of train.precision=fp8; n_layer: with what a param_grad_pass over a backward
        pass of that many layers holds until its end, 0: nothing; vocab and chunk_rows: the
        classes of the classifier and the rows of its logits workspace, whose FP8 operands need
        room where it runs in FP8, 0: none)."""

    def reserve_workspace(self, B: int, T: int, C: int, n_head: int, act_dtype, fp8: bool = False,
                          n_layer: int = 0, vocab: int = 0, chunk_rows: int = 0) -> Workspace:
        """Allocate that scratch now, so the step loop allocates nothing; the kernels of this
        backend draw from the returned Workspace, which the engine keeps and prints. fp8: from
        now on the linear layers (k_attn_qkv_*, k_attn_out_*, k_mlp_*) run their products in FP8
        (CUDA on compute capability 8.9 or later; elsewhere a clear error). n_layer, vocab: as in
        workspace_rows (without n_layer a param_grad_pass defers nothing)."""

    def graph_runner(self) -> GraphRunner:
        """A new GraphRunner; the engine keeps one for its forward + backward passes."""

    def capture(self, fn: Callable[[], None], stream=None) -> Any:
        """fn() recorded as a graph on stream (CUDA; default a new stream), not run; the
        result's launch(stream=...) replays it. The benchmark times kernels this way."""

    def param_grad_pass(self, start=None) -> ContextManager[None]:
        """A context for one backward pass (model.backward wraps its kernels in it). Inside it a
        backend may hold back part of the parameter-gradient additions of k_layernorm_bwd,
        k_attn_qkv_bwd, k_attn_out_bwd and k_mlp_bwd (CUDA: the final column sums of the bias and
        layer-norm weight gradients) and do them when the pass closes, so the parameter gradients
        are complete only after the with block; activation gradients are written at once as
        always. The result is the same to the last bit as without the pass, and outside one
        every kernel finishes its own gradients. CUDA defers up to what reserve_workspace's
        n_layer made room for (the rest runs at once); the NumPy backend defers nothing. Passes
        nest (the outermost one finishes); inside a captured graph the pass must close inside
        the capture too. An exception leaving the block drops what was held back.
        start: the flat float32 parameter-gradient buffer this pass starts (the first microbatch of
        a step): its contents before the pass count as zero, so after the pass it holds exactly
        this pass's gradients. CUDA writes each part's first contribution instead of adding it
        (and zeroes what no kernel wrote); the NumPy backend zeroes the buffer when the pass opens."""

    # ------------------------------------------------------------ embedding
    def k_embed_fwd(self, out, tokens, wte, wpe) -> None:
        """out (B,T,C) = wte[tokens] + wpe[:T]; tokens (B,T) int32."""

    def k_embed_bwd(self, dwte, dwpe, dout, tokens) -> None:
        """dwte[tokens] += dout; dwpe[:T] += dout summed over the batch (float32 grads)."""

    # ------------------------------------------------------------ layer norm
    def k_layernorm_fwd(self, out, mean, rstd, inp, weight, bias, amax=None) -> None:
        """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T) float32.
        amax: None, or a float32 array whose [0] receives max |out| as k_fp8_amax computes it."""

    def k_residual_layernorm_fwd(self, res, out, mean, rstd, a, b, weight, bias, amax=None) -> None:
        """res = a + b (the residual stream, saved), then out = layer norm of res, with mean and
        rstd, in one pass; amax as k_layernorm_fwd's (of out)."""

    def k_layernorm_bwd(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True) -> None:
        """Adds into dinp (B,T,C), dweight (C,), dbias (C,); accumulate=False writes dinp."""

    # ------------------------------------------------------------ linear layers
    def k_attn_qkv_fwd(self, qkv, inp, w, b) -> None:
        """qkv (B,T,3C) = inp (B,T,C) @ w (3C,C).T + b (3C,)."""

    def k_attn_qkv_bwd(self, dinp, dw, db, dqkv, inp, w, accumulate=True) -> None:
        """Adds into dinp (B,T,C), dw (3C,C), db (3C,); accumulate=False writes dinp."""

    # ------------------------------------------------------------ attention
    def k_attn_fwd(self, out, lse, qkv, n_head) -> None:
        """out (B,T,C) = causal softmax(q k^T / sqrt(hs)) v; lse (B,NH,T) float32."""

    def k_attn_bwd(self, dqkv, dout, qkv, out, lse, n_head, accumulate=True) -> None:
        """Adds into dqkv (B,T,3C); accumulate=False writes it."""

    def k_attn_decode_fwd(self, out, kcache, vcache, qkv, pos, n_head) -> None:
        """Inference: write the new position's k, v (qkv (B,1,3C)) into row pos of kcache,
        vcache (B,context,C); out (B,1,C) = its attention over rows 0..pos."""

    # batched decoding (andrea/use/batch.py): N slots, lengths (N,) int32 on the device, so that
    # one captured graph serves every position
    def k_decode_embed_fwd(self, out, tokens, lengths, wte, wpe) -> None:
        """Inference: out (N,1,C) = wte[tokens[n]] + wpe[lengths[n]]; tokens, lengths (N,) int32."""

    def k_attn_decode_batch_fwd(self, out, kcache, vcache, qkv, lengths, n_head) -> None:
        """Inference: k_attn_decode_fwd of each slot n at its own position lengths[n]."""

    def k_attn_shared_fwd(self, out, qkv, saved, pre, plen, first, n_head, max_keys) -> None:
        """Inference (andrea/tasks/shared.py): row r of qkv (R,1,3C) attends to the plen[r] keys and
        values of saved (M,3C) from row pre[r] on (its item's shared context), then to its own
        option's rows first[r]..r of qkv; out (R,1,C). pre, plen, first (R,) int32 on the device;
        max_keys >= every row's plen[r] + r - first[r] + 1."""

    def k_decode_cache_fill(self, kcache, vcache, qkv, slot, n) -> None:
        """Inference: kcache, vcache (L,N,ctx,C)[:, slot, :n] = the k and v thirds of the
        prefill's qkv (L,1,T,3C)[:, 0, :n]."""

    def k_decode_linear_fwd(self, out, inp, w, b, gelu) -> None:
        """Inference: out (N,1,OC) = inp (N,1,IC) @ w.T + b (then GELU where gelu), each row on its
        own; CUDA takes N <= DECODE_GEMV_ROWS."""

    def k_decode_ln_linear_fwd(self, out, res, a, b, ln_w, ln_b, w, bias, gelu) -> None:
        """Inference: res = a + b and its layer norm (b None: of a, res not written), then
        k_decode_linear_fwd of it into out (N,1,OC), in one launch on CUDA (N <= DECODE_GEMV_ROWS)."""

    def k_decode_logits_fwd(self, logits, inp, wte) -> None:
        """Inference: logits (N,V) float32 = inp (N,1,C) @ wte (V,C).T, each row on its own."""

    def k_sample_fwd(self, tokens, lengths, logits, temperature, top_k, top_p, seeds, live, context) -> None:
        """Inference: per live slot (live[n] != 0) the token at position lengths[n] + 1 drawn from
        logits[n] (greedy at temperature 0, else top_k / top_p and a Gumbel-max draw keyed by
        (seeds[n], position): ref.sample_row) into tokens[n]; lengths[n] = min(that position,
        context - 1); a free slot gets token 0 at row 0."""

    def k_attn_out_fwd(self, out, inp, w, b) -> None:
        """out (B,T,C) = inp (B,T,C) @ w (C,C).T + b."""

    def k_attn_out_bwd(self, dinp, dw, db, dout, inp, w, accumulate=True) -> None:
        """Adds into dinp (B,T,C), dw (C,C), db (C,); accumulate=False writes dinp."""

    # ------------------------------------------------------------ MLP
    def k_mlp_fwd(self, out, pre, act, inp, w1, b1, w2, b2) -> None:
        """out (B,T,C) = gelu_tanh(inp @ w1.T + b1) @ w2.T + b2; saves pre (B,T,4C); act is
        workspace."""

    def k_mlp_bwd(self, dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, accumulate=True) -> None:
        """Adds into dinp, dw1 (4C,C), db1, dw2 (C,4C), db2 (accumulate=False writes dinp); act,
        dact (B,T,4C) are workspace."""

    # ------------------------------------------------------------ residual
    def k_residual_add(self, out, a, b) -> None:
        """out = a + b."""

    def k_residual_add_bwd(self, da, db, dout) -> None:
        """da += dout; db += dout."""

    # ------------------------------------------------------------ loss
    def k_loss_fwd(self, losses, lse, logits, inp, wte, targets) -> None:
        """Writes losses, lse (B,T); logits (R,V) is workspace: the rows of inp @ wte.T, R at a
        time."""

    def k_loss_bwd(self, losses, lse, dinp, dwte, logits, inp, wte, targets, dloss, accumulate=True) -> None:
        """The fused classifier: per chunk of R rows the logits, losses, lse and dlogits, then
        dinp (B,T,C) += dlogits @ wte (accumulate=False: =) and dwte (V,C) += dlogits.T @ inp.
        dloss: a float, or a (1,) float32 array read when the kernel runs."""

    # ------------------------------------------------------------ clipping, optimizer, cast
    def k_grad_norm_partial(self, partials, grads) -> None:
        """partials[i] = sum of squares of the i-th of len(partials) equal chunks of grads."""

    def k_grad_norm_final(self, state, partials) -> None:
        """Global-norm clipping: k_grad_norm_partial, k_grad_norm_final, k_grad_scale; the
        engine's fused step (k_step_check, k_adamw_step) computes the same values.
        state[S_NORM] = sqrt(sum of partials), added in order in float64 as k_step_check adds
        them, rounded to partials' dtype; nothing else written."""

    def k_grad_scale(self, grads, state, max_norm) -> None:
        """grads *= min(1, max_norm / (state[S_NORM] + 1e-6)) (float64, rounded to grads'
        dtype; max_norm <= 0: 1), in place: the clip factor of k_step_check and k_adamw_step at
        a pre-scale of 1; a non-finite norm leaves grads unchanged."""

    def k_loss_accum(self, state, losses) -> None:
        """state[S_LOSS_SUM] += sum of losses, in float64 (state: STATE_SLOTS above)."""

    def k_step_check(self, state, dloss, partials, n_micro, n_pos, beta1, beta2, weight_decay, max_norm,
                     fp16, growth_interval, max_scale) -> None:
        """The end of a step in float64 on the device: the gradient norm, the non-finite policy,
        the loss scale and the clip factor, into state and dloss."""

    def k_adamw_step(self, params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay,
                     zero_grads: bool = True) -> None:
        """Unless the step is skipped: clip + AdamW in place (decoupled decay on
        params[:n_decay]) + the cast into params_c; grads zeroed (unless zero_grads is False)."""

    def k_cast_params(self, dst, src) -> None:
        """dst (compute dtype) = src (float32 master weights), rounded to nearest."""


@runtime_checkable
class Fp8Backend(Backend, Protocol):
    """A backend whose precisions include "fp8" (CUDA) has these too; the engine calls them only
    for a train.precision=fp8 run, the class-level ones (fp8_arena_rows, fp8_classifier_fits) on
    the class, without a device, when it sizes a plan. A backend without fp8 (NumPy) has none."""

    @staticmethod
    def fp8_arena_rows(cached_shapes, slot_shapes, n_rows: int, n_delayed: int) -> List[Tuple[str, tuple, str, str]]:
        """(name, shape, dtype, group) of the engine's arena rows of the FP8 path: the weight cache
        of weights of cached_shapes, the input slots of the products of weights of slot_shapes over
        n_rows rows, n_delayed delayed scales."""

    @staticmethod
    def fp8_classifier_fits(N: int, V: int, R: int) -> bool:
        """Whether the classifier's products can run in FP8 for N rows, V classes and chunks of R rows."""

    @staticmethod
    def fp8_history_rows(history) -> int:
        """The delayed scales a checkpoint's fp8_amax_history holds (ValueError naming the field
        where it is not an amax history)."""

    def set_fp8_run(self, **settings) -> None:
        """The run's FP8 settings (train.fp8_classifier, fp8_dlogits, fp8_dlogits_rounding,
        fp8_scaling; None leaves one as it is), before an engine reads them."""

    def fp8_run(self) -> dict:
        """The FP8 settings an engine made now takes, by those names."""

    def use_fp8_weight_cache(self, weights: List[Any], data, meta, table, alone: int = 0) -> None:
        """After reserve_workspace(fp8=True): keep FP8 copies of the
        linear weights `weights` (the (out, in) compute-dtype arrays the layers will be given) in
        the engine's buffers data (uint8), meta (float32) and table (int64), the rows the memory
        plan took for them; fill them now. From then on the products of those weights read the
        copies, so they must be rewritten by refresh_fp8_weight_cache whenever the weights change.
        alone: how many of the first weights (the classifier's embedding) are refreshed on their
        own rather than with the rest in one launch (the same bytes)."""

    def use_fp8_input_slots(self, weights: List[Any], inputs: List[Any], meta, xt=None,
                            producer_amax: bool = False) -> None:
        """After reserve_workspace(fp8=True): slots for the inputs of the products of weights,
        inputs being the saved activations those products read (each alive from the forward
        product to its backward): their (amax, 1/scale) in meta (float32) and, where xt (uint8)
        is given, the FP8 X^T each forward product writes and its backward reads instead of
        quantising X again; producer_amax: the layer-norm forward kernels writing an input reduce
        its amax. The rows the memory plan took for them; the same bits as without them."""

    def use_fp8_delayed_scales(self, tensors: List[Any], block) -> Any:
        """After reserve_workspace(fp8=True) and use_fp8_input_slots, with fp8_scaling "delayed":
        the tensors, (role, weight) pairs ("act": the MLP's act, input of the weight's product;
        "x": the input of the weight's product, in its input slot; "dy": the output gradient of
        the weight's product), scale from the largest amax of the last steps, kept in block
        (float32, a row each, the rows the memory plan took). Returns the handle the engine drives
        them with: load(history or None), history(), roll(optimizer state) at the end of each
        optimizer step (captured with it), recording() around a training step's passes, and live
        (a history is held; else each pass takes its amax first)."""

    def refresh_fp8_weight_cache(self) -> None:
        """Rewrite the FP8 copies of the weights (use_fp8_weight_cache) from the weights as they
        are now, exactly as each product would quantise them; nothing where none are kept. Inside
        a captured graph it is captured too."""

    # ------------------------------------------------------------ the FP8 forms of the kernels
    # (the reference's functions of the same names in ref/: the FP8 linear layers' products on
    # E4M3 operands, and the kernels that write their outputs as FP8 operands themselves)
    def k_layernorm_fwd_fp8(self, out, out_t, res, mean, rstd, a, b, weight, bias, meta, amax_out) -> None:
        """The layer norm of a (or of res = a + b) written as E4M3 bytes out (N, C) and out_t (C, N)."""

    def k_attn_fwd_fp8(self, out, lse, q, q_t, meta, amax_out, qkv, n_head) -> None:
        """k_attn_fwd, and out as E4M3 bytes q (B*T, C) and q_t (C, B*T)."""

    def k_attn_bwd_fp8(self, q, q_t, partial, meta, amax_out, dout, qkv, out, lse, n_head, fmt) -> None:
        """k_attn_bwd's dqkv (accumulate=False) written only as FP8 bytes q, q_t, with its column partials."""

    def k_fp8_linear_fwd(self, out, inp, w, b) -> None:
        """out = fp8(inp) @ fp8(w).T + b."""

    def k_fp8_linear_bwd(self, dinp, dw, db, dout, inp, w, grad_fmt=None, accumulate=True) -> None:
        """The linear layer's backward with FP8 operands (dout in grad_fmt)."""

    def k_fp8_mlp_fwd(self, out, pre, act, inp, w1, b1, w2, b2) -> None:
        """k_mlp_fwd with FP8 products; act is not written."""

    def k_fp8_mlp_bwd(self, dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, grad_fmt=None,
                      accumulate=True) -> None:
        """k_mlp_bwd with FP8 products."""

    def k_fp8_loss_fwd(self, losses, lse, logits, inp, wte, targets) -> None:
        """k_loss_fwd with the logits product in FP8."""

    def k_fp8_loss_bwd(self, losses, lse, dinp, dwte, logits, inp, wte, targets, dloss, dlogits_fmt=None,
                       accumulate=True, fp8_logits=True, rounding=None) -> None:
        """k_loss_bwd with FP8 products and dlogits written in FP8 (dlogits_fmt, rounding)."""

    def k_adamw_step_amax(self, args, zero_grads=True) -> None:
        """k_adamw_step into the compute copy that also takes the FP8 weight cache's amax (args:
        k_adamw_step's arguments as the launcher packs them; k_adamw_step calls it where it fits)."""
