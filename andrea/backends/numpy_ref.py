"""NumPy reference kernels: the judge of every CUDA kernel, and the CPU engine.

Each function here has a CUDA twin of the same name (andrea/backends/cuda/ops.py launching
kernels/<op>.cu), in the same order, with the same arguments; NumpyBackend (numpy_backend.py)
serves them through the backend interface (interface.py). Conventions shared by both backends:
- Shapes: B batch, T sequence, C d_model, NH heads, hs = C // NH, V vocab. Linear weights are
  (out_features, in_features) and a linear layer computes `inp @ w.T + b`, as torch.nn.Linear does.
- Forward kernels WRITE their outputs. Backward kernels ADD (`+=`) into every gradient buffer they
  are given, parameter and activation gradients alike, except that a backward kernel with an
  `accumulate` keyword (k_layernorm_bwd, k_attn_qkv_bwd, k_attn_bwd, k_attn_out_bwd, k_mlp_bwd,
  k_loss_bwd and their FP8 forms) WRITES its activation gradient, the first gradient argument
  (dinp or dqkv), when called with accumulate=False: whatever the buffer held (NaN included) is
  not read. model.backward passes it to the first writer of each activation-gradient buffer, so
  no buffer is zeroed in the backward pass; parameter gradients always add (microbatches).
- Dtype follows the arrays: float32 in training, float64 in the gradient checks.
NumPy creates temporaries inside these functions; the engine's own buffers are all preallocated
(see engine.Arena). Every reduction runs in a fixed order, so results are bit-reproducible.
"""
from __future__ import annotations

import math

import numpy as np

GELU_K = math.sqrt(2.0 / math.pi)  # gelu_tanh constant, as in GPT-2
LN_EPS = 1e-5  # torch.nn.LayerNorm's default


# ---------------------------------------------------------------- embedding
def k_embed_fwd(out, tokens, wte, wpe):
    """out (B,T,C) = wte[tokens] + wpe[:T]; tokens (B,T) int32, wte (V,C), wpe (context,C)."""
    T = tokens.shape[1]
    np.add(wte[tokens], wpe[:T][None], out=out)


def k_embed_bwd(dwte, dwpe, dout, tokens):
    """dwte[tokens] += dout, dwpe[:T] += sum over batch of dout (np.add.at: fixed order)."""
    B, T = tokens.shape
    np.add.at(dwte, tokens.reshape(-1), dout.reshape(B * T, -1))
    dwpe[:T] += dout.sum(axis=0)


# ---------------------------------------------------------------- layer norm
def k_layernorm_fwd(out, mean, rstd, inp, weight, bias, amax=None):
    """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T). amax: None, or
    a float32 array whose [0] receives max |out| as k_fp8_amax computes it (train.precision=fp8:
    the amax of the FP8 cast of out, reduced by the kernel that writes out)."""
    mean[...] = inp.mean(axis=-1)
    xc = inp - mean[..., None]
    rstd[...] = 1.0 / np.sqrt((xc * xc).mean(axis=-1) + LN_EPS)
    np.multiply(xc * rstd[..., None], weight, out=out)
    out += bias
    if amax is not None:
        k_fp8_amax(amax, out)


def _put(dst, x, accumulate):
    """dst += x, or dst = x (accumulate False: dst is not read)."""
    if accumulate:
        dst += x
    else:
        dst[...] = x


def k_layernorm_bwd(dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True):
    """Adds the layer-norm gradients into dinp (B,T,C), dweight (C,), dbias (C,); accumulate=False
    writes dinp instead."""
    C = inp.shape[-1]
    xhat = (inp - mean[..., None]) * rstd[..., None]
    dbias += dout.reshape(-1, C).sum(axis=0)
    dweight += (dout * xhat).reshape(-1, C).sum(axis=0)
    dxhat = dout * weight
    _put(dinp, rstd[..., None] * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                                  - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)), accumulate)


def k_residual_layernorm_fwd(res, out, mean, rstd, a, b, weight, bias, amax=None):
    """The residual add fused into the layer norm that follows it: res = a + b (the residual
    stream, saved), then out = layer norm of res with its mean and rstd, as k_residual_add then
    k_layernorm_fwd. Its backward needs no kernel of its own: the gradient of res passes to a and
    b unchanged, so k_layernorm_bwd adds the layer norm's part in place into the residual
    gradient (model.backward). amax: as k_layernorm_fwd's (of out)."""
    k_residual_add(res, a, b)
    k_layernorm_fwd(out, mean, rstd, res, weight, bias, amax)


# ---------------------------------------------------------------- linear layers (shared math)
def _linear_fwd(out, inp, w, b):
    np.matmul(inp, w.T, out=out)
    out += b


def _linear_bwd(dinp, dw, db, dout, inp, w, accumulate=True):
    OC, IC = w.shape
    d2 = dout.reshape(-1, OC)
    _put(dinp, dout @ w, accumulate)
    dw += d2.T @ inp.reshape(-1, IC)
    db += d2.sum(axis=0)


def k_attn_qkv_fwd(qkv, inp, w, b):
    """qkv (B,T,3C) = inp (B,T,C) @ w (3C,C).T + b (3C,); q, k, v are the three C-wide slices."""
    _linear_fwd(qkv, inp, w, b)


def k_attn_qkv_bwd(dinp, dw, db, dqkv, inp, w, accumulate=True):
    """Adds into dinp (B,T,C), dw (3C,C), db (3C,); accumulate=False writes dinp instead."""
    _linear_bwd(dinp, dw, db, dqkv, inp, w, accumulate)


