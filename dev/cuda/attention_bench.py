"""Check, then time, the numbered fused-attention variants against PyTorch SDPA in one process.

    PYTHONPATH=. python dev/cuda/attention_bench.py [--variants v8,v8old] [--no-check] [--no-time] [--reps 20]

Each variant is a kernel source compiled by NVRTC (CuPy RawModule) per compute dtype and head
size: v4 is kernels/attention.cu (version 4, mma.sync, every GPU of compute capability 8.0 or
later); v6 is the first wgmma forward, dev/cuda/attention_v6.cu on compute capability 9.0, built
for sm_90a by attention_v6.py (superseded by version 8; kept as the base of wgmma_probe.cu), with
version 4's backward; v7 is version 4's forward with the wgmma backward of the package's
kernels/attention_hopper.cu, built and launched by attention_v7.py (its v7* entries: other -D
settings of that file); v8 is the package's Hopper path, the wgmma forward of attention_hopper.cu
through attention_v8.py with its backward (its v8* entries: other -D settings, v8old the settings
before version 10). A new candidate dev/cuda/attention_vN.cu is added to VARIANTS below, and
leaves with its entry once it has won or lost (git history keeps both, docs/BENCHMARKS.md the
figures).
Check (before any timing): every variant against the float64 NumPy reference
(andrea.backends.ref k_attn_fwd / k_attn_bwd) at T = 77 and 1000, head sizes 32/64/80/128
where the variant supports them, fp16 and bf16; outputs poisoned with NaN before the launch;
gradients added into a random pre-filled buffer; two reruns compared bit for bit. A variant that
fails a check is not timed. Time: forward (k_attn_flash_fwd) and backward (k_attn_flash_D +
dq + dkv, and each of the three alone: D_ms, dq_ms, dkv_ms) per call between CUDA events, times
the model's layers, at the ANDREA-12M and -120M
attention shapes, next to torch SDPA (flash, cuDNN, efficient) timed the same way in the same
process. Prints one table (pandas) and writes it as CSV under --out.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from andrea.backends import ref

ROOT = Path(__file__).resolve().parents[2]


def kernel_dir() -> Path:
    from andrea.paths import KERNEL_DIR
    return KERNEL_DIR


def load_sidecar(path: Path):
    """A dev/cuda launcher module (e.g. attention_v7.py), imported under its own name with its folder
    on sys.path, where the sidecars import each other from (attention_v7 imports attention_v6)."""
    import importlib
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    return importlib.import_module(path.stem)


class Variant:
    """One kernel source (a path, or a callable giving it) and its launch geometry."""

    def __init__(self, name, path, head_sizes, fwd_rows, dyn_smem, grid_bh_first):
        self.name, self.path, self.head_sizes = name, path, head_sizes
        self.fwd_rows, self.dyn_smem, self.grid_bh_first = fwd_rows, dyn_smem, grid_bh_first
        self._mods = {}

    def module(self, ct, hs):
        import cupy as cp
        key = (ct, hs)
        if key not in self._mods:
            from andrea.backends.cuda.runtime import kernel_source
            path = self.path() if callable(self.path) else self.path
            src = kernel_source(path, (kernel_dir(),))  # includes pasted, as the Runtime does
            self._mods[key] = cp.RawModule(code=src, options=("-std=c++17", f"-DCT={ct}", f"-DHS={hs}"))
        return self._mods[key]

    def fn(self, ct, hs, kernel):
        f = self.module(ct, hs).get_function(kernel)
        smem = self.dyn_smem(kernel, hs)
        if smem > 48 * 1024:
            f.max_dynamic_shared_size_bytes = smem
        return f, smem

    def grid(self, kernel, BH, T, hs):
        rows = self.fwd_rows(hs) if kernel == "k_attn_flash_fwd" else 64
        n = -(-T // rows)
        return (BH, n) if self.grid_bh_first else (n, BH)

    def fwd(self, ct, out, lse, qkv, B, T, NH, hs):
        f, smem = self.fn(ct, hs, "k_attn_flash_fwd")
        f(self.grid("k_attn_flash_fwd", B * NH, T, hs), (128,),
          (out, lse, qkv, np.int32(B), np.int32(T), np.int32(NH), np.float32(1 / math.sqrt(hs))), shared_mem=smem)

    def bwd_parts(self, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs):
        """{kernel: a function launching it} of the backward, in order (timed one by one too);
        None where the backward is not these three kernels."""
        fD, _ = self.fn(ct, hs, "k_attn_flash_D")
        parts = {"k_attn_flash_D": lambda: fD((-(-(B * NH * T) // 8),), (256,),
                                              (D, dout, out, np.int32(B), np.int32(T), np.int32(NH)))}
        for k in ("k_attn_flash_bwd_dq", "k_attn_flash_bwd_dkv"):
            f, smem = self.fn(ct, hs, k)
            # the last argument, accumulate = 1 (add into dqkv), as attention.cu's kernels take it
            parts[k] = (lambda f=f, smem=smem, k=k: f(
                self.grid(k, B * NH, T, hs), (128,), (dqkv, qkv, dout, lse, D, np.int32(B), np.int32(T),
                                                      np.int32(NH), np.float32(1 / math.sqrt(hs)), np.int32(1)),
                shared_mem=smem))
        return parts

    def bwd(self, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs):
        for launch in self.bwd_parts(ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs).values():
            launch()


class HopperForward(Variant):
    """Version 6 candidate: on compute capability 9.0 the forward is attention_v6.cu built for sm_90a
    (wgmma) and launched as attention_v6.py launches it; the backward, and the forward elsewhere,
    are version 4's code from the same file (built by RawModule for the device's own arch)."""

    def __init__(self, *args):
        super().__init__(*args)
        self._sm90a = {}
        self._sidecar = None

    sidecar_path = None  # the launcher module; None: the .cu file's name with .py

    def sidecar(self):
        """The variant's launcher module (sidecar_path, or its .cu file's name with .py)."""
        if self._sidecar is None:
            self._sidecar = load_sidecar(self.sidecar_path or self.path.with_suffix(".py"))
        return self._sidecar

    def fwd(self, ct, out, lse, qkv, B, T, NH, hs):
        if not self.sidecar().is_hopper():
            return super().fwd(ct, out, lse, qkv, B, T, NH, hs)
        self.sidecar().launch_fwd(self._sm90a, ct, out, lse, qkv, B, T, NH, hs)


class HopperBackward(HopperForward):
    """Version 7: version 4's forward and, on compute capability 9.0, the wgmma backward of the
    package's attention_hopper.cu (dQ and dK/dV, 256 threads a block), built and launched by
    attention_v7.py; elsewhere version 4's kernels. tune: attention_v7.py's -D settings (e.g.
    {"bq": 32, "dkv_blocks": 2}), applied to the sm_90a build."""
    sidecar_path = ROOT / "dev" / "cuda" / "attention_v7.py"

    def __init__(self, *args, tune=None):
        super().__init__(*args)
        self.tune = tune

    def fwd(self, ct, out, lse, qkv, B, T, NH, hs):
        return Variant.fwd(self, ct, out, lse, qkv, B, T, NH, hs)

    def bwd_parts(self, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs):
        if not self.sidecar().is_hopper():
            return super().bwd_parts(ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs)
        return self.sidecar().launch_bwd_parts(self._sm90a, ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs,
                                               self.tune)


class HopperForward8(HopperBackward):
    """Version 8: on compute capability 9.0 the wgmma forward of the package's attention_hopper.cu
    (built and launched by attention_v8.py, fwd_tune: its -D settings, e.g. {"wg": 3}) with version
    7's backward from the same file; elsewhere version 4's kernels."""

    SHARED = {}  # the sm_90a modules of every v8 entry (keys name the settings): each built once

    def __init__(self, *args, fwd_tune=None, tune=None):
        super().__init__(*args, tune=tune)
        self.fwd_tune = fwd_tune
        self._sm90a = self.SHARED

    def v8(self):
        return load_sidecar(DEV / "attention_v8.py")

    def fwd(self, ct, out, lse, qkv, B, T, NH, hs):
        if not self.sidecar().is_hopper():
            return Variant.fwd(self, ct, out, lse, qkv, B, T, NH, hs)
        self.v8().launch_fwd(self._sm90a, ct, out, lse, qkv, B, T, NH, hs, self.fwd_tune)

    def builds(self, ct, hs):
        """(cache key, source path, -D options) of the sm_90a modules this entry launches."""
        out = []
        for mod, tune in ((self.v8(), self.fwd_tune), (self.sidecar(), self.tune)):
            key, defs = mod.build(ct, hs, tune)
            out.append((key, mod.SOURCE, defs))
        return out


def _compile_job(job):
    """One sm_90a build in a worker process (attention_v6.compile_sm90a): (key, cubin bytes)."""
    key, path, ct, defs = job
    sys.path.insert(0, str(ROOT))
    v6 = load_sidecar(DEV / "attention_v6.py")
    return key, v6.compile_sm90a(v6.source(Path(path)), Path(path).name, ct, defs)


def prebuild(names, dtypes):
    """Build every sm_90a module the v8 entries in names need, in parallel worker processes (NVRTC
    takes seconds a build), into HopperForward8.SHARED; the same options as attention_v6.py's."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp
    jobs = {}
    for n in names:
        v = VARIANTS[n]
        if not isinstance(v, HopperForward8) or not v.sidecar().is_hopper():
            continue
        for dt in dtypes:
            for hs in v.head_sizes:
                for key, path, defs in v.builds(DTYPES[dt][0], hs):
                    if key not in HopperForward8.SHARED:
                        jobs[key] = (key, str(path), DTYPES[dt][0], defs)
    if not jobs:
        return
    v6 = VARIANTS["v6"].sidecar()
    with ProcessPoolExecutor(max_workers=min(16, len(jobs)), mp_context=mp.get_context("spawn")) as ex:
        for key, cubin in ex.map(_compile_job, jobs.values()):
            HopperForward8.SHARED[key] = v6.Sm90aModule(cubin)
    print(f"prebuilt {len(jobs)} sm_90a modules", flush=True)


