"""PyTorch anchor: ANDREA's GPT written with torch.nn, trained the usual PyTorch way, timed.

    python benchmarks/torch_gpt.py --shape 120m --batch 8 --dtype float16 --compile 1 --mode reduce-overhead
    python benchmarks/torch_gpt.py --shape 120m --dtype bfloat16 --fp8 torchao --compile 1 --mode reduce-overhead

The model is ANDREA's architecture, parameter for parameter (andrea/core/model.py): learned token and
position embeddings, pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm ->
MLP 4x with tanh GELU -> residual), a final LayerNorm, the output projection tied to the token
embedding, biases on every linear layer and LayerNorm. Training: AdamW (weight decay on the
matrices only), global-norm gradient clipping, fp32 master weights with autocast for float16
(with a GradScaler) or bfloat16; attention through scaled_dot_product_attention. --compile 1
runs torch.compile with --mode (default, reduce-overhead, max-autotune).

--fp8 torchao (bfloat16 only, a GPU of compute capability 8.9 or newer, torchao installed): the
FP8 anchor. After the model is built, torchao's float8 training (convert_to_float8_training,
tensorwise recipe: one scale per tensor from its current amax, E4M3 forward and E5M2 gradients,
torch._scaled_mm products) replaces the four linear layers of each block, the four products
ANDREA's fp8 path runs in FP8: qkv, the attention projection, the MLP's up and down (fp8_layer).
The tied output projection (a product with the token embedding, not a torch.nn.Linear) stays in
bf16, as ANDREA's fp8 path keeps it in 16 bits; autocast bf16 and torch.compile as usual.

Timing: --warmup steps, then --steps steps on fixed random tokens between device syncs. FLOPs per
token are 6N + 6*L*T*d (N parameters, L layers, T tokens, d width), the count andrea.bench.step uses.
The last line of stdout is one JSON object: shape, dtype, fp8 ("torchao <version> <recipe>" or
null), batch, T, compile, mode, device, n_params, tok_s, ms_step, tflops, loss.
`python -m andrea.bench --anchor` runs this file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# (layers, width, heads, context, vocabulary) of each ANDREA model (conf/model/)
SHAPES = {"tiny": (2, 64, 4, 64, 512), "12m": (6, 384, 6, 256, 8192), "120m": (12, 768, 12, 1024, 50304)}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8_LAYERS = ("qkv", "proj", "up", "down")  # the linear layers of a Block that --fp8 converts
FP8_RECIPE = "tensorwise"  # torchao's per-tensor current scaling


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, context: int, vocab: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.T  # tied output projection
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the loss in fp32 under autocast, as ANDREA's k_loss_fwd
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def fp8_layer(module: nn.Module, name: str) -> bool:
    """torchao's module filter for --fp8: the four linear layers of each block ("blocks.<i>.<qkv|proj|
    up|down>"), nothing else (the output projection is not a module; it stays in bf16)."""
    parts = name.split(".")
    return (isinstance(module, nn.Linear) and len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit()
            and parts[2] in FP8_LAYERS)


def fp8_problem(fp8: str | None, dtype: str, device: torch.device) -> str | None:
    """Why --fp8 cannot run here (one line), or None: it needs --dtype bfloat16, torchao's float8
    training importable, and a CUDA GPU of compute capability 8.9 or newer (FP8 tensor cores)."""
    if fp8 is None:
        return None
    if dtype != "bfloat16":
        return f"--fp8 {fp8} needs --dtype bfloat16 (autocast around the FP8 products), not {dtype}"
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # ImportError, or a torchao built for another torch
        why = " ".join(str(e).split())  # one line
        return f"--fp8 {fp8}: torchao's float8 training does not import ({type(e).__name__}: {why}); " \
               "pip install torchao"
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if cap is None or cap < (8, 9):
        where = f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}" if cap else f"device {device}"
        return f"--fp8 {fp8} needs a CUDA GPU of compute capability 8.9 or newer (FP8 tensor cores); {where}"
    return None


def to_float8(model: nn.Module, emulate: bool = False) -> str:
    """Swap fp8_layer's linear layers of model for torchao's Float8Linear (FP8_RECIPE), in place;
    returns "torchao <version> <recipe>". emulate: torchao's emulated products (any device, tests)."""
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(FP8_RECIPE), emulate=emulate)
    convert_to_float8_training(model, module_filter_fn=fp8_layer, config=config)
    return f"torchao {torchao.__version__} {FP8_RECIPE}"


def optimizer(model: nn.Module, lr: float, fused: bool) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    kw = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="120m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (0: the model's context)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    ap.add_argument("--fp8", choices=["torchao"], default=None,
                    help="the four linear layers of each block in FP8 through torchao's float8 training "
                         "(tensorwise); needs --dtype bfloat16 and a GPU of compute capability >= 8.9")
    ap.add_argument("--compile", type=int, choices=[0, 1], default=0)
    ap.add_argument("--mode", default="default", help="torch.compile mode: default, reduce-overhead, max-autotune")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    L, d, H, ctx, V = SHAPES[a.shape]
    T = a.seq or ctx
    dev = torch.device(a.device)
    dtype = DTYPES[a.dtype]
    if dev.type == "cpu" and dtype == torch.float16:
        print("torch_gpt: float16 autocast needs a CUDA device; use --dtype float32 or bfloat16 on the CPU",
              file=sys.stderr)
        return 2
    problem = fp8_problem(a.fp8, a.dtype, dev)
    if problem:
        print(f"torch_gpt: {problem}", file=sys.stderr)
        return 2
    torch.manual_seed(1337)
    model = GPT(L, d, H, ctx, V).to(dev)
    fp8 = to_float8(model) if a.fp8 else None  # before the optimizer and compile: they see the new modules
    n_params = sum(p.numel() for p in model.parameters())
    opt = optimizer(model, 3e-4, fused=dev.type == "cuda")
    scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)
    step_model = torch.compile(model, mode=a.mode) if a.compile else model
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, V, (a.batch, T), generator=gen).to(dev)
    y = torch.randint(0, V, (a.batch, T), generator=gen).to(dev)

    def step() -> torch.Tensor:
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = step_model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(a.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / max(1, a.steps)
    tok_s = a.batch * T / dt
    flops_per_token = 6 * n_params + 6 * L * T * d
    rec = {"shape": a.shape, "dtype": a.dtype, "fp8": fp8, "batch": a.batch, "T": T, "compile": a.compile,
           "mode": a.mode, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "n_params": n_params, "tok_s": int(round(tok_s)), "ms_step": dt * 1e3,
           "tflops": tok_s * flops_per_token / 1e12,
           "loss": float(loss.item()) if math.isfinite(loss.item()) else None}
    print(f"torch_gpt: {a.shape} {a.dtype}{' + ' + fp8 if fp8 else ''} B={a.batch} T={T} "
          f"compile={a.compile} ({a.mode}): {rec['tok_s']:,} tok/s, {rec['ms_step']:.2f} ms/step", file=sys.stderr)
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
