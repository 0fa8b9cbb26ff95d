"""The floor of a 16-bit training step: the least each kernel must do, and its time on this GPU.

    python -m andrea.bench --exp ANDREA-120M --batch 8 --floor

For every kernel of one step (forward, backward, the optimizer's kernels) `step_work` lists what
it cannot avoid: its matrix products (M, N, K), attention's matrix FLOPs, and the bytes every other
part of it must read or write at least once. `floors` turns that into milliseconds with rates
measured in the same job: each product at cuBLAS's own rate for that shape and layout (a plain
GEMM, no epilogue, replayed as a CUDA graph), attention's FLOPs at the dense peak (cuBLAS on an
8192^3 product), bytes at the device's copy bandwidth. `table` sets them beside the per-kernel
device times of bench.step.profile_step: ours, floor, gap, largest gap first. The floor is an
estimate, not a proof: a fused kernel can beat a row's bytes (e.g. column sums done inside a
product's epilogue cost no pass of their own), and small products never reach the large ones'
rate. Its job is to say where the milliseconds are that could still go.

Names: N = B*T rows, C = d_model, V = vocab, L = layers, NH = heads; `a` bytes per activation
element (2 in fp16/bf16), master weights, gradients and Adam moments in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

Gemm = Tuple[int, int, int, bool, bool]  # (M, N, K, trans_a, trans_b): C (M, N) = op(A) op(B), row-major


@dataclass
class Work:
    """What one kernel name does in one step, summed over its calls."""
    calls: int
    gemms: List[Gemm] = field(default_factory=list)  # every product of every call
    attn_flops: float = 0.0  # attention's matrix FLOPs (causal: the half that is computed)
    bytes: float = 0.0  # the bytes its other parts must move at least

    def gemm_flops(self) -> float:
        return float(sum(2 * m * n * k for m, n, k, _, _ in self.gemms))


def _fwd(M, N, K) -> Gemm:  # Y (M, N) = X (M, K) @ W (N, K)^T
    return (M, N, K, False, True)


def _dx(M, N, K) -> Gemm:  # dX (M, N) = dY (M, K) @ W (K, N)
    return (M, N, K, False, False)


def _dw(M, N, K) -> Gemm:  # dW (M, N) = dY (K, M)^T @ X (K, N)
    return (M, N, K, True, False)


def step_work(B: int, T: int, C: int, NH: int, V: int, L: int, n_params: int, a: int = 2) -> Dict[str, Work]:
    """The least work of each kernel of one microbatch's step (one optimizer step), by kernel name."""
    N, f32 = B * T, 4
    act = N * C * a  # one (B, T, C) activation
    attn = 2.0 * B * T * T * C  # QK^T and PV, causal half: 2 * (2 * B * NH * T * T * hs) / 2
    w = {
        "k_embed_fwd": Work(1, bytes=2 * act + T * C * a + N * 4),
        "k_layernorm_fwd": Work(1, bytes=2 * act + N * 2 * f32),
        "k_attn_qkv_fwd": Work(L, [_fwd(N, 3 * C, C)] * L),
        "k_attn_fwd": Work(L, attn_flops=L * attn, bytes=L * (4 * act + B * NH * T * f32)),
        "k_attn_out_fwd": Work(L, [_fwd(N, C, C)] * L),
        # reads a and b, writes the sum and its layer norm
        "k_residual_layernorm_fwd": Work(2 * L, bytes=2 * L * (4 * act + N * 2 * f32)),
        # the GELU's second output (pre and act both leave the first product)
        "k_mlp_fwd": Work(L, [_fwd(N, 4 * C, C), _fwd(N, C, 4 * C)] * L, bytes=L * 4 * act),
        # logits, dX and dW of the tied classifier; the softmax reads and rewrites the logits once
        "k_loss_bwd": Work(1, [_fwd(N, V, C), _dx(N, C, V), _dw(V, C, N)], bytes=2 * N * V * a),
        # reads dout and inp, reads and rewrites the residual gradient it adds into
        "k_layernorm_bwd": Work(2 * L + 1, bytes=(2 * L + 1) * (4 * act + N * 2 * f32)),
        # dact, dW2, dX, dW1; the GELU's input is read again and its output made again
        "k_mlp_bwd": Work(L, [_dx(N, 4 * C, C), _dw(C, 4 * C, N), _dx(N, C, 4 * C), _dw(4 * C, C, N)] * L,
                          bytes=L * 3 * 4 * act),
        "k_attn_out_bwd": Work(L, [_dx(N, C, C), _dw(C, C, N)] * L),
        # 5 products of the 2 forward ones' size; reads qkv, out, dout, lse, writes dqkv
        "k_attn_bwd": Work(L, attn_flops=L * 2.5 * attn, bytes=L * (8 * act + B * NH * T * f32)),
        "k_attn_qkv_bwd": Work(L, [_dx(N, C, 3 * C), _dw(3 * C, C, N)] * L),
        # reads dres, adds rows into the float32 wte and wpe gradients
        "k_embed_bwd": Work(1, bytes=act + 2 * N * C * f32),
        # the bias and layer-norm column sums held back to the pass's close: each gradient read once
        # (dqkv 3C, dres twice C, dact 4C, and the two layer norms' dout and x-hat, 2C each)
        "param_grad_pass": Work(1, bytes=L * 13 * act),
        "k_loss_accum": Work(1, bytes=N * f32),
        "k_grad_norm_partial": Work(1, bytes=n_params * f32),
        "k_step_check": Work(1),
        # reads params, grads, m, v; writes params, m, v and the compute copy
        "k_adamw_step": Work(1, bytes=n_params * (7 * f32 + a)),
    }
    return w