def v4_smem(kernel, hs):
    lds, bq = hs + 8, (64 if hs <= 64 else 32)
    return {"k_attn_flash_fwd": ((128 if hs <= 64 else 64) + 4 * 64) * lds * 2,
            "k_attn_flash_bwd_dq": (2 * 64 + 4 * 64) * lds * 2,
            "k_attn_flash_bwd_dkv": (2 * 64 + 4 * bq) * lds * 2 + 4 * bq * 4}.get(kernel, 0)


DEV = ROOT / "dev" / "cuda"
VARIANTS = {
    "v4": Variant("v4", lambda: kernel_dir() / "attention.cu", (32, 64, 80, 128), lambda hs: 128 if hs <= 64 else 64,
                  v4_smem, True),
    "v6": HopperForward("v6", DEV / "attention_v6.cu", (32, 64, 80, 128), lambda hs: 128 if hs <= 64 else 64,
                        v4_smem, True),
    "v7": HopperBackward("v7", lambda: kernel_dir() / "attention_hopper.cu", (32, 64, 80, 128), lambda hs: 128 if hs <= 64 else 64,
                         v4_smem, True),
    # v7 with other -D settings (attention_v7.py's TUNABLE), checked and timed at head size 64 only,
    # each on top of the defaults (dK/dV one warpgroup a block, three blocks a multiprocessor) unless
    # it sets kwg and dkv_blocks: version 6's core-matrix tiles instead of 128-byte swizzled ones (with
    # the two-warpgroup dK/dV block they were measured with); each product group waited for
    # at once (what the overlap inside a warpgroup gains); 32 queries a dK/dV tile (138 registers);
    # three warpgroups (192 keys) a dK/dV block with 32 queries a tile; 128 keys a dQ tile (210
    # registers, one block a multiprocessor); 48 queries a dK/dV tile, with two or three warpgroups
    # (160 registers: three fit one multiprocessor)
    **{name: HopperBackward(name, lambda: kernel_dir() / "attention_hopper.cu", (64,), lambda hs: 128 if hs <= 64 else 64, v4_smem, True,
                            tune=tune)
       for name, tune in (("v7cm", {"swizzle": 0, "kwg": 2, "dkv_blocks": 1}), ("v7s", {"overlap": 0}), ("v7q32", {"bq": 32}),
                          ("v7k3", {"kwg": 3, "bq": 32, "dkv_blocks": 1}), ("v7n128", {"bn": 128, "dq_blocks": 1}),
                          ("v7q48", {"bq": 48}), ("v7k3q48", {"kwg": 3, "bq": 48, "dkv_blocks": 1}))},
    "v8": HopperForward8("v8", lambda: kernel_dir() / "attention_hopper.cu", (16, 32, 64, 80, 128),
                         lambda hs: 128 if hs <= 64 else 64, v4_smem, True),
    # v8 with other -D settings (attention_v8.py's TUNABLE), checked and timed at head size 64 only:
    # o: the previous tile's P V overlapping the softmax (with t4: four stages of K and V); w3n128: three
    # warpgroups (192 rows) and 128-key tiles, one block a multiprocessor, with the overlap, and without
    # it (s); w1b4: one warpgroup, four blocks a multiprocessor; cm: core-matrix tiles instead of
    # swizzled ones (the backward's too, in the same build)
    **{name: HopperForward8(name, lambda: kernel_dir() / "attention_hopper.cu", (64,), lambda hs: 128, v4_smem, True,
                            fwd_tune=tune)
       for name, tune in (("v8o", {"overlap": 1}), ("v8o4", {"overlap": 1, "stages": 4}),
                          ("v8w3n128", {"wg": 3, "bn": 128, "blocks": 1, "overlap": 1}),
                          ("v8w3n128s", {"wg": 3, "bn": 128, "blocks": 1}),
                          ("v8w1b4", {"wg": 1, "blocks": 4}), ("v8cm", {"swizzle": 0}))},
    # the package's settings before version 10 (dK/dV two warpgroups a block, one block a
    # multiprocessor; version 7's tile copies in both directions), with version 10's dQ kernel; the
    # dQ kernel with one warpgroup a block and four blocks a multiprocessor
    **{name: HopperForward8(name, lambda: kernel_dir() / "attention_hopper.cu", (64,), lambda hs: 128, v4_smem, True,
                            fwd_tune=fwd, tune=bwd)
       for name, fwd, bwd in (("v8old", {"loads": 0}, {"kwg": 2, "dkv_blocks": 1, "loads": 0}),
                              ("v7w1", None, {"dqwg": 1, "dq_blocks": 4}))},
}
DTYPES = {"fp16": ("f16", np.float16), "bf16": ("bf16", None)}


