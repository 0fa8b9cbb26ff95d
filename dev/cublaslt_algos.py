"""Is cuBLASLt's first pick the fastest? Every matrix product of one training step against the other
algorithms cuBLASLt's heuristic offers for the same problem, and the classifier's cuBLAS products
against cuBLASLt in the same 16-bit types and in FP8.

    python dev/cublaslt_algos.py --exp ANDREA-120M --precision fp8 --batch 8 [--algos 16] [--csv out.csv]

The engine runs one step eagerly with the cuBLASLt and cuBLAS bindings wrapped, so every problem
is recorded with its arrays (the engine's own buffers) and how often a step runs it. Then each
problem's plan (descriptor, layouts) is asked for --algos heuristic results, and each is timed on
those arrays (CUDA events, after warm-up; outputs are scratch once the step is done). The
classifier's products (cuBLAS, 16-bit) are timed as they run, then as cuBLASLt problems of the
same types, and as the FP8 "TN" products they would become (E4M3 operands of random bytes, bf16
or float32 out). Prints one table (pandas) and the step's total at the first pick and at the best.
Needs a CUDA GPU with CuPy. A choice other than the first pick would have to be fixed per GPU and
library (a table in the repository), since the algorithm sets the bits of the result.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FP8_E4M3, BF16, F32 = 28, 14, 0  # cudaDataType_t


def record(lt, blas):
    """Wrap lt.matmul and blas.gemm: {key: {"n": calls, "call": (args, kwargs)}} for each."""
    lt_calls, gemm_calls, cur = {}, {}, {}
    plan0, matmul0, gemm0 = lt.plan, lt.matmul, blas.gemm

    def plan(key, *a, **k):
        cur["key"] = key
        return plan0(key, *a, **k)

    def matmul(*a, **k):
        out = matmul0(*a, **k)
        e = lt_calls.setdefault(cur["key"], {"n": 0})
        e["n"] += 1
        e["call"] = (a, k)
        return out

    def gemm(C, A, B, ta, tb, M, N, K, lda, ldb, ldc, alpha=1.0, beta=0.0, batch=1, **k):
        gemm0(C, A, B, ta, tb, M, N, K, lda, ldb, ldc, alpha=alpha, beta=beta, batch=batch, **k)
        if batch == 1:
            e = gemm_calls.setdefault((ta, tb, M, N, K, str(A.dtype), str(C.dtype), beta), {"n": 0})
            e["n"] += 1
            e["call"] = (C, A, B, ta, tb, M, N, K, lda, ldb, ldc, alpha, beta)

    lt.plan, lt.matmul, blas.gemm = plan, matmul, gemm
    return lt_calls, gemm_calls


def elapsed_us(fn, reps):
    from andrea.backends.cuda.graphs import event_ms
    return event_ms(fn, reps, warmup=3) * 1e3


def algos(lt, plan, n):
    """The first n heuristic results of a planned problem (state 0 only), first pick first."""
    from andrea.backends.cuda.cublaslt import _Heuristic
    desc, lay_b, lay_a, lay_d, _ = plan
    arr, cnt = (_Heuristic * n)(), ctypes.c_int(0)
    st = lt.lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, desc, lay_b, lay_a, lay_d, lay_d, lt.pref, n,
                                               ctypes.cast(arr, ctypes.POINTER(_Heuristic)), ctypes.byref(cnt))
    return [] if st else [arr[i] for i in range(cnt.value) if arr[i].state == 0]


def time_lt(lt, plan, D, A, B, beta, n, reps):
    """{index: us} for each heuristic result of plan on arrays D, A, B (our row-major roles)."""
    import cupy as cp
    from andrea.backends.cuda.cublaslt import WORKSPACE_BYTES
    desc, lay_b, lay_a, lay_d, _ = plan
    alpha, bt = ctypes.c_float(1.0), ctypes.c_float(beta)
    out = {}
    for i, h in enumerate(algos(lt, plan, n)):
        def call(h=h):
            st = lt.lib.cublasLtMatmul(
                lt.handle, desc, ctypes.byref(alpha), ctypes.c_void_p(B.data.ptr), lay_b,
                ctypes.c_void_p(A.data.ptr), lay_a, ctypes.byref(bt), ctypes.c_void_p(D.data.ptr), lay_d,
                ctypes.c_void_p(D.data.ptr), lay_d, ctypes.byref(h.algo), ctypes.c_void_p(lt.workspace.data.ptr),
                WORKSPACE_BYTES, ctypes.c_void_p(cp.cuda.get_current_stream().ptr))
            if st:
                raise RuntimeError(f"status {st}")
        try:
            out[i] = elapsed_us(call, reps)
        except RuntimeError:
            continue
    return out


def row(kind, what, n, M, N, K, timings):
    """One table row: the first pick's time and the best. kind: "step" (a cuBLASLt problem of the
    step), "cublas" (a classifier product as it runs), "lt16" / "fp8" (the same on cuBLASLt)."""
    if not timings:
        return {"kind": kind, "product": what, "calls": n, "M": M, "N": N, "K": K, "algos": 0}
    best = min(timings, key=timings.get)
    return {"kind": kind, "product": what, "calls": n, "M": M, "N": N, "K": K, "algos": len(timings),
            "first_us": round(timings.get(0, np.nan), 1), "best_us": round(timings[best], 1), "best_index": best,
            "tflops_best": round(2 * M * N * K / timings[best] / 1e6, 0)}


def lt_classifier(lt, cls, M, N, K, ta, tb, ab, d, n, reps, beta):
    """A cuBLASLt problem of the classifier's shape: 16-bit as cuBLAS ran it, or FP8 (TN)."""
    import cupy as cp
    fp8 = ab == FP8_E4M3
    dt = {BF16: "bfloat16", F32: np.float32, 2: np.float16}  # cudaDataType_t
    if fp8:
        ta, tb = False, True
        A = cp.random.randint(0x20, 0x48, (M, K), dtype=np.uint8)
        B = cp.random.randint(0x20, 0x48, (N, K), dtype=np.uint8)
        one = cp.ones(1, np.float32)
        scales = (one, one)
    else:
        A, B = cls[1], cls[2]
        scales = None
    D = cp.zeros((M, N), dtype=dt[d]) if fp8 else cls[0]
    lda, ldb = A.shape[-1], B.shape[-1]
    key = ("dev", ta, tb, M, N, K, ab, d, beta)
    plan = lt.plan(key, ta, tb, M, N, K, lda, ldb, N, ab, d, "none", None, 0, 0, 0, None,
                   None if scales is None else tuple(s.data.ptr for s in scales), False)
    return time_lt(lt, plan, D, A, B, beta, n, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exp", default="ANDREA-120M")
    ap.add_argument("--precision", default="fp8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--algos", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--csv")
    args = ap.parse_args(argv)
    import cupy as cp

    from andrea.backends import get_backend
    from andrea.backends.cuda.cublas import cuda_type
    from andrea.bench.step import bench_config
    from andrea.core.engine import Engine

    cfg = bench_config(args.exp, args.precision, args.batch, 4)
    m, T = cfg.model, cfg.model.context
    be = get_backend("cuda")
    eng = Engine(cfg, backend=be)
    eng._run = lambda key, fn: fn()  # eager, so the wrappers see every call
    xy = np.random.default_rng(0).integers(0, m.vocab_size, (args.batch, T + 1)).astype(np.int32)
    batch = [(xy[:, :-1], xy[:, 1:])]
    eng.train_step(1, batch)  # plans every problem
    lt, blas = be.lt, be.blas
    lt_calls, gemm_calls = record(lt, blas)
    eng.train_step(2, batch)
    cp.cuda.Device().synchronize()
    del lt.plan, lt.matmul, blas.gemm  # the bindings' own methods again: the timing runs are not counted

    rows = []
    for key, e in lt_calls.items():
        a, k = e["call"]
        D, A, B, ta, tb, M, N, K = a[:8]
        epi = a[13] if len(a) > 13 else k.get("epilogue", "none")
        what = f"lt {'fp8' if k.get('scales') else str(A.dtype)} {epi}" + (" beta" if k.get("beta") else "")
        rows.append(row("step", what, e["n"], M, N, K, time_lt(lt, lt.plans[key], D, A, B, k.get("beta", 0.0),
                                                        args.algos, args.reps)))
    for key, e in gemm_calls.items():
        C, A, B, ta, tb, M, N, K, lda, ldb, ldc, alpha, beta = e["call"]
        t_cublas = elapsed_us(lambda: blas.gemm(C, A, B, ta, tb, M, N, K, lda, ldb, ldc, alpha=alpha, beta=beta),
                              args.reps)
        tag = f"{'T' if ta else 'N'}{'T' if tb else 'N'}" + (" beta" if beta else "")
        rows.append(row("cublas", f"cublas {A.dtype} {tag}", e["n"], M, N, K, {0: t_cublas}))
        ab, d = cuda_type(A.dtype), cuda_type(C.dtype)
        rows.append(row("lt16", f"lt {A.dtype} {tag}", e["n"], M, N, K,
                        lt_classifier(lt, e["call"], M, N, K, ta, tb, ab, d, args.algos, args.reps, beta)))
        rows.append(row("fp8", f"lt fp8 TN{' beta' if beta else ''}", e["n"], M, N, K,
                        lt_classifier(lt, e["call"], M, N, K, ta, tb, FP8_E4M3, d, args.algos, args.reps, beta)))
    df = pd.DataFrame(rows)
    df["first_step_us"] = df.calls * df.first_us
    df["best_step_us"] = df.calls * df.best_us
    pd.set_option("display.width", 200)
    print(df.to_string(index=False))
    per_kind = df.groupby("kind")[["first_step_us", "best_step_us"]].sum() / 1e3
    print("\nms a step by kind (first pick, best of the heuristic's list):")
    print(per_kind.round(3).to_string())
    if args.csv:
        df.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
