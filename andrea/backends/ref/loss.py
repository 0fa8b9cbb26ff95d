"""The classifier (kernels/loss.cu): cross-entropy over the tied projection, R rows at a time, and
its FP8 form.

The ignore index: a target of IGNORE_INDEX (-1; andrea/data/chat.py, the chat loss mask) gives its
position a loss of 0 and a zero row of dlogits, so it adds nothing to the loss sum or to any
gradient; its lse is still written. The mean over the positions that count is the caller's
normalisation (dloss = 1 / their number is torch's cross_entropy(ignore_index=-1); the engine's
step does that over all its microbatches, docs/ARCHITECTURE.md "The ignore index")."""
from __future__ import annotations

import numpy as np

from ...data.chat import IGNORE_INDEX
from ..interface import FP8_FWD, fp8_rounding
from .common import _put
from .fp8 import fp8_decode, fp8_encode, fp8_fake, fp8_round, fp8_round_stochastic, fp8_scale


def _loss_rows(kernel, logits, inp, wte, targets):
    """Flat row views (N, C), (N,), and the logits workspace as (R, V): R rows per chunk."""
    V, C = wte.shape
    N = targets.size
    if logits.size % V or logits.size == 0:
        raise ValueError(f"{kernel}: logits has shape {logits.shape}; expected (R, {V}) rows of the vocab")
    return inp.reshape(N, C), targets.reshape(N), logits.reshape(-1, V), N


def _loss_chunk(z, lse, losses, targets):
    """Rows z (n, V) of logits: their log-sum-exp and cross-entropy loss (0 where the target is
    IGNORE_INDEX). Returns the rows to ignore (a bool mask), or None when every target counts."""
    m = z.max(axis=-1)
    lse[...] = m + np.log(np.exp(z - m[:, None]).sum(axis=-1))
    ignored = targets == IGNORE_INDEX
    if not ignored.any():
        losses[...] = lse - z[np.arange(z.shape[0]), targets]
        return None
    picked = lse - z[np.arange(z.shape[0]), np.where(ignored, 0, targets)]
    losses[...] = np.where(ignored, 0.0, picked)
    return ignored


def _onehot_sub(g, targets, ignored):
    """g (n, V) = softmax rows: g - onehot(targets) in place, ignored rows made zero."""
    if ignored is None:
        g[np.arange(g.shape[0]), targets] -= 1.0
        return
    keep = ~ignored
    g[np.flatnonzero(keep), targets[keep]] -= 1.0
    g[ignored] = 0.0


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
    instead (each chunk its own rows). A target of IGNORE_INDEX: loss 0, a zero dlogits row. dloss:
    a float, or a (1,) array read when the kernel runs (the engine's, which k_step_check writes
    from the loss scale)."""
    x, tg, z_all, N = _loss_rows("k_loss_bwd", logits, inp, wte, targets)
    lf, lsef, dx = losses.reshape(N), lse.reshape(N), dinp.reshape(N, -1)
    R = z_all.shape[0]
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        z = z_all[:r1 - r0]
        np.matmul(x[r0:r1], wte.T, out=z)
        ignored = _loss_chunk(z, lsef[r0:r1], lf[r0:r1], tg[r0:r1])
        np.exp(z - lsef[r0:r1, None], out=z)
        _onehot_sub(z, tg[r0:r1], ignored)
        z *= dloss
        _put(dx[r0:r1], z @ wte, accumulate)
        dwte += z.T @ x[r0:r1]


# ---------------------------------------------------------------- FP8 (train.precision=fp8)
# The classifier in FP8 (kernels/loss.cu loss_bwd_fp8, cuda/fp8/): logits = fp8(inp) @ fp8(wte).T,
# and dlogits = softmax - onehot(target) quantised with a scale from its bound instead of its amax:
# every |softmax - onehot| <= 1, so the scale is fp8_scale(1) (2^8 for E4M3, 2^15 for E5M2) and
# dloss moves into the products' 1/scale. No pass over dlogits for its amax.


def fp8_bound_scale(fmt):
    """(scale, 1/scale) of a tensor whose values lie in [-1, 1]: fp8_scale of an amax of 1."""
    return fp8_scale(np.float32(1.0), fmt)


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
    ignored = _loss_chunk(z, lse, losses, targets)
    g = np.exp(z - np.asarray(lse, np.float64)[:, None])
    _onehot_sub(g, np.asarray(targets), ignored)
    scale, inv = fp8_bound_scale(fmt)
    g = (g * float(scale)).astype(np.float32)
    if rounding == "stochastic":
        g = fp8_round_stochastic(g, fp8_sr_bits(logits, row0), fmt)
    q8[...] = fp8_encode(fp8_round(g, fmt), fmt)
    meta[1] = np.float32(_dloss_value(dloss) * float(inv))


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