def host_dtype(name):
    if name == "bf16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.float16


def to_dev(x64, name):
    """float64 host array -> (device uint16 bits, float64 values as rounded)."""
    import cupy as cp
    h = x64.astype(host_dtype(name))
    return cp.asarray(h.view(np.uint16)), h.astype(np.float64)


def from_dev(a, name):
    import cupy as cp
    return cp.asnumpy(a).view(host_dtype(name)).astype(np.float64)


def rel(got, want):
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check(v: Variant, name, hs, T, rng, B=2, NH=2):
    import cupy as cp
    ct, C = DTYPES[name][0], NH * hs
    tol = 1e-2 if name == "fp16" else 3e-2
    qkv_d, qkv = to_dev(rng.standard_normal((B, T, 3 * C)), name)
    out, lse = np.zeros((B, T, C)), np.zeros((B, NH, T))
    ref.k_attn_fwd(out, lse, qkv, NH)
    runs = []
    for _ in range(2):
        g_out = cp.full((B, T, C), 0x7e00 if name == "fp16" else 0x7fc0, dtype=cp.uint16)  # NaN bits
        g_lse = cp.full((B, NH, T), np.nan, dtype=cp.float32)
        v.fwd(ct, g_out, g_lse, qkv_d, B, T, NH, hs)
        runs.append((g_out, g_lse))
    e_out = rel(from_dev(runs[0][0], name), out)
    e_lse = rel(cp.asnumpy(runs[0][1]).astype(np.float64), lse)
    same_f = all(bool((a == b).all()) for a, b in zip(runs[0], runs[1]))
    out_d, out_r = to_dev(out, name)  # the backward pass reads the saved (rounded) output
    dout_d, dout = to_dev(rng.standard_normal((B, T, C)), name)
    lse_d = cp.asarray(lse.astype(np.float32))
    dqkv = np.zeros_like(qkv)
    ref.k_attn_bwd(dqkv, dout, qkv, out_r, lse_d.get().astype(np.float64), NH)
    pre_d, pre = to_dev(rng.standard_normal(qkv.shape) * float(np.sqrt(np.mean(dqkv ** 2))), name)
    D = cp.empty((B * NH * T,), dtype=cp.float32)
    grads = []
    for _ in range(2):
        g = pre_d.copy()
        v.bwd(ct, g, dout_d, qkv_d, out_d, lse_d, D, B, T, NH, hs)
        grads.append(g)
    cp.cuda.runtime.deviceSynchronize()
    parts = {}
    got = from_dev(grads[0], name) - pre
    for i, part in enumerate(("dq", "dk", "dv")):
        sl = slice(i * C, (i + 1) * C)
        parts[part] = rel(got[..., sl], dqkv[..., sl])
    same_b = bool((grads[0] == grads[1]).all())
    errs = {"out": e_out, "lse": e_lse, **parts}
    ok = e_out < tol and e_lse < 1e-3 and all(parts[p] < tol for p in parts) and same_f and same_b
    return dict(variant=v.name, dtype=name, hs=hs, T=T, ok=ok, bitwise=same_f and same_b,
                **{f"err_{k}": f"{e:.2e}" for k, e in errs.items()})