def measure_rates(gemms: List[Gemm], dtype: str = "float16", reps: int = 20) -> Tuple[Dict[Gemm, float], float, float]:
    """({gemm: TFLOP/s}, dense peak TFLOP/s, copy bandwidth GB/s) on this GPU, each product by
    cuBLAS alone (the backend's own handle) captured as a graph of `reps` calls and replayed."""
    import cupy as cp

    from ..backends.cuda.cublas import Cublas
    from ..backends.cuda.graphs import capture, replay_ms

    blas, s = Cublas(), cp.cuda.Stream(non_blocking=True)
    dt = cp.dtype(dtype)

    def rate(g: Gemm) -> float:
        M, N, K, ta, tb = g
        A = cp.random.standard_normal((K, M) if ta else (M, K), dtype=cp.float32).astype(dt)
        Bm = cp.random.standard_normal((N, K) if tb else (K, N), dtype=cp.float32).astype(dt)
        out = cp.empty((M, N), dtype=dt)

        def calls():
            for _ in range(reps):
                blas.gemm(out, A, Bm, ta, tb, M, N, K, A.shape[1], Bm.shape[1], N)
        ms = replay_ms(capture(calls, s, blas), s, 3) / reps
        return 2 * M * N * K / (ms * 1e-3) / 1e12

    rates = {g: rate(g) for g in sorted(set(gemms))}
    peak = rate((8192, 8192, 8192, False, True))
    src = cp.empty(1 << 30, dtype=cp.uint8)
    dst = cp.empty_like(src)

    def copies():
        for _ in range(reps):
            dst.data.copy_from_device_async(src.data, src.nbytes)
    ms = replay_ms(capture(copies, s, blas), s, 3) / reps
    return rates, peak, 2 * src.nbytes / (ms * 1e-3) / 1e9


def floors(work: Dict[str, Work], rates: Dict[Gemm, float], peak_tflops: float, bw_gbs: float) -> Dict[str, float]:
    """Milliseconds each kernel name needs at least: its products at their measured rates plus the
    larger of attention's FLOPs at the peak and its other bytes at the bandwidth."""
    out = {}
    for name, wk in work.items():
        gemm_ms = sum(2 * m * n * k / (rates[(m, n, k, ta, tb)] * 1e12) for m, n, k, ta, tb in wk.gemms) * 1e3
        rest_ms = max(wk.attn_flops / (peak_tflops * 1e12), wk.bytes / (bw_gbs * 1e9)) * 1e3
        out[name] = gemm_ms + rest_ms
    return out


def table(ours_ms: Dict[str, float], floor_ms: Dict[str, float], step_ms: float) -> "pandas.DataFrame":  # noqa: F821
    """Per kernel: ours, floor, gap (ms per step) and ours/floor, largest gap first; a row for the
    step's time outside its kernels (host gaps, launch latency: floor 0) and a total."""
    import pandas as pd

    names = sorted(set(ours_ms) | set(floor_ms))
    df = pd.DataFrame({"ours_ms": [ours_ms.get(n, 0.0) for n in names],
                       "floor_ms": [floor_ms.get(n, 0.0) for n in names]}, index=names)
    df.loc["(step outside its kernels)"] = [max(0.0, step_ms - df["ours_ms"].sum()), 0.0]
    df["gap_ms"] = df["ours_ms"] - df["floor_ms"]
    df = df.sort_values("gap_ms", ascending=False)
    df.loc["total"] = [step_ms, df["floor_ms"].sum(), step_ms - df["floor_ms"].sum()]
    df["ours/floor"] = df["ours_ms"] / df["floor_ms"].where(df["floor_ms"] > 0)
    return df


def report(cfg_model, B: int, T: int, n_params: int, ours_ms: Dict[str, float], step_ms: float,
           dtype: str = "float16") -> str:
    """The floor table of a step measured by bench.step.run_engine, as text. The products are timed
    in fp16 for bf16 steps too (the same tensor-core rate on Hopper)."""
    m = cfg_model
    work = step_work(B, T, m.d_model, m.n_head, m.vocab_size, m.n_layer, n_params)
    rates, peak, bw = measure_rates([g for wk in work.values() for g in wk.gemms], dtype)
    df = table(ours_ms, floors(work, rates, peak, bw), step_ms)
    head = (f"floor of one step (B={B}, T={T}, {dtype}): products at cuBLAS's rate for their shapes, "
            f"attention at the dense peak {peak:.0f} TFLOP/s, other bytes at {bw:.0f} GB/s")
    lines = [f"  {'x'.join(map(str, g[:3]))}{' ^T' if g[3] else ''}: {r:.0f} TFLOP/s" for g, r in rates.items()]
    body = df.to_string(float_format=lambda v: f"{v:.3f}")
    return "\n".join([head, body, "cuBLAS rates of the step's products (M x N x K):", *lines])
