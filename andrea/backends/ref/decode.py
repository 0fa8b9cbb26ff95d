"""Attention of one new position against a KV cache (kernels/decode.cu): inference only."""
from __future__ import annotations

import math

import numpy as np

from .gelu import _gelu
from .layernorm import k_layernorm_fwd
from .residual import k_residual_add


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


def k_attn_shared_fwd(out, qkv, saved, pre, plen, first, n_head, max_keys):
    """The attention of an option's rows after its item's shared context (andrea/tasks/shared.py),
    inference only: row r of qkv (R,1,3C) attends to the plen[r] keys and values of saved (M,3C)
    from row pre[r] on, then to rows first[r]..r of qkv; out (R,1,C) = the row of k_attn_fwd on the
    whole sequence (context, then the option's rows). pre, plen, first (R,) int32; max_keys >= every
    row's key count (the CUDA kernel's shared memory), checked here with the indices."""
    R, _, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    rows = qkv[:, 0]
    for r, (p0, n, f) in enumerate(zip(np.asarray(pre), np.asarray(plen), np.asarray(first))):
        if not (0 <= p0 and 0 <= n and p0 + n <= saved.shape[0] and 0 <= f <= r and n + r - f + 1 <= max_keys):
            raise ValueError(f"k_attn_shared_fwd: row {r}: pre {p0}, plen {n}, first {f} outside saved's "
                             f"{saved.shape[0]} rows, the rows 0..{r} or max_keys {max_keys}")
        kv = np.concatenate([saved[p0:p0 + n], rows[f:r + 1]])  # (keys, 3C)
        q = rows[r, :C].reshape(n_head, 1, hs)
        k = kv[:, C:2 * C].reshape(-1, n_head, hs).transpose(1, 2, 0)  # (NH, hs, keys)
        v = kv[:, 2 * C:].reshape(-1, n_head, hs).transpose(1, 0, 2)  # (NH, keys, hs)
        s = (q @ k) * (1.0 / math.sqrt(hs))  # (NH,1,keys)
        smax = s.max(axis=-1, keepdims=True)
        lse = smax + np.log(np.exp(s - smax).sum(axis=-1, keepdims=True))
        out[r, 0] = (np.exp(s - lse) @ v).reshape(C)


# ---------------------------------------------------------------- batched decoding (andrea/use/batch.py)
# N slots, each a sequence with its own length: lengths (N,) int32 is the row of the cache the
# slot's input token goes to (= the tokens its cache already holds), read from the device by the
# kernels, so one CUDA graph serves every position.


def k_decode_embed_fwd(out, tokens, lengths, wte, wpe):
    """out (N,1,C) = wte[tokens[n]] + wpe[lengths[n]]: each slot's input token at its own position;
    tokens, lengths (N,) int32."""
    out[:, 0] = wte[tokens] + wpe[lengths]


def k_attn_decode_batch_fwd(out, kcache, vcache, qkv, lengths, n_head):
    """k_attn_decode_fwd of each slot n at its own position lengths[n]: qkv (N,1,3C), kcache,
    vcache (N,context,C), out (N,1,C), lengths (N,) int32."""
    for n, pos in enumerate(np.asarray(lengths)):
        k_attn_decode_fwd(out[n:n + 1], kcache[n:n + 1], vcache[n:n + 1], qkv[n:n + 1], int(pos), n_head)


def k_decode_cache_fill(kcache, vcache, qkv, slot, n):
    """The prefill's keys and values into a slot's cache: for every layer l, kcache[l, slot, :n] =
    the k third of qkv[l, 0, :n] and vcache[l, slot, :n] its v third; kcache, vcache (L,N,ctx,C),
    qkv (L,1,T,3C) the prefill's projections of every layer, n <= T."""
    C = kcache.shape[-1]
    kcache[:, slot, :n] = qkv[:, 0, :n, C:2 * C]
    vcache[:, slot, :n] = qkv[:, 0, :n, 2 * C:]


def k_decode_linear_fwd(out, inp, w, b, gelu):
    """out (N,1,OC) = inp (N,1,IC) @ w (OC,IC).T + b, then GELU (tanh form) where gelu: a linear
    layer of the step, each row on its own (the GPU runs it for N <= DECODE_GEMV_ROWS)."""
    y = np.matmul(inp, w.T).astype(np.float64) + b
    if gelu:
        _gelu(y, y)
    out[...] = y