def cuda_ms(fn, reps):
    from andrea.backends.cuda.graphs import event_ms
    return event_ms(fn, reps, warmup=3)


SHAPES = {"120M": (8, 12, 1024, 64, 12), "12M": (32, 6, 256, 64, 6)}
PART_COLUMNS = {"k_attn_flash_D": "D_ms", "k_attn_flash_bwd_dq": "dq_ms", "k_attn_flash_bwd_dkv": "dkv_ms"}


def time_ours(v: Variant, name, shape, reps):
    import cupy as cp
    B, NH, T, hs, L = shape
    ct, C = DTYPES[name][0], NH * hs
    rng = np.random.default_rng(1)
    qkv, _ = to_dev(rng.standard_normal((B, T, 3 * C)), name)
    out = cp.empty((B, T, C), dtype=cp.uint16)
    lse = cp.empty((B, NH, T), dtype=cp.float32)
    v.fwd(ct, out, lse, qkv, B, T, NH, hs)
    dout, _ = to_dev(rng.standard_normal((B, T, C)), name)
    dqkv = cp.zeros_like(qkv)
    D = cp.empty((B * NH * T,), dtype=cp.float32)
    f = cuda_ms(lambda: v.fwd(ct, out, lse, qkv, B, T, NH, hs), reps)
    b = cuda_ms(lambda: v.bwd(ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs), reps)
    parts = v.bwd_parts(ct, dqkv, dout, qkv, out, lse, D, B, T, NH, hs) or {}
    return f * L, b * L, {PART_COLUMNS[k]: cuda_ms(fn, reps) * L for k, fn in parts.items()}


