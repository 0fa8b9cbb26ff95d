"""The matrix products of one transformer layer at a model's shapes, timed alone: cuBLAS as the
backend calls it (cublasGemmEx, the default algorithm), cuBLASLt's first heuristic algorithms, and
each backward pair (input gradient dX and weight gradient dW of one linear layer) run one after
the other against run side by side on two streams.

    python dev/cuda/gemm_shapes.py --exp ANDREA-12M --batch 32 --exp ANDREA-120M --batch 8 --algos 8

Per linear layer (W of shape OC x IC, N = B*T rows; the classifier: W the embedding, N a chunk's rows):
    Y  (N, OC)  = X (N, IC) @ W^T          dX (N, IC) = dY (N, OC) @ W         dW (OC, IC) = dY^T @ X
in the compute dtype, dW in float32 (as the backend's gradients); dX also through a transposed
copy of W (the Y product's operand layout, "cublas W^T copy"). Each figure is one product's
device time, from a CUDA graph of --reps copies replayed between CUDA events; TFLOP/s counts
2 N OC IC. "pair" rows: dX then dW in one stream, against dX on the stream and dW on a second
stream forked and joined by events in every copy (the form a graph with two branches takes).

What these isolated figures predicted did not hold in the step (H200, 2026-11-30,
docs/BENCHMARKS.md): the pairs on two streams were 0.013 ms a layer faster at ANDREA-12M here, but
the whole forward + backward graph with the weight-gradient products on a side stream took
2.55 ms against 2.54 on one stream; the input-gradient products through a transposed copy of W
were 0.015 (MLP down) and 0.08 (classifier chunk) ms faster here and no faster in the step's
k_mlp_bwd and k_loss_bwd. Both variants are in git history (d37c70a, 0ce264b).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))


def shapes(exp: str, batch: int):
    """[(layer, rows, OC, IC)]: the four linear layers over B*T rows and the classifier over one
    chunk of rows (model.loss_chunk_rows), its weight the embedding (V, C)."""
    from andrea.bench.step import model_dict
    from andrea.core.model import loss_chunk_rows
    m = model_dict(exp)
    C, N, V = m["d_model"], batch * m["context"], m["vocab_size"]
    return [("qkv", N, 3 * C, C), ("attn_out", N, C, C), ("mlp_up", N, 4 * C, C), ("mlp_down", N, C, 4 * C),
            ("classifier", loss_chunk_rows(N, V), V, C)]


def graph_ms(fn, stream, blases, reps: int, replays: int = 5) -> float:
    from andrea.backends.cuda.graphs import replay_ms
    with stream:
        for b in blases:
            b.bind_stream()
        stream.begin_capture()
        try:
            for _ in range(reps):
                fn()
        finally:
            graph = stream.end_capture()
    return replay_ms(graph, stream, replays) / reps


def lt_algos(lt, key_args, count: int):
    """The first `count` algorithms cuBLASLt's heuristic offers for a plain product."""
    from andrea.backends.cuda import cublaslt as L
    desc, lay_b, lay_a, lay_d, _ = lt.plan(*key_args)
    res = (L._Heuristic * count)()
    n = ctypes.c_int(0)
    st = lt.lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, desc, lay_b, lay_a, lay_d, lay_d, lt.pref, count,
                                               res, ctypes.byref(n))
    return (desc, lay_b, lay_a, lay_d), [res[i] for i in range(n.value) if st == 0 and res[i].state == 0]


def lt_run(lt, plan, algo, D, A, B, beta: float):
    import cupy as cp
    desc, lay_b, lay_a, lay_d = plan
    lt.beta.value = beta
    st = lt.lib.cublasLtMatmul(lt.handle, desc, ctypes.byref(lt.alpha), ctypes.c_void_p(B.data.ptr), lay_b,
                               ctypes.c_void_p(A.data.ptr), lay_a, ctypes.byref(lt.beta),
                               ctypes.c_void_p(D.data.ptr), lay_d, ctypes.c_void_p(D.data.ptr), lay_d,
                               ctypes.byref(algo.algo), ctypes.c_void_p(lt.workspace.data.ptr),
                               lt.workspace.nbytes, ctypes.c_void_p(cp.cuda.get_current_stream().ptr))
    if st != 0:
        raise RuntimeError(f"cublasLtMatmul status {st}")