def k_decode_ln_linear_fwd(out, res, a, b, ln_w, ln_b, w, bias, gelu):
    """k_residual_layernorm_fwd (res = a + b, then its layer norm; b None: the layer norm of a,
    res not written) and k_decode_linear_fwd of that layer norm, in one: out (N,1,OC); a, b, res
    (N,1,C); ln_w, ln_b (C,); w (OC,C); bias (OC,)."""
    N, _, C = a.shape
    x = a
    if b is not None:
        k_residual_add(res, a, b)
        x = res
    ln = np.empty_like(a)
    k_layernorm_fwd(ln, np.empty((N, 1)), np.empty((N, 1)), x, ln_w, ln_b)
    k_decode_linear_fwd(out, ln, w, bias, gelu)


def k_decode_logits_fwd(logits, inp, wte):
    """logits (N,V) float32 = inp (N,1,C) @ wte (V,C).T: the tied classifier of one row a slot,
    each row its own product (a row's logits never depend on the other rows)."""
    logits[...] = np.matmul(inp, wte.T)[:, 0]  # (N,1,C) @ (C,V): one product a row, as the linear layers'


# ---------------------------------------------------------------- sampling
# Counter-based: the draw of the token at position pos of a request with seed s depends on (s, pos)
# alone, never on the slot or the batch. Gumbel-max: the token is argmax over the kept tokens of
# z_v + g_v, z = logits / temperature, g_v = -log(-log(u_v)), u_v in (0,1) from a hash of
# (seed, pos, v): exactly a draw from softmax(z) over the kept set.
M64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(z):
    """splitmix64's finaliser of uint64 z (NumPy array or int), wrapping as the device does."""
    with np.errstate(over="ignore"):
        z = np.asarray(z, dtype=np.uint64) + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
        return z ^ (z >> np.uint64(31))


def sample_uniforms(seed: int, pos: int, V: int):
    """u (V,) float64 in (0,1): the top 23 bits of splitmix64(key + v), key = splitmix64(seed ^
    splitmix64(pos)), at the middle of their 2^-23 cell (24 significant bits: exact in float32)."""
    key = splitmix64(np.uint64(seed & M64) ^ splitmix64(np.uint64(pos)))
    with np.errstate(over="ignore"):
        h = splitmix64(key + np.arange(V, dtype=np.uint64))
    return ((h >> np.uint64(41)).astype(np.float64) + 0.5) * 2.0 ** -23


def sample_row(logits, temperature, top_k, top_p, seed, pos) -> int:
    """The token a request with these settings draws at position pos from one row of logits (V,):
    greedy (the first largest) at temperature <= 0; else z = float32(logits) / float32(temperature),
    kept: the top_k largest z (0: all; ties at the k-th value kept), then the smallest set of the
    largest z whose probability (softmax over the kept) reaches top_p (ties at its threshold kept),
    and the Gumbel-max draw among them."""
    z = np.asarray(logits, dtype=np.float32)
    if temperature <= 0:
        return int(np.argmax(z))
    z = z / np.float32(temperature)
    V = z.size
    keep = np.ones(V, dtype=bool)
    if 0 < top_k < V:
        keep = z >= np.partition(z, V - top_k)[V - top_k]
    if top_p < 1:
        zk = z[keep].astype(np.float64)
        e = np.exp(zk - zk.max())
        s = np.sort(e)[::-1]
        cum = np.cumsum(s)
        i = min(int(np.searchsorted(cum, top_p * cum[-1])), s.size - 1)
        t = np.sort(zk)[::-1][i]
        keep &= z >= np.float32(t)
    g = -np.log(-np.log(sample_uniforms(seed, pos, V)))
    score = np.where(keep, z.astype(np.float64) + g, -np.inf)
    return int(np.argmax(score))


def k_sample_fwd(tokens, lengths, logits, temperature, top_k, top_p, seeds, live, context):
    """For each live slot n (live (N,) int32 nonzero): the token at position pos = lengths[n] + 1
    drawn from logits[n] (sample_row, with the slot's temperature, top_k, top_p (N,) and seed (N,)
    uint64) into tokens[n], and lengths[n] = min(pos, context - 1): the sampled token is the next
    step's input at its row (a slot at the end of its window keeps writing its last row; its
    request has finished). A free slot (live 0) gets token 0 at row 0, so that its row of the next
    steps costs nothing and stays in range."""
    for n in range(tokens.shape[0]):
        if not live[n]:
            tokens[n], lengths[n] = 0, 0
            continue
        pos = int(lengths[n]) + 1
        tokens[n] = sample_row(logits[n], float(temperature[n]), int(top_k[n]), float(top_p[n]),
                               int(seeds[n]), pos)
        lengths[n] = min(pos, context - 1)