def time_sdpa(shape, reps, name):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, NH, T, hs, L = shape
    dt = torch.float16 if name == "fp16" else torch.bfloat16
    rows = {}
    for label, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                      ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        q, k, v = (torch.randn(B, NH, T, hs, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        do = torch.randn(B, NH, T, hs, device="cuda", dtype=dt)

        def timeit(fn):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            for _ in range(reps):
                fn()
            e.record()
            torch.cuda.synchronize()
            return s.elapsed_time(e) / reps

        try:
            with sdpa_kernel(be):
                tf = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                tfb = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do))
            rows[label] = (tf * L, (tfb - tf) * L)
        except Exception as ex:  # a backend missing for this dtype/shape: reported, not fatal
            print(f"{label} {name}: {type(ex).__name__}: {str(ex)[:100]}")
    return rows


def main(argv=None):
    import pandas as pd
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtypes", default="fp16,bf16", help="dtypes timed (all are checked)")
    ap.add_argument("--check-t", default="77,1000", help="sequence lengths checked")
    ap.add_argument("--out", default=None, help="folder for checks.csv and times.csv")
    a = ap.parse_args(argv)
    names = a.variants.split(",")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known {list(VARIANTS)}")
    passed = set(names)
    prebuild(names, list(DTYPES))
    if not a.no_check:
        rng = np.random.default_rng(0)
        rows = []
        for n in names:
            for dt in DTYPES:
                for hs in VARIANTS[n].head_sizes:
                    for T in (int(x) for x in a.check_t.split(",")):
                        try:
                            rows.append(check(VARIANTS[n], dt, hs, T, rng))
                        except Exception as ex:
                            rows.append(dict(variant=n, dtype=dt, hs=hs, T=T, ok=False, error=f"{type(ex).__name__}: {ex}"[:200]))
                        print(rows[-1], flush=True)
        checks = pd.DataFrame(rows)
        print(checks.to_string(index=False))
        failed = set(checks.loc[~checks["ok"], "variant"])
        passed -= failed
        if failed:
            print(f"FAILED checks: {sorted(failed)} (not timed)")
        if a.out:
            checks.to_csv(Path(a.out) / "checks.csv", index=False)
    if a.no_time:
        return 0 if passed == set(names) else 1
    rows = []
    for dt in a.dtypes.split(","):
        for shape_name, shape in SHAPES.items():
            for n in names:
                if n in passed:
                    f, b, parts = time_ours(VARIANTS[n], dt, shape, a.reps)
                    rows.append(dict(shape=shape_name, dtype=dt, kernel=f"andrea-{n}", fwd_ms=f, bwd_ms=b, **parts))
            for label, (f, b) in time_sdpa(shape, a.reps, dt).items():
                rows.append(dict(shape=shape_name, dtype=dt, kernel=label, fwd_ms=f, bwd_ms=b))
    times = pd.DataFrame(rows)
    times["total_ms"] = times["fwd_ms"] + times["bwd_ms"]
    cudnn = times[times["kernel"] == "sdpa-cudnn"].set_index(["shape", "dtype"])["total_ms"]
    flash = times[times["kernel"] == "sdpa-flash"].set_index(["shape", "dtype"])["total_ms"]
    key = pd.MultiIndex.from_frame(times[["shape", "dtype"]])
    times["vs_cudnn"] = times["total_ms"].to_numpy() / cudnn.reindex(key).to_numpy()
    times["vs_flash"] = times["total_ms"].to_numpy() / flash.reindex(key).to_numpy()
    cudnn_b = times[times["kernel"] == "sdpa-cudnn"].set_index(["shape", "dtype"])["bwd_ms"]
    times["bwd_vs_cudnn"] = times["bwd_ms"].to_numpy() / cudnn_b.reindex(key).to_numpy()
    print(times.round(3).to_string(index=False))
    if a.out:
        times.to_csv(Path(a.out) / "times.csv", index=False)
    return 0 if passed == set(names) else 1


if __name__ == "__main__":
    sys.exit(main())
