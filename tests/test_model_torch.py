"""The whole model against PyTorch autograd on the same weights: loss and every parameter gradient.

float64: relative error below 1e-9 (both sides compute the same math in double precision; the only
differences are summation orders, ~1e-15 per operation). float32: below 1e-4 (single-precision
rounding through ~2 layers of matmuls and softmaxes, ~1e-6 per op, with headroom for cancellation
in small gradients such as wpe's).
"""
import numpy as np
import pytest

from andrea.config import load_run_config
from andrea.core.engine import Engine

torch = pytest.importorskip("torch")
F = torch.nn.functional


def torch_loss(cfg, views, tokens, targets, dtype):
    """The ANDREA architecture written directly in PyTorch, on tensors made from our views."""
    m = cfg.model
    P = {k: torch.tensor(np.array(v), dtype=dtype, requires_grad=True) for k, v in views.items()}
    B, T = tokens.shape
    C, NH = m.d_model, m.n_head
    x = P["wte"][torch.tensor(tokens, dtype=torch.long)] + P["wpe"][:T]
    for l in range(m.n_layer):
        w = {k.split(".", 1)[1]: v for k, v in P.items() if k.startswith(f"h{l}.")}
        h = F.layer_norm(x, (C,), w["ln1_w"], w["ln1_b"], eps=1e-5)
        q, k, v = F.linear(h, w["qkv_w"], w["qkv_b"]).split(C, dim=2)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, C), w["attn_out_w"], w["attn_out_b"])
        h = F.layer_norm(x, (C,), w["ln2_w"], w["ln2_b"], eps=1e-5)
        h = F.gelu(F.linear(h, w["mlp_w1"], w["mlp_b1"]), approximate="tanh")
        x = x + F.linear(h, w["mlp_w2"], w["mlp_b2"])
    x = F.layer_norm(x, (C,), P["lnf_w"], P["lnf_b"], eps=1e-5)
    logits = x @ P["wte"].T
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(targets, dtype=torch.long).reshape(-1))
    loss.backward()
    return float(loss.detach()), {k: t.grad.numpy() for k, t in P.items()}


def general_position_step(dtype: str, seed: int):
    """A 2-layer NumPy engine with non-trivial layer-norm gains and biases (so their gradients are
    tested in general position) after one forward + backward on a random batch:
    (cfg, eng, host weights, tokens, targets, loss)."""
    cfg = load_run_config({"model": {"n_layer": 2, "d_model": 24, "n_head": 3, "context": 16,
                                     "vocab_size": 37},
                           "train": {"batch_size": 3, "seq_len": 11, "init_std": 0.3},
                           "backend": {"name": "numpy"}})
    eng = Engine(cfg, dtype=dtype)
    rng = np.random.default_rng(seed)
    host = eng.be.to_numpy(eng.params).copy()
    host[eng.layout.n_decay:] += rng.normal(0, 0.3, host.size - eng.layout.n_decay)
    eng.set_state(host)
    tokens = rng.integers(0, 37, (3, 11)).astype(np.int32)
    targets = rng.integers(0, 37, (3, 11)).astype(np.int32)
    return cfg, eng, host, tokens, targets, eng.forward_backward(tokens, targets)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-9), ("float32", 1e-4)])
def test_model_matches_torch(dtype, tol):
    cfg, eng, host, tokens, targets, loss = general_position_step(dtype, seed=0)
    ref_loss, ref_grads = torch_loss(cfg, eng.layout.views(host), tokens, targets,
                                     getattr(torch, dtype))
    assert abs(loss - ref_loss) / abs(ref_loss) < tol, (loss, ref_loss)
    ours = eng.layout.views(eng.be.to_numpy(eng.grads))
    for name, g in ref_grads.items():
        err = np.linalg.norm(ours[name] - g) / np.linalg.norm(g)
        assert err < tol, f"d{name}: relative error {err:.2e} (tol {tol}); ours {ours[name].reshape(-1)[:3]} torch {g.reshape(-1)[:3]}"
