"""The ANDREA architecture: parameter layout in one flat buffer, and the forward/backward order.

Pre-norm GPT (docs/ANDREA.md): x = wte[tokens] + wpe[pos]; per layer x += attn(LN1(x)),
x += mlp(LN2(x)); logits = LNf(x) @ wte.T (tied); loss = mean cross-entropy. Every operation is a
kernel pair of the backend (`be.k_*`), called here in order; this file does no arithmetic itself.

Parameter order in the flat buffer: all matrices first (wte, wpe, then per layer the four linear
weights), then all vectors (layer-norm gains and biases, linear biases). AdamW decays exactly the
first `n_decay` elements, the matrices, so the optimizer needs no mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from ..config import ModelConfig

LAYER_MATRICES = ("qkv_w", "attn_out_w", "mlp_w1", "mlp_w2")
LAYER_VECTORS = ("ln1_w", "ln1_b", "qkv_b", "attn_out_b", "ln2_w", "ln2_b", "mlp_b1", "mlp_b2")


def param_shapes(m: ModelConfig) -> Tuple[List[Tuple[str, tuple]], int]:
    """[(name, shape)] in buffer order, and how many leading entries are decayed matrices."""
    C, V = m.d_model, m.vocab_size
    mats = {"qkv_w": (3 * C, C), "attn_out_w": (C, C), "mlp_w1": (4 * C, C), "mlp_w2": (C, 4 * C)}
    vecs = {"ln1_w": (C,), "ln1_b": (C,), "qkv_b": (3 * C,), "attn_out_b": (C,), "ln2_w": (C,),
            "ln2_b": (C,), "mlp_b1": (4 * C,), "mlp_b2": (C,)}
    out = [("wte", (V, C)), ("wpe", (m.context, C))]
    out += [(f"h{l}.{n}", mats[n]) for l in range(m.n_layer) for n in LAYER_MATRICES]
    n_mat = len(out)
    out += [(f"h{l}.{n}", vecs[n]) for l in range(m.n_layer) for n in LAYER_VECTORS]
    out += [("lnf_w", (C,)), ("lnf_b", (C,))]
    return out, n_mat


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class ParamLayout:
    """Offsets of every named parameter in the flat buffer."""
    entries: List[Tuple[str, int, tuple]]  # (name, offset, shape)
    n_params: int
    n_decay: int  # elements [0, n_decay) are matrices: AdamW decays them

    @classmethod
    def from_config(cls, m: ModelConfig) -> "ParamLayout":
        shapes, n_mat = param_shapes(m)
        entries, off, n_decay = [], 0, 0
        for i, (name, shape) in enumerate(shapes):
            entries.append((name, off, shape))
            off += _numel(shape)
            if i == n_mat - 1:
                n_decay = off
        return cls(entries, off, n_decay)

    def views(self, flat) -> Dict[str, object]:
        """Named, shaped views into a flat buffer (NumPy or CuPy); no copies."""
        return {name: flat[off:off + _numel(shape)].reshape(shape) for name, off, shape in self.entries}


def count_params(m: ModelConfig) -> int:
    return ParamLayout.from_config(m).n_params


def activation_shapes(m: ModelConfig, B: int, T: int) -> Dict[str, Tuple[tuple, str]]:
    """Saved activations of one layer: name -> (shape, kind); kind "act" is the compute dtype,
    "f32" is float32 whatever the precision (statistics the backward pass divides by)."""
    C, NH = m.d_model, m.n_head
    return {
        "ln1": ((B, T, C), "act"), "ln1_mean": ((B, T), "f32"), "ln1_rstd": ((B, T), "f32"),
        "qkv": ((B, T, 3 * C), "act"), "atty": ((B, T, C), "act"), "att_lse": ((B, NH, T), "f32"),
        "xmid": ((B, T, C), "act"),
        "ln2": ((B, T, C), "act"), "ln2_mean": ((B, T), "f32"), "ln2_rstd": ((B, T), "f32"),
        "pre": ((B, T, 4 * C), "act"), "res_out": ((B, T, C), "act"),
    }


def global_shapes(m: ModelConfig, B: int, T: int) -> Dict[str, Tuple[tuple, str]]:
    """Saved activations outside the layers, the workspace, and the token buffers."""
    C, V = m.d_model, m.vocab_size
    return {
        "tokens": ((B, T), "i32"), "targets": ((B, T), "i32"),
        "x0": ((B, T, C), "act"),
        "lnf": ((B, T, C), "act"), "lnf_mean": ((B, T), "f32"), "lnf_rstd": ((B, T), "f32"),
        "losses": ((B, T), "f32"), "loss_lse": ((B, T), "f32"),
        # workspace: reused by every layer, live only inside one kernel pair or one layer
        "logits": ((loss_chunk_rows(B * T, V), V), "act"), "attproj": ((B, T, C), "act"), "mlpout": ((B, T, C), "act"),
        "act": ((B, T, 4 * C), "act"), "dact": ((B, T, 4 * C), "act"),
        "dres": ((B, T, C), "act"), "dln": ((B, T, C), "act"),
        "dqkv": ((B, T, 3 * C), "act"), "datty": ((B, T, C), "act"),
    }


LOSS_CHUNK_ELEMENTS = 1 << 28  # the classifier's logits workspace holds at most this many values


def loss_chunk_rows(N: int, V: int) -> int:
    """Rows of the logits workspace: the classifier (k_loss_fwd / k_loss_bwd) goes over the N = B*T
    rows in chunks of this many, a power of two (all N when they fit), so no (B,T,V) buffer."""
    r = 1 << max(0, (LOSS_CHUNK_ELEMENTS // V).bit_length() - 1)
    return max(1, min(N, r))


WORKSPACE = ("logits", "attproj", "mlpout", "act", "dact", "dres", "dln", "dqkv", "datty")


def forward(be, p, layers, g, n_head, loss=True):
    """Forward pass of the whole model; writes g["losses"] (B,T). p: weight views; layers: saved
    activations per layer; g: global buffers (tokens and targets already uploaded). loss=False
    stops before the classifier: in training the backward pass's fused k_loss_bwd computes the
    losses together with their gradient. Each residual add runs fused into the layer norm that
    follows it (k_residual_layernorm_fwd): LN2 of the layer, then LN1 of the next layer or LNf."""
    be.k_embed_fwd(g["x0"], g["tokens"], p["wte"], p["wpe"])
    x = g["x0"]
    if layers:
        a0 = layers[0]
        be.k_layernorm_fwd(a0["ln1"], a0["ln1_mean"], a0["ln1_rstd"], x, p["h0.ln1_w"], p["h0.ln1_b"])
    else:
        be.k_layernorm_fwd(g["lnf"], g["lnf_mean"], g["lnf_rstd"], x, p["lnf_w"], p["lnf_b"])
    for l, a in enumerate(layers):
        w = _layer(p, l)
        be.k_attn_qkv_fwd(a["qkv"], a["ln1"], w["qkv_w"], w["qkv_b"])
        be.k_attn_fwd(a["atty"], a["att_lse"], a["qkv"], n_head)
        be.k_attn_out_fwd(g["attproj"], a["atty"], w["attn_out_w"], w["attn_out_b"])
        # xmid = x + attproj; ln2 = LN2(xmid)
        be.k_residual_layernorm_fwd(a["xmid"], a["ln2"], a["ln2_mean"], a["ln2_rstd"], x, g["attproj"],
                                    w["ln2_w"], w["ln2_b"])
        be.k_mlp_fwd(g["mlpout"], a["pre"], g["act"], a["ln2"], w["mlp_w1"], w["mlp_b1"],
                     w["mlp_w2"], w["mlp_b2"])
        # res_out = xmid + mlpout, then the next layer norm of it: LN1 of layer l+1, or LNf
        if l + 1 < len(layers):
            n = layers[l + 1]
            nxt = (n["ln1"], n["ln1_mean"], n["ln1_rstd"], p[f"h{l + 1}.ln1_w"], p[f"h{l + 1}.ln1_b"])
        else:
            nxt = (g["lnf"], g["lnf_mean"], g["lnf_rstd"], p["lnf_w"], p["lnf_b"])
        be.k_residual_layernorm_fwd(a["res_out"], nxt[0], nxt[1], nxt[2], a["xmid"], g["mlpout"],
                                    nxt[3], nxt[4])
        x = a["res_out"]
    if loss:
        be.k_loss_fwd(g["losses"], g["loss_lse"], g["logits"], g["lnf"], p["wte"], g["targets"])


def backward(be, p, dp, layers, g, n_head, dloss, start=None, ready=None):
    """Backward pass after forward() (with or without its loss): writes g["losses"] (the fused
    classifier) and ADDS every parameter gradient into dp (views of the grads buffer). dloss is
    d(objective)/d(loss of each position), e.g. loss_scale / (B*T): a float, or a (1,) array on
    the device read when k_loss_bwd runs (the engine's, kept by k_step_check).
    The residual stream's gradient lives in one buffer, dres: a residual add passes it unchanged
    to its branch (which reads dres as its output gradient) and to its input, and the layer
    norm's backward at the start of the branch adds its part into dres in place, so no copies.
    No buffer is zeroed: the first kernel to write each activation gradient (dres, dln, datty,
    dqkv) in a pass runs with accumulate=False and overwrites whatever the workspace held.
    The kernels run inside be.param_grad_pass(): the backend may finish part of the parameter
    gradients (CUDA: the bias and layer-norm weight column sums) when it closes, in one launch.
    start: the flat gradient buffer behind dp when this pass starts the step's gradients (its old
    contents count as zero: the first microbatch's pass writes the gradients, nothing zeroes them).
    ready: called as ready(l) once layer l's kernels are queued (its matrices' gradients are then
    final) and ready(None) once the pass has closed (every gradient final): the data-parallel sum
    in buckets (buckets.py) issues its collectives there."""
    dres, dln = g["dres"], g["dln"]
    x_last = layers[-1]["res_out"] if layers else g["x0"]
    with be.param_grad_pass(start=start):  # the parameter gradients are complete when it closes
        be.k_loss_bwd(g["losses"], g["loss_lse"], dln, dp["wte"], g["logits"], g["lnf"], p["wte"],
                      g["targets"], dloss, accumulate=False)
        be.k_layernorm_bwd(dres, dp["lnf_w"], dp["lnf_b"], dln, x_last, p["lnf_w"], g["lnf_mean"], g["lnf_rstd"],
                           accumulate=False)
        for l in reversed(range(len(layers))):
            a, w, dw = layers[l], _layer(p, l), _layer(dp, l)
            x_in = layers[l - 1]["res_out"] if l > 0 else g["x0"]
            # res_out = xmid + mlp(ln2(xmid)): dres becomes the gradient of xmid
            be.k_mlp_bwd(dln, dw["mlp_w1"], dw["mlp_b1"], dw["mlp_w2"], dw["mlp_b2"], dres, a["ln2"],
                         a["pre"], w["mlp_w1"], w["mlp_w2"], g["act"], g["dact"], accumulate=False)
            be.k_layernorm_bwd(dres, dw["ln2_w"], dw["ln2_b"], dln, a["xmid"], w["ln2_w"],
                               a["ln2_mean"], a["ln2_rstd"])
            # xmid = x_in + attn_out(attn(qkv(ln1(x_in)))): dres becomes the gradient of x_in
            be.k_attn_out_bwd(g["datty"], dw["attn_out_w"], dw["attn_out_b"], dres, a["atty"], w["attn_out_w"],
                              accumulate=False)
            be.k_attn_bwd(g["dqkv"], g["datty"], a["qkv"], a["atty"], a["att_lse"], n_head, accumulate=False)
            be.k_attn_qkv_bwd(dln, dw["qkv_w"], dw["qkv_b"], g["dqkv"], a["ln1"], w["qkv_w"], accumulate=False)
            be.k_layernorm_bwd(dres, dw["ln1_w"], dw["ln1_b"], dln, x_in, w["ln1_w"], a["ln1_mean"], a["ln1_rstd"])
            if ready is not None:
                ready(l)
        be.k_embed_bwd(dp["wte"], dp["wpe"], dres, g["tokens"])
    if ready is not None:
        ready(None)


def rows_after_attention(be, p, l, n_layer, r):
    """The rest of layer l on a set of rows after its attention (the batch decoder's step, the
    shared-context scoring's option pass): r["atty"] through the output projection, x + it and LN2
    into r["xmid"], r["ln"]; the MLP; xmid + its output and the next layer norm (LN1 of layer l + 1,
    LNf after the last) into r["x"], r["ln"]. r holds x, xmid, ln, mean, rstd, atty, attproj, pre,
    act and mlpout, each (N, 1, width): forward()'s order and kernels."""
    w = _layer(p, l)
    be.k_attn_out_fwd(r["attproj"], r["atty"], w["attn_out_w"], w["attn_out_b"])
    be.k_residual_layernorm_fwd(r["xmid"], r["ln"], r["mean"], r["rstd"], r["x"], r["attproj"], w["ln2_w"],
                                w["ln2_b"])
    be.k_mlp_fwd(r["mlpout"], r["pre"], r["act"], r["ln"], w["mlp_w1"], w["mlp_b1"], w["mlp_w2"], w["mlp_b2"])
    nxt = ("lnf_w", "lnf_b") if l + 1 == n_layer else (f"h{l + 1}.ln1_w", f"h{l + 1}.ln1_b")
    be.k_residual_layernorm_fwd(r["x"], r["ln"], r["mean"], r["rstd"], r["xmid"], r["mlpout"], p[nxt[0]],
                                p[nxt[1]])


def _layer(views, l):
    prefix = f"h{l}."
    return {n: views[prefix + n] for n in LAYER_MATRICES + LAYER_VECTORS}