# ---------------------------------------------------------------- attention
def _heads(qkv, n_head):
    """(B,T,3C) -> q, k, v each (B,NH,T,hs), views."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    x = qkv.reshape(B, T, 3, n_head, C // n_head)
    return (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def _scores(q, k):
    """Causal scaled scores (B,NH,T,T), -inf above the diagonal."""
    T, hs = q.shape[-2], q.shape[-1]
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))
    s[..., np.triu(np.ones((T, T), dtype=bool), 1)] = -np.inf
    return s


def k_attn_fwd(out, lse, qkv, n_head):
    """Causal softmax(q k^T / sqrt(hs)) v. out (B,T,C); lse (B,NH,T) saves the log-sum-exp of
    each score row, so the backward pass recomputes the probabilities instead of storing T x T."""
    q, k, v = _heads(qkv, n_head)
    s = _scores(q, k)
    smax = s.max(axis=-1, keepdims=True)
    lse[...] = (smax + np.log(np.exp(s - smax).sum(axis=-1, keepdims=True)))[..., 0]
    p = np.exp(s - lse[..., None])
    y = p @ v  # (B,NH,T,hs)
    B, T, C = out.shape
    out[...] = y.transpose(0, 2, 1, 3).reshape(B, T, C)


def k_attn_bwd(dqkv, dout, qkv, out, lse, n_head, accumulate=True):
    """Adds into dqkv (B,T,3C) (accumulate=False: writes it). Uses D = rowsum(dout * out) =
    rowsum(p * dp), as flash attention."""
    q, k, v = _heads(qkv, n_head)
    B, T, C = out.shape
    hs = C // n_head
    p = np.exp(_scores(q, k) - lse[..., None])
    dy = dout.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
    y = out.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
    dv = p.transpose(0, 1, 3, 2) @ dy
    dp = dy @ v.transpose(0, 1, 3, 2)
    D = (dy * y).sum(axis=-1, keepdims=True)
    ds = p * (dp - D) * (1.0 / math.sqrt(hs))
    dq = ds @ k
    dk = ds.transpose(0, 1, 3, 2) @ q
    g = dqkv.reshape(B, T, 3, n_head, hs)
    for i, d in enumerate((dq, dk, dv)):
        _put(g[:, :, i], d.transpose(0, 2, 1, 3), accumulate)


def k_attn_decode_fwd(out, kcache, vcache, qkv, pos, n_head):
    """Attention of one new position against a KV cache (inference only, no backward twin).
    qkv (B,1,3C) is the new position's projection; its k and v are written into row pos of
    kcache, vcache (B,context,C), then out (B,1,C) = softmax(q K[:pos+1]^T / sqrt(hs)) V[:pos+1],
    the row pos of k_attn_fwd on the whole sequence (same score scaling and log-sum-exp form)."""
    B, _, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    n = pos + 1
    kcache[:, pos] = qkv[:, 0, C:2 * C]
    vcache[:, pos] = qkv[:, 0, 2 * C:]
    q = qkv[:, 0, :C].reshape(B, n_head, 1, hs)
    k = kcache[:, :n].reshape(B, n, n_head, hs).transpose(0, 2, 1, 3)
    v = vcache[:, :n].reshape(B, n, n_head, hs).transpose(0, 2, 1, 3)
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))  # (B,NH,1,n)
    smax = s.max(axis=-1, keepdims=True)
    lse = smax + np.log(np.exp(s - smax).sum(axis=-1, keepdims=True))
    y = np.exp(s - lse) @ v  # (B,NH,1,hs)
    out[...] = y.transpose(0, 2, 1, 3).reshape(B, 1, C)


def k_attn_out_fwd(out, inp, w, b):
    """out (B,T,C) = inp (B,T,C) @ w (C,C).T + b: the output projection W_O."""
    _linear_fwd(out, inp, w, b)


def k_attn_out_bwd(dinp, dw, db, dout, inp, w, accumulate=True):
    """Adds into dinp (B,T,C), dw (C,C), db (C,); accumulate=False writes dinp instead."""
    _linear_bwd(dinp, dw, db, dout, inp, w, accumulate)


# ---------------------------------------------------------------- MLP
def _gelu(x, out):
    np.multiply(0.5 * x, 1.0 + np.tanh(GELU_K * (x + 0.044715 * x ** 3)), out=out)


def _gelu_grad(x):
    u = GELU_K * (x + 0.044715 * x ** 3)
    th = np.tanh(u)
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_K * (1.0 + 3 * 0.044715 * x * x)


def k_mlp_fwd(out, pre, act, inp, w1, b1, w2, b2):
    """out (B,T,C) = gelu_tanh(inp @ w1.T + b1) @ w2.T + b2. Saves pre (B,T,4C); act (B,T,4C) is
    workspace (the backward pass recomputes it from pre)."""
    _linear_fwd(pre, inp, w1, b1)
    _gelu(pre, act)
    _linear_fwd(out, act, w2, b2)


def k_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, accumulate=True):
    """Adds into dinp, dw1 (4C,C), db1, dw2 (C,4C), db2 (accumulate=False: writes dinp). act,
    dact (B,T,4C) are workspace."""
    _gelu(pre, act)
    _linear_bwd(dact, dw2, db2, dout, act, w2, accumulate=False)
    dact *= _gelu_grad(pre)
    _linear_bwd(dinp, dw1, db1, dact, inp, w1, accumulate)


# ---------------------------------------------------------------- residual
def k_residual_add(out, a, b):
    """out = a + b."""
    np.add(a, b, out=out)


def k_residual_add_bwd(da, db, dout):
    """da += dout, db += dout."""
    da += dout
    db += dout


# ---------------------------------------------------------------- loss
def _loss_rows(kernel, logits, inp, wte, targets):
    """Flat row views (N, C), (N,), and the logits workspace as (R, V): R rows per chunk."""
    V, C = wte.shape
    N = targets.size
    if logits.size % V or logits.size == 0:
        raise ValueError(f"{kernel}: logits has shape {logits.shape}; expected (R, {V}) rows of the vocab")
    return inp.reshape(N, C), targets.reshape(N), logits.reshape(-1, V), N


def _loss_chunk(z, lse, losses, targets):
    """Rows z (n, V) of logits: their log-sum-exp and cross-entropy loss."""
    m = z.max(axis=-1)
    lse[...] = m + np.log(np.exp(z - m[:, None]).sum(axis=-1))
    losses[...] = lse - z[np.arange(z.shape[0]), targets]


def k_loss_fwd(losses, lse, logits, inp, wte, targets):
    """Cross-entropy over the tied projection, for evaluation: writes losses (B,T) and lse (B,T).
    logits (R, V) is workspace of R rows (any R >= 1; the engine's holds model.loss_chunk_rows,
    fewer than B*T): the rows of inp (B,T,C) @ wte (V,C).T are made R at a time, never all at once."""
    x, tg, z_all, N = _loss_rows("k_loss_fwd", logits, inp, wte, targets)
    lf, lsef = losses.reshape(N), lse.reshape(N)
    R = z_all.shape[0]
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        z = z_all[:r1 - r0]
        np.matmul(x[r0:r1], wte.T, out=z)
        _loss_chunk(z, lsef[r0:r1], lf[r0:r1], tg[r0:r1])


def k_loss_bwd(losses, lse, dinp, dwte, logits, inp, wte, targets, dloss, accumulate=True):
    """The fused classifier: forward and backward of the loss in one pass over chunks of R rows
    (logits (R, V) is workspace, as in k_loss_fwd). Per chunk: logits = inp @ wte.T; their
    log-sum-exp and loss, written to lse and losses as k_loss_fwd does; in place
    dlogits = (softmax - onehot(target)) * dloss; then ADDS dinp += dlogits @ wte and
    dwte += dlogits.T @ inp: the gradient of dloss * sum(losses); accumulate=False writes dinp
    instead (each chunk its own rows). dloss: a float, or a (1,) array read when the kernel runs
    (the engine's, which k_step_check writes from the loss scale)."""
    x, tg, z_all, N = _loss_rows("k_loss_bwd", logits, inp, wte, targets)
    lf, lsef, dx = losses.reshape(N), lse.reshape(N), dinp.reshape(N, -1)
    R = z_all.shape[0]
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        z = z_all[:r1 - r0]
        np.matmul(x[r0:r1], wte.T, out=z)
        _loss_chunk(z, lsef[r0:r1], lf[r0:r1], tg[r0:r1])
        np.exp(z - lsef[r0:r1, None], out=z)
        z[np.arange(r1 - r0), tg[r0:r1]] -= 1.0
        z *= dloss
        _put(dx[r0:r1], z @ wte, accumulate)
        dwte += z.T @ x[r0:r1]


# ---------------------------------------------------------------- clipping and the optimizer
def k_grad_norm_partial(partials, grads):
    """partials[i] = sum of squares of the i-th of len(partials) equal chunks of grads (last short)."""
    n = grads.shape[0]
    P = partials.shape[0]
    chunk = -(-n // P)
    for i in range(P):
        g = grads[i * chunk:(i + 1) * chunk]
        partials[i] = np.dot(g, g) if g.size else 0.0


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


def k_loss_accum(state, losses):
    """state[S_LOSS_SUM] += sum of losses (one microbatch's positions), in float64."""
    state[S_LOSS_SUM] += float(losses.sum(dtype=np.float64))


def k_step_check(state, dloss, partials, n_micro, n_pos, beta1, beta2, weight_decay, max_norm,
                 fp16, growth_interval, max_scale):
    """The end of a step, on the device in the CUDA backend (one thread), in float64:
    norm = sqrt(sum of partials, in order) / (n_micro * loss scale), rounded to partials' dtype;
    loss = loss sum / n_pos / n_micro (the sum is then reset). Records both and the scale used.
    A non-finite loss or norm skips the update: skipped += 1, good streak 0, fp16 halves the scale
    (floor 1), and the bad streak grows unless it is an fp16 overflow (finite loss, scale > 1).
    Otherwise: the clip factor pre_scale * min(1, max_norm / (norm + 1e-6)) (max_norm <= 0: no
    clip), the AdamW scalars of update number t = step - skipped (decay 1 - lr*wd, step size
    lr / (1 - beta1^t), 1 / (1 - beta2^t)), all rounded to partials' dtype; bad streak 0, good
    streak + 1, and fp16 doubles the scale (at most max_scale) after growth_interval good steps.
    dloss[0] = the new scale / n_pos: the next backward pass's loss gradient."""
    rnd = partials.dtype.type
    ss = 0.0
    for x in partials:  # in order, as the CUDA thread does
        ss += float(x)
    scale = float(state[S_SCALE])
    pre_scale = 1.0 / (n_micro * scale)
    norm = float(rnd(math.sqrt(ss) * pre_scale))
    loss = float(state[S_LOSS_SUM]) / n_pos / n_micro
    state[S_LOSS_SUM] = 0.0
    state[S_LOSS], state[S_NORM], state[S_REC_SCALE] = loss, norm, scale
    if not (math.isfinite(loss) and math.isfinite(norm)):
        state[S_SKIP] = 1.0
        state[S_SKIPPED] += 1.0
        state[S_GOOD] = 0.0
        overflow = bool(fp16) and math.isfinite(loss) and scale > 1.0
        if fp16:
            scale = max(1.0, scale * 0.5)
        state[S_BAD] = 0.0 if overflow else state[S_BAD] + 1.0
    else:
        state[S_SKIP] = 0.0
        clip = 1.0
        if max_norm > 0:
            clip = min(1.0, max_norm / (norm + 1e-6))
        lr = float(state[S_LR])
        t = float(state[S_STEP]) - float(state[S_SKIPPED])
        state[S_CLIP] = rnd(pre_scale * clip)
        state[S_DECAY] = rnd(1.0 - lr * weight_decay)
        state[S_STEP_SIZE] = rnd(lr * (1.0 / (1.0 - beta1 ** t)))
        state[S_VHAT] = rnd(1.0 / (1.0 - beta2 ** t))
        state[S_BAD] = 0.0
        state[S_GOOD] += 1.0
        if fp16 and state[S_GOOD] >= growth_interval:
            scale = min(max_scale, scale * 2.0)
            state[S_GOOD] = 0.0
    state[S_SCALE] = scale
    dloss[0] = scale / n_pos


def k_adamw_step(params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay, zero_grads=True):
    """One pass over the flat buffers after k_step_check: unless the step is skipped,
    g = grads * clip, then AdamW in place (m, v; decoupled decay on params[:n_decay], the matrices;
    bias-corrected step), then params_c = params in the compute dtype (params_c is params, or None,
    in float32 training). grads is zeroed either way, unless zero_grads is False (the engine's
    next backward pass starts the gradients itself: param_grad_pass(start=grads))."""
    if not state[S_SKIP]:
        dt = params.dtype.type
        g = grads * dt(state[S_CLIP])
        m *= beta1
        m += (1.0 - beta1) * g
        v *= beta2
        v += (1.0 - beta2) * g * g
        params[:n_decay] *= dt(state[S_DECAY])
        params -= dt(state[S_STEP_SIZE]) * m / (np.sqrt(v * dt(state[S_VHAT])) + eps)
        if params_c is not None and params_c is not params:
            params_c[...] = params
    if zero_grads:
        grads[...] = 0


def k_adamw_step_amax(params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay, segments, meta,
                      zero_grads=True):
    """k_adamw_step, then the FP8 weight cache's amax from the compute copy as the step leaves it
    (train.precision=fp8; optim.cu k_adamw_step_amax): for each segment t = (start, stop) of
    params_c (a weight's elements), meta[t, 0] = max(meta[t, 0], max |params_c[start:stop]|) as
    float32, NaN if any is NaN (k_fp8_amax_many zeroes meta first, then takes each k_fp8_amax).
    A skipped step changes no weight and still takes their amax."""
    k_adamw_step(params, params_c, grads, m, v, state, beta1, beta2, eps, n_decay, zero_grads)
    pair = np.zeros(2, np.float32)
    for t, (start, stop) in enumerate(segments):
        k_fp8_amax(pair, params_c[start:stop])
        a, b = meta[t, 0], pair[0]
        meta[t, 0] = np.nan if np.isnan(a) or np.isnan(b) else max(a, b)


def k_cast_params(dst, src):
    """dst (compute dtype) = src (float32 master weights), rounded to nearest: a flat copy."""
    dst[...] = src


GRAD_NORM_PARTIALS = 64  # length of the partials buffer k_grad_norm_partial fills (NumpyBackend)


# ---------------------------------------------------------------- FP8 (train.precision=fp8)
# The linear layers' matrix products with FP8 operands (kernels/fp8.cu, cuda/fp8.py; docs/FP8.md).
# A tensor x is quantised with one scale for the whole tensor, taken from its own amax (current
# scaling): scale = 2^k, the largest power of two with amax * scale <= the format's largest value,
# and q = fp8(x * scale), rounded to nearest even and saturated to the largest finite value. The
# product runs on q (exact in float32 accumulation terms) and is multiplied back by 1/scale of each
# operand (exact: powers of two). Each tensor's (amax, 1/scale) pair is its "meta", a float32 (2,).
FP8_FORMATS = {  # name: (mantissa bits, exponent bias, largest finite value)
    "e4m3": (3, 7, 448.0),
    "e5m2": (2, 15, 57344.0),
}
FP8_FWD = "e4m3"  # weights and activations
FP8_GRAD = "e4m3"  # output gradients (the backend's default; "e5m2" the alternative, docs/FP8.md)
FP8_DLOGITS = "e4m3"  # the classifier's dlogits (the backend's default, docs/FP8.md "The classifier")
FP8_DLOGITS_ROUNDING = "stochastic"  # how dlogits meet the grid: "stochastic" or "nearest" (the same)
FP8_ROUNDINGS = ("nearest", "stochastic")
FP8_MAX_SHIFT = 126  # |log2 scale| at most this: 2^k and 2^-k stay normal float32 numbers


def _fp8_format(fmt):
    if fmt not in FP8_FORMATS:
        raise ValueError(f"FP8 format {fmt!r}: expected one of {', '.join(FP8_FORMATS)}")
    return FP8_FORMATS[fmt]


def fp8_scale(amax, fmt):
    """(scale, 1/scale) as float32 for a tensor of this amax: scale = 2^k with k the largest
    integer such that amax * 2^k <= the format's largest value (|k| <= FP8_MAX_SHIFT); 1 for an
    all-zero tensor; NaN for a non-finite amax (the step then becomes non-finite and is skipped).
    Read from the float32 bits of amax, as the CUDA kernels do."""
    M, bias, top = _fp8_format(fmt)
    top_exp = int(np.floor(np.log2(top)))  # 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15
    u = int(np.asarray(amax, dtype=np.float32).view(np.uint32)) & 0x7FFFFFFF
    if u >= 0x7F800000:
        return np.float32(np.nan), np.float32(np.nan)
    if u == 0:
        return np.float32(1.0), np.float32(1.0)
    e = (u >> 23) - 127  # amax = 1.m * 2^e (a subnormal amax clamps below anyway)
    k = top_exp - e - (1 if (u & 0x7FFFFF) > 0x600000 else 0)  # mantissa above 1.75: one less
    k = max(-FP8_MAX_SHIFT, min(FP8_MAX_SHIFT, k))
    return np.float32(2.0 ** k), np.float32(2.0 ** -k)


def fp8_round(y, fmt):
    """float32 values of fp8(y): round to nearest even on the format's grid (normal and
    subnormal), saturated to +-largest finite value (infinities too); NaN stays NaN."""
    M, bias, top = _fp8_format(fmt)
    y = np.asarray(y, dtype=np.float32)
    a = np.abs(y).astype(np.float64)
    emin = 1 - bias
    with np.errstate(divide="ignore", invalid="ignore"):
        _, E = np.frexp(a)  # a = f * 2^E, f in [0.5, 1)
    e = np.maximum(E.astype(np.int64) - 1, emin)  # subnormals share the quantum of the smallest binade
    quantum = np.ldexp(1.0, e - M)
    with np.errstate(invalid="ignore"):
        q = np.minimum(np.rint(a / quantum) * quantum, top)  # np.rint: half to even
    q = np.where(np.isnan(a), np.nan, q)
    return np.copysign(q, y).astype(np.float32)


def fp8_round_stochastic(y, u, fmt):
    """float32 values of y rounded stochastically onto the format's grid, as fp8.cuh's
    fp8_round_stochastic does it on the float's bits (u: 16 random bits an element, same shape).
    With drop = 23 - M mantissa bits the format drops and r = u << (drop - 16):
    |y| >= 2^emin: (bits(|y|) + r) with the dropped bits cleared, i.e. the grid value above for
    floor(frac * 2^16) of the 2^16 values of u; below: the same on s = float32(|y| + 2^emin), then
    s - 2^emin (the subnormals' fixed quantum). Sign kept; beyond the largest value not clamped
    (fp8_round after it saturates); infinities and NaN pass."""
    M, bias, top = _fp8_format(fmt)
    y = np.asarray(y, dtype=np.float32)
    drop = 23 - M
    keep = np.uint32((~((1 << drop) - 1)) & 0xFFFFFFFF)
    r = ((np.asarray(u).astype(np.uint64) & 0xFFFF) << np.uint64(drop - 16)).astype(np.uint32)
    lo = np.float32(2.0 ** (1 - bias))
    bits = y.view(np.uint32)
    a = bits & np.uint32(0x7FFFFFFF)
    with np.errstate(over="ignore", invalid="ignore"):
        s = (a.view(np.float32) + lo).astype(np.float32)
        sub = (((s.view(np.uint32) + r) & keep).view(np.float32) - lo).astype(np.float32)
        out = np.where(a >= np.uint32((127 + 1 - bias) << 23), (a + r) & keep, sub.view(np.uint32))
    out = (out.astype(np.uint32) | (bits & np.uint32(0x80000000))).view(np.float32)
    return np.where(a >= np.uint32(0x7F800000), y, out).astype(np.float32)


def _sr_mix(x):
    """murmur3's 32-bit finaliser on uint32 arrays (loss.cu sr_mix)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def fp8_sr_bits(logits, row0=0):
    """The 16 random bits of each element of logits (R, V) for the classifier's stochastic rounding
    (loss.cu sr_key / sr_round): rows cut into 16-byte groups of the logits as they lie in memory
    (past V, zero bits); key = w0 * 0x9e3779b1 + w1 * 0x85ebca77 + w2 * 0xc2b2ae3d + w3 * 0x27d4eb2f
    + row * 0x165667b1 + group (uint32; row = row0 + the row's index here, its index in the
    microbatch); element i of its group takes the low (i even) or high (i odd) half of
    _sr_mix(key + (i // 2) * 0x9e3779b9). A function of the logits' bits and positions only, so
    reruns agree, whatever the chunks, and every step draws new bits. Logits wider than 4 bytes
    (the reference's float64 workspaces) are taken as float32."""
    z = np.ascontiguousarray(logits)
    if z.dtype.itemsize > 4:
        z = z.astype(np.float32)
    R, V = z.shape
    per = 16 // z.dtype.itemsize  # elements in a group
    G = -(-V // per)
    raw = np.zeros((R, G * per), dtype=np.uint16 if z.dtype.itemsize == 2 else np.uint32)
    raw[:, :V] = z.view(raw.dtype)
    w = raw.reshape(R, G * per).view(np.uint32).reshape(R, G, 4)  # the little-endian words
    with np.errstate(over="ignore"):
        key = (w[..., 0] * np.uint32(0x9E3779B1) + w[..., 1] * np.uint32(0x85EBCA77)
               + w[..., 2] * np.uint32(0xC2B2AE3D) + w[..., 3] * np.uint32(0x27D4EB2F)
               + (np.arange(R, dtype=np.uint64) + row0).astype(np.uint32)[:, None] * np.uint32(0x165667B1)
               + np.arange(G, dtype=np.uint32)[None, :])
        i = np.arange(per, dtype=np.uint32)
        word = _sr_mix(key[..., None] + (i // np.uint32(2)) * np.uint32(0x9E3779B9))
    u = np.where(i % 2 == 1, word >> np.uint32(16), word & np.uint32(0xFFFF))
    return u.reshape(R, G * per)[:, :V]


def fp8_encode(v, fmt):
    """The fp8 bytes (uint8) of values already on the grid (fp8_round's output). NaN is 0x7F."""
    M, bias, top = _fp8_format(fmt)
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v).astype(np.float64)
    sign = np.signbit(v).astype(np.uint8) << 7
    emin = 1 - bias
    with np.errstate(divide="ignore", invalid="ignore"):
        _, E = np.frexp(a)
    normal = a >= 2.0 ** emin
    e = np.where(normal, E.astype(np.int64) - 1, emin)
    mant = np.where(normal, a / np.ldexp(1.0, e) - 1.0, a / np.ldexp(1.0, emin)) * (1 << M)
    mant = np.nan_to_num(mant)
    field = np.where(normal, e + bias, 0)
    bits = (field.astype(np.int64) << M) | np.rint(mant).astype(np.int64)
    bits = np.where(np.isnan(a), 0x7F, bits).astype(np.uint8)
    return np.where(np.isnan(a), bits, bits | sign).astype(np.uint8)


def fp8_decode(bits, fmt):
    """float32 values of fp8 bytes (NaN encodings to NaN; E5M2's infinities to inf)."""
    M, bias, top = _fp8_format(fmt)
    b = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    field, mant = (b >> M) & ((1 << (7 - M)) - 1), b & ((1 << M) - 1)
    emin = 1 - bias
    mag = np.where(field == 0, np.ldexp(mant.astype(np.float64), emin - M),
                   np.ldexp(1.0 + mant / (1 << M), field - bias))
    top_field = (1 << (7 - M)) - 1
    if fmt == "e4m3":  # E4M3 ("fn"): no infinities, S.1111.111 is NaN
        mag = np.where((field == top_field) & (mant == (1 << M) - 1), np.nan, mag)
    else:  # E5M2: IEEE-like, the top exponent holds inf and NaN
        mag = np.where(field == top_field, np.where(mant == 0, np.inf, np.nan), mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


def k_fp8_amax(meta, x):
    """meta[0] = max |x| over the whole tensor (float32; NaN if any element is NaN)."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    meta[0] = np.nan if np.isnan(a).any() else (a.max() if a.size else 0.0)


def _fp8_quantise(meta, x, fmt):
    scale, inv = fp8_scale(meta[0], fmt)
    meta[1] = inv
    return fp8_encode(fp8_round(np.asarray(x, dtype=np.float32) * scale, fmt), fmt)


def k_fp8_cast(out, meta, x, fmt):
    """out (uint8, x's shape) = fp8 bytes of x * scale, scale from meta[0] (k_fp8_amax);
    meta[1] = 1/scale, what the product multiplies back."""
    out[...] = _fp8_quantise(meta, x, fmt)


def k_fp8_cast_transpose(out, out_t, meta, x, fmt):
    """As k_fp8_cast for x (R, K), writing out (R, K) and/or out_t (K, R), its transpose (either
    may be None): the backward pass's operands must be contiguous along the summed axis."""
    q = _fp8_quantise(meta, x, fmt)
    if out is not None:
        out[...] = q
    if out_t is not None:
        out_t[...] = q.T


def fp8_tile_colsum(x, tile_rows=64):
    """The column sums of x (R, K) over each tile of tile_rows rows, (ceil(R / tile_rows), K)
    float32, in k_fp8_cast_transpose_colsum's order (fp8.cu fp8_tile_colsum_warps): row 32h + 4w + l
    of a tile (h < tile_rows / 32, warp w < 8, l < 4) goes to a_wl = x_0 + x_1 + ... over h, then
    s_w = (a_w0 + a_w1) + (a_w2 + a_w3), then s_0 + s_1 + ... + s_7. Rows past R add zeros."""
    x = np.asarray(x, dtype=np.float32)
    R, K = x.shape
    if tile_rows % 32:
        raise ValueError(f"fp8_tile_colsum: tile_rows = {tile_rows}; expected a multiple of 32")
    n = -(-R // tile_rows)
    xp = np.zeros((n * tile_rows, K), np.float32)
    xp[:R] = x
    t = xp.reshape(n, tile_rows // 32, 8, 4, K)  # (tile, h, w, l, K): row = 32h + 4w + l
    a = np.zeros((n, 8, 4, K), np.float32)
    for h in range(tile_rows // 32):
        a = a + t[:, h]
    s = (a[:, :, 0] + a[:, :, 1]) + (a[:, :, 2] + a[:, :, 3])
    out = s[:, 0]
    for w in range(1, 8):
        out = out + s[:, w]
    return out


def k_fp8_cast_transpose_colsum(out, out_t, meta, x, fmt, partial, tile_rows=64):
    """k_fp8_cast_transpose of x (R, K), and partial (ceil(R / tile_rows), K) float32 = the column
    sums of x over each tile of tile_rows rows (fp8_tile_colsum's order): a bias gradient's first
    pass, made by the cast of its dY."""
    k_fp8_cast_transpose(out, out_t, meta, x, fmt)
    partial[...] = fp8_tile_colsum(x, tile_rows).reshape(np.shape(partial))


def k_fp8_amax_many(meta, xs):
    """Many tensors at once (the FP8 copies of the weights, cuda/fp8.py): meta (n, 2m) float32 =
    0, then meta[t, 0] = max |xs[t]| (k_fp8_amax of each)."""
    meta[...] = 0
    for t, x in enumerate(xs):
        k_fp8_amax(meta[t], x)


def k_fp8_cast_transpose_many(outs, outs_t, meta, xs, fmt):
    """k_fp8_cast_transpose of each xs[t] (R, K) into outs[t] and/or outs_t[t] (an entry None
    skips it), scale from meta[t, 0], 1/scale into meta[t, m] (meta (n, 2m))."""
    m = meta.shape[1] // 2
    for t, x in enumerate(xs):
        pair = np.array([meta[t, 0], 0.0], dtype=np.float32)
        k_fp8_cast_transpose(outs[t], outs_t[t], pair, x, fmt)
        meta[t, m] = pair[1]


def _act(pre):
    """act = gelu(pre) rounded to pre's dtype, as k_mlp_bwd_gelu writes it."""
    a = np.empty(np.shape(pre), np.float64)
    _gelu(np.asarray(pre, np.float64), a)
    return a.astype(np.asarray(pre).dtype)


def k_fp8_gelu_amax(meta, pre):
    """meta[0] = max |act| (k_fp8_amax of act), act = gelu(pre) in pre's dtype: the FP8 MLP's
    amax of its second product's input, taken from pre without act being stored."""
    k_fp8_amax(meta, _act(pre))


def k_fp8_gelu_cast_transpose(out, out_t, meta, pre, fmt):
    """k_fp8_cast_transpose of act = gelu(pre) in pre's dtype (scale from meta[0]:
    k_fp8_gelu_amax), without act being stored."""
    k_fp8_cast_transpose(out, out_t, meta, _act(pre), fmt)


def k_fp8_dgelu_colsum_amax(db, meta, dact, pre):
    """The FP8 MLP's pass over dact (N.., H) after its product: dact *= gelu'(pre) (in dact's
    dtype), db (H,) += the column sums of the new dact, meta[0] = max |new dact| (k_fp8_amax)."""
    dact[...] = _dgelu(dact, pre)
    db += np.asarray(dact, np.float64).reshape(-1, np.shape(dact)[-1]).sum(axis=0)
    k_fp8_amax(meta, dact)


# Delayed scaling (cuda/fp8.py, docs/FP8.md): a tensor's scale comes from the largest amax of the
# last FP8_HIST optimizer steps (a row of the engine's "fp8_delayed" block: [0] that amax, [1] the
# amax of the step under way, [2, 2 + FP8_HIST) the history, newest first), and the kernel that
# makes the tensor casts it and reduces its amax into [1].
FP8_HIST = 16


def _amax_into(amax_out, x):
    """amax_out[0] = max(amax_out[0], max |x|) (as the kernels' atomicMax on the float bits; NaN wins)."""
    if amax_out is None:
        return
    m = np.zeros(1, np.float32)
    k_fp8_amax(m, x)
    a = np.array([amax_out[0], m[0]], np.float32)
    amax_out[0] = np.nan if np.isnan(a).any() else a.max()


def k_fp8_cast_transpose_amax(out, out_t, meta, x, fmt, amax_out):
    """k_fp8_cast_transpose, and amax_out[0] = max(amax_out[0], max |x|) (None: not taken)."""
    k_fp8_cast_transpose(out, out_t, meta, x, fmt)
    _amax_into(amax_out, x)


def k_layernorm_fwd_fp8(out, out_t, res, mean, rstd, a, b, weight, bias, meta, amax_out):
    """The layer-norm forward that writes its output as an FP8 E4M3 operand (delayed scaling):
    res, mean, rstd as k_residual_layernorm_fwd writes them (b None: k_layernorm_fwd of a, res
    not written), and the layer norm's output y (a's dtype, not kept) cast by
    k_fp8_cast_transpose_amax(out, out_t, meta, y, "e4m3", amax_out)."""
    y = np.empty_like(a)
    if b is None:
        k_layernorm_fwd(y, mean, rstd, a, weight, bias)
    else:
        k_residual_layernorm_fwd(res, y, mean, rstd, a, b, weight, bias)
    k_fp8_cast_transpose_amax(out, out_t, meta, y.reshape(-1, y.shape[-1]), "e4m3", amax_out)


def k_attn_fwd_fp8(out, lse, q, q_t, meta, amax_out, qkv, n_head):
    """The attention forward that also writes its output as an FP8 E4M3 operand (delayed scaling;
    the attention projection's input): out and lse as k_attn_fwd writes them, and out (B,T,C)
    cast by k_fp8_cast_transpose_amax(q, q_t, meta, out, "e4m3", amax_out)."""
    k_attn_fwd(out, lse, qkv, n_head)
    k_fp8_cast_transpose_amax(q, q_t, meta, out.reshape(-1, out.shape[-1]), "e4m3", amax_out)


def k_attn_bwd_fp8(q, q_t, partial, meta, amax_out, dout, qkv, out, lse, n_head, fmt):
    """The attention backward that writes dqkv only as the QKV product's FP8 output gradient:
    dqkv (qkv's shape and dtype, not kept) as k_attn_bwd writes it (accumulate=False), cast by
    k_fp8_cast_transpose_colsum_amax(q, q_t, meta, dqkv, fmt, partial, amax_out) with tiles of 64
    rows (partial None: no column sums)."""
    dqkv = np.empty_like(qkv)
    k_attn_bwd(dqkv, dout, qkv, out, lse, n_head, accumulate=False)
    d2 = dqkv.reshape(-1, dqkv.shape[-1])
    if partial is None:
        k_fp8_cast_transpose_amax(q, q_t, meta, d2, fmt, amax_out)
    else:
        k_fp8_cast_transpose_colsum_amax(q, q_t, meta, d2, fmt, partial, amax_out, tile_rows=64)


def k_fp8_cast_transpose_colsum_amax(out, out_t, meta, x, fmt, partial, amax_out, tile_rows=64):
    """k_fp8_cast_transpose_colsum, and amax_out[0] = max(amax_out[0], max |x|) (None: not taken)."""
    k_fp8_cast_transpose_colsum(out, out_t, meta, x, fmt, partial, tile_rows)
    _amax_into(amax_out, x)


def k_fp8_gelu_cast_transpose_amax(out, out_t, meta, pre, fmt, amax_out):
    """k_fp8_gelu_cast_transpose, and amax_out[0] = max(amax_out[0], max |act|) (None: not taken)."""
    act = _act(pre)
    k_fp8_cast_transpose(out, out_t, meta, act, fmt)
    _amax_into(amax_out, act.astype(np.float32))


def _dgelu(dact, pre):
    """dact * gelu'(pre), rounded to dact's dtype (k_fp8_dgelu_colsum_amax's new dact)."""
    d = np.asarray(dact, np.float64) * _gelu_grad(np.asarray(pre, np.float64))
    return d.astype(np.asarray(dact).dtype)


def k_fp8_dgelu_cast_transpose_colsum_amax(out, out_t, meta, dact, pre, fmt, partial, amax_out, tile_rows=64):
    """The FP8 MLP backward's pass with a delayed scale: d = dact * gelu'(pre) in dact's dtype, cast
    as k_fp8_cast_transpose_colsum casts it (scale from meta[0]; partial the tiles' column sums of
    d, None: not written) and amax_out[0] = max(amax_out[0], max |d|) (None: not taken). dact is
    not written."""
    d = _dgelu(dact, pre).astype(np.float32)
    k_fp8_cast_transpose(out, out_t, meta, d, fmt)
    if partial is not None:
        partial[...] = fp8_tile_colsum(d, tile_rows).reshape(np.shape(partial))
    _amax_into(amax_out, d)


def k_fp8_delayed_roll(rows, skipped):
    """The delayed scales' rows (n, >= 2 + FP8_HIST) float32 at the end of an optimizer step: unless
    the step was skipped or [1] is not finite, the history (columns 2..) moves one place and [1]
    enters it at 2; then [1] = 0 and [0] = the history's largest."""
    h = rows[:, 2:2 + FP8_HIST]
    if not skipped:
        ok = np.isfinite(rows[:, 1])
        h[ok] = np.concatenate([rows[ok, 1:2], h[ok, :-1]], axis=1)
    rows[:, 0] = np.abs(h).max(axis=1)
    rows[:, 1] = 0


def fp8_fake(x, fmt):
    """x as the FP8 product sees it: fp8(x * scale) / scale with x's own scale, in float64."""
    meta = np.zeros(2, dtype=np.float32)
    k_fp8_amax(meta, x)
    q = _fp8_quantise(meta, x, fmt)
    return fp8_decode(q, fmt).astype(np.float64) * float(meta[1])


def k_fp8_linear_fwd(out, inp, w, b):
    """out (N.., OC) = fp8(inp) @ fp8(w).T + b: E4M3 operands, each with its own scale, the
    product in float64 here (float32 on tensor cores), then out's dtype."""
    OC, IC = w.shape
    y = fp8_fake(inp, FP8_FWD).reshape(-1, IC) @ fp8_fake(w, FP8_FWD).T + np.asarray(b, np.float64)
    out[...] = y.reshape(out.shape)


def k_fp8_linear_bwd(dinp, dw, db, dout, inp, w, grad_fmt, accumulate=True):
    """Adds into dinp += fp8g(dout) @ fp8(w), dw += fp8g(dout).T @ fp8(inp) and db += column sums
    of dout (not quantised); fp8g is the gradient format grad_fmt ("e4m3" or "e5m2"); accumulate=
    False writes dinp instead. The quantisation's own derivative is taken as 1 (straight-through),
    as every FP8 recipe does."""
    OC, IC = w.shape
    g = fp8_fake(dout, grad_fmt).reshape(-1, OC)
    _put(dinp, (g @ fp8_fake(w, FP8_FWD)).reshape(dinp.shape), accumulate)
    dw += g.T @ fp8_fake(inp, FP8_FWD).reshape(-1, IC)
    db += np.asarray(dout, np.float64).reshape(-1, OC).sum(axis=0)


def k_fp8_mlp_fwd(out, pre, act, inp, w1, b1, w2, b2):
    """k_mlp_fwd with both products in FP8: pre = fp8(inp) @ fp8(w1).T + b1, act = gelu(pre),
    out = fp8(act) @ fp8(w2).T + b2."""
    k_fp8_linear_fwd(pre, inp, w1, b1)
    _gelu(np.asarray(pre, np.float64), act)
    k_fp8_linear_fwd(out, act, w2, b2)


def k_fp8_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact, grad_fmt, accumulate=True):
    """k_mlp_bwd with the four products in FP8 (k_fp8_linear_bwd's rules)."""
    _gelu(np.asarray(pre, np.float64), act)
    k_fp8_linear_bwd(dact, dw2, db2, dout, act, w2, grad_fmt, accumulate=False)
    dact *= _gelu_grad(np.asarray(pre, np.float64))
    k_fp8_linear_bwd(dinp, dw1, db1, dact, inp, w1, grad_fmt, accumulate)


# The classifier in FP8 (kernels/loss.cu loss_bwd_fp8, cuda/fp8.py): logits = fp8(inp) @ fp8(wte).T,
# and dlogits = softmax - onehot(target) quantised with a scale from its bound instead of its amax:
# every |softmax - onehot| <= 1, so the scale is fp8_scale(1) (2^8 for E4M3, 2^15 for E5M2) and
# dloss moves into the products' 1/scale. No pass over dlogits for its amax.
def fp8_bound_scale(fmt):
    """(scale, 1/scale) of a tensor whose values lie in [-1, 1]: fp8_scale of an amax of 1."""
    return fp8_scale(np.float32(1.0), fmt)


def fp8_rounding(rounding):
    """rounding checked ("nearest" or "stochastic"; None: FP8_DLOGITS_ROUNDING)."""
    rounding = FP8_DLOGITS_ROUNDING if rounding is None else rounding
    if rounding not in FP8_ROUNDINGS:
        raise ValueError(f"FP8 rounding {rounding!r}: expected one of {', '.join(FP8_ROUNDINGS)}")
    return rounding


def _dloss_value(dloss):
    return float(np.asarray(dloss, dtype=np.float64).reshape(-1)[0])


def loss_bwd_fp8(losses, lse, q8, meta, logits, targets, dloss, fmt, rounding=None, row0=0):
    """The FP8 classifier's row pass over logits (R, V) (loss.cu's loss_bwd_fp8 and
    loss_bwd_fp8_regs): losses, lse (R,) as k_loss_fwd writes them; q8 (R, V) uint8 = fp8 bytes
    of (softmax(logits) - onehot(targets)) * scale, scale = fp8_bound_scale(fmt)[0], rounded to
    nearest (rounding "nearest") or stochastically with fp8_sr_bits(logits, row0) ("stochastic";
    None: FP8_DLOGITS_ROUNDING; row0 the chunk's first row in the microbatch); meta[1] = dloss / scale, what the products multiply back (dloss: a
    float or a (1,) array). logits are not changed."""
    rounding = fp8_rounding(rounding)
    z = np.asarray(logits, dtype=np.float64)
    _loss_chunk(z, lse, losses, targets)
    g = np.exp(z - np.asarray(lse, np.float64)[:, None])
    g[np.arange(z.shape[0]), targets] -= 1.0
    scale, inv = fp8_bound_scale(fmt)
    g = (g * float(scale)).astype(np.float32)
    if rounding == "stochastic":
        g = fp8_round_stochastic(g, fp8_sr_bits(logits, row0), fmt)
    q8[...] = fp8_encode(fp8_round(g, fmt), fmt)
    meta[1] = np.float32(_dloss_value(dloss) * float(inv))


def k_fp8_transpose(out_t, x):
    """out_t (K, R) = x.T of fp8 bytes x (R, K): the FP8 dlogits as the weight gradient's product
    wants them (contiguous along the rows it sums over)."""
    out_t[...] = np.asarray(x).T


def k_fp8_loss_fwd(losses, lse, logits, inp, wte, targets):
    """k_loss_fwd with the logits product in FP8: logits = fp8(inp) @ fp8(wte).T (E4M3, each
    operand with its own scale over the whole tensor), R rows at a time into the workspace logits
    (its dtype); lse and losses from them as k_loss_fwd."""
    x, tg, z_all, N = _loss_rows("k_fp8_loss_fwd", logits, inp, wte, targets)
    xf, wf = fp8_fake(x, FP8_FWD), fp8_fake(wte, FP8_FWD)
    lf, lsef = losses.reshape(N), lse.reshape(N)
    R = z_all.shape[0]
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        z = z_all[:r1 - r0]
        z[...] = xf[r0:r1] @ wf.T  # rounded to the workspace's dtype, as the GPU's bf16 logits
        _loss_chunk(np.asarray(z, np.float64), lsef[r0:r1], lf[r0:r1], tg[r0:r1])


def k_fp8_loss_bwd(losses, lse, dinp, dwte, logits, inp, wte, targets, dloss, dlogits_fmt, accumulate=True,
                   fp8_logits=True, rounding=None):
    """k_loss_bwd with its three products in FP8: per chunk logits = fp8(inp) @ fp8(wte).T (as
    k_fp8_loss_fwd), loss_bwd_fp8's row pass (dlogits in dlogits_fmt with its bound scale), then
    dinp += dlogits @ fp8(wte) and dwte += dlogits.T @ fp8(inp) with dlogits = decoded q8 times
    meta[1] (accumulate=False writes dinp). The quantisation's derivative is taken as 1.
    fp8_logits False: logits = inp @ wte.T unquantised (the bf16 product), the backward's two
    products as above. rounding: how dlogits meet the grid (loss_bwd_fp8)."""
    x, tg, z_all, N = _loss_rows("k_fp8_loss_bwd", logits, inp, wte, targets)
    xf, wf = fp8_fake(x, FP8_FWD), fp8_fake(wte, FP8_FWD)
    lf, lsef, dx = losses.reshape(N), lse.reshape(N), dinp.reshape(N, -1)
    R = z_all.shape[0]
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        z = z_all[:r1 - r0]
        z[...] = xf[r0:r1] @ wf.T if fp8_logits else np.asarray(x[r0:r1], np.float64) @ np.asarray(wte, np.float64).T
        q8, meta = np.empty(z.shape, np.uint8), np.zeros(2, np.float32)
        loss_bwd_fp8(lf[r0:r1], lsef[r0:r1], q8, meta, z, tg[r0:r1], dloss, dlogits_fmt, rounding, r0)
        g = fp8_decode(q8, dlogits_fmt).astype(np.float64) * float(meta[1])
        _put(dx[r0:r1], g @ wf, accumulate)
        dwte += g.T @ xf[r0:r1]