def main(argv=None) -> int:
    import cupy as cp
    import numpy as np
    import pandas as pd
    from andrea.backends.cuda.cublas import Cublas, cuda_type
    from andrea.backends.cuda.cublaslt import CublasLt

    ap = argparse.ArgumentParser(prog="python dev/cuda/gemm_shapes.py", description=__doc__.splitlines()[0])
    ap.add_argument("--exp", action="append", default=[])
    ap.add_argument("--batch", action="append", type=int, default=[])
    ap.add_argument("--algos", type=int, default=8, help="cuBLASLt heuristic algorithms to time per product")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args(argv)
    exps = a.exp or ["ANDREA-12M", "ANDREA-120M"]
    batches = a.batch or [32 if e == "ANDREA-12M" else 8 for e in exps]
    ct = np.float16  # the products' speed in bf16 is the same on Hopper's tensor cores
    rng = cp.random.default_rng(0)
    main_s, side_s = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    blas, blas2, lt = Cublas(), Cublas(), CublasLt()
    with side_s:
        blas2.bind_stream()
    rows = []
    for exp, B in zip(exps, batches):
        for name, N, OC, IC in shapes(exp, B):
            X = rng.standard_normal((N, IC), dtype=np.float32).astype(ct)
            W = (rng.standard_normal((OC, IC), dtype=np.float32) * 0.02).astype(ct)
            dY = rng.standard_normal((N, OC), dtype=np.float32).astype(ct)
            Y, dX = cp.empty((N, OC), ct), cp.empty((N, IC), ct)
            dW = cp.zeros((OC, IC), np.float32)
            WT = cp.ascontiguousarray(W.T)  # a transposed copy: dX in the Y product's layout
            fl = 2.0 * N * OC * IC
            prods = {
                "Y": (lambda: blas.gemm(Y, X, W, False, True, N, OC, IC, IC, IC, OC),
                      (Y, X, W, False, True, N, OC, IC, IC, IC, OC), 0.0),
                "dX": (lambda: blas.gemm(dX, dY, W, False, False, N, IC, OC, OC, IC, IC),
                       (dX, dY, W, False, False, N, IC, OC, OC, IC, IC), 0.0),
                "dW": (lambda: blas.gemm(dW, dY, X, True, False, OC, IC, N, OC, IC, IC, beta=1.0),
                       (dW, dY, X, True, False, OC, IC, N, OC, IC, IC), 1.0),
            }
            ms = graph_ms(lambda: blas.gemm(dX, dY, WT, False, True, N, IC, OC, OC, OC, IC), main_s, [blas], a.reps)
            rows.append(dict(exp=exp, layer=name, product="dX", how="cublas W^T copy", ms=ms, tflops=fl / ms / 1e9))
            for prod, (fn, args, beta) in prods.items():
                ms = graph_ms(fn, main_s, [blas], a.reps)
                rows.append(dict(exp=exp, layer=name, product=prod, how="cublas", ms=ms, tflops=fl / ms / 1e9))
                D, A_, B_, ta, tb, M, Nn, K, lda, ldb, ldd = args
                key = ("gemm_shapes", ta, tb, M, Nn, K, lda, ldb, ldd, cuda_type(A_.dtype), cuda_type(D.dtype))
                try:
                    plan, algos = lt_algos(lt, (key, ta, tb, M, Nn, K, lda, ldb, ldd, cuda_type(A_.dtype),
                                                cuda_type(D.dtype), "none", None, 0, 0, 0), a.algos)
                except Exception as e:  # noqa: BLE001 - a dev table: say it and go on
                    print(f"{exp} {name} {prod}: cuBLASLt: {e}")
                    algos = []
                for i, al in enumerate(algos):
                    ms = graph_ms(lambda: lt_run(lt, plan, al, D, A_, B_, beta), main_s, [blas], a.reps)
                    rows.append(dict(exp=exp, layer=name, product=prod, how=f"lt#{i} w{al.waves_count:.2f}",
                                     ms=ms, tflops=fl / ms / 1e9))
            if name == "classifier":
                continue
            # the backward pair, serial and on two streams
            dx_fn, dw_fn = prods["dX"][0], (lambda: blas2.gemm(dW, dY, X, True, False, OC, IC, N, OC, IC, IC, beta=1.0))

            def serial():
                dx_fn()
                prods["dW"][0]()

            def forked():
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(main_s)
                side_s.wait_event(ev)
                with side_s:
                    dw_fn()
                dx_fn()
                done = cp.cuda.Event(disable_timing=True)
                done.record(side_s)
                main_s.wait_event(done)

            for how, fn in (("pair serial", serial), ("pair two streams", forked)):
                ms = graph_ms(fn, main_s, [blas], a.reps)
                rows.append(dict(exp=exp, layer=name, product="dX+dW", how=how, ms=ms, tflops=2 * fl / ms / 1e9))
    df = pd.DataFrame(rows)
    pd.set_option("display.width", 200)
    pd.set_option("display.max_rows", 500)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    best = df[df["product"] != "dX+dW"].sort_values("ms").groupby(["exp", "layer", "product"], sort=False).head(1)
    cub = df[df["how"] == "cublas"].set_index(["exp", "layer", "product"])["ms"]
    best = best.set_index(["exp", "layer", "product"]).assign(cublas_ms=cub)
    print("\nfastest per product (cuBLAS default vs the best measured):")
    print(best.sort_index().to_string(float_format=lambda v: f"{v:.4f}"))
    if a.csv:
        df.to_csv(a.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
