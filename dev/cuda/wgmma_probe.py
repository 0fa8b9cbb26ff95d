"""Check each Hopper building block of attention_v6.cu's forward against NumPy, one line per probe.

    python dev/cuda/wgmma_probe.py                      # fp16 and bf16, head sizes 64, 80, 128
    python dev/cuda/wgmma_probe.py --hs 64 --dtype fp16

Run from the repository root with the package importable (pip install -e . or PYTHONPATH=.), on
a GPU of compute capability 9.0 with CuPy (and ml_dtypes for bf16). The kernels are those of
wgmma_probe.cu, which includes attention_v6.cu, compiled by NVRTC for sm_90a exactly as
attention_v6.py compiles the forward (-DHS sets the head size; V6_BN keys per tile follow from it).
Probes, in the order a layout bug would show up:
  build     the module has the wgmma code at all (V6_WGMMA = 1)
  layout    load_tile6's cp.async copies land in the documented core-matrix layout (bit-exact),
            rows past T zero-filled
  ss        S = A B^T through wgmma with A, B K-major in shared memory (desc_kmajor)
  rs        O = P V through wgmma with P from registers (p_frags) and V MN-major (desc_mnmajor)
  pipeline  the two-deep cp.async pipeline of the forward (three key tiles, the last partial)
The products are exact in fp32 up to rounding of the sums (tolerance 1e-4 relative). When ss or rs
fails, it is rerun with the descriptors' LBO and SBO exchanged, and the line says whether that passes.
Prints PASS/FAIL lines and exits 1 if any probe fails.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TOL = 1e-4
SWAP_SMEM = 160 * 1024  # shared memory of the exchanged-descriptor reruns


def load_sidecar():
    import attention_v6  # beside this script, whose folder is on sys.path
    return attention_v6


def host_dtype(name):
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def rounded(rng, shape, name):
    """(device uint16 bits, float64 values) of a standard normal matrix rounded to the dtype."""
    import cupy as cp
    h = rng.standard_normal(shape).astype(host_dtype(name))
    return cp.asarray(h.view(np.uint16)), h.astype(np.float64)


def rel(got, want) -> float:
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def core_offsets(rows: int, hs: int):
    """16-bit offset of element (r, c) of a staged tile (attention_v6.cu's layout)."""
    r, c = np.meshgrid(np.arange(rows), np.arange(hs), indexing="ij")
    return (r // 8) * 8 * hs + (c // 8) * 64 + (r % 8) * 8 + c % 8


def run_probes(v6, name: str, hs: int, rng) -> list:
    """[(probe, ok, detail)] for one dtype and head size."""
    import cupy as cp
    ct = {"fp16": "f16", "bf16": "bf16"}[name]
    bn = v6.geometry(hs)["keys"]
    mod = v6.Sm90aModule(v6.compile_sm90a(v6.source(HERE / "wgmma_probe.cu"), "wgmma_probe.cu", ct, (f"-DHS={hs}",)))
    i32 = np.int32
    out = []

    flag = cp.full((1,), -1, dtype=cp.int32)
    mod.launch("probe_has_wgmma", (1,), (1,), (flag,))
    has = int(flag.get()[0])
    out.append(("build", has == 1, "V6_WGMMA = 1" if has == 1 else
                f"V6_WGMMA = {has}: the sm_90a build did not select the wgmma code (see V6_SM90A)"))
    if has != 1:
        return out

    # layout: rows [40, 104) of a 77-row slice with row stride 3 * hs
    T, r0, ld = 77, 40, 3 * hs
    src_d, src = rounded(rng, (T, ld), name)
    dump = cp.full((64 * hs,), 0xFFFF, dtype=cp.uint16)
    mod.launch("probe_layout", (1,), (128,), (dump, src_d, i32(r0), i32(T), i32(ld)), shared_mem=64 * hs * 2)
    want = np.zeros(64 * hs, dtype=np.uint16)
    bits = src_d.get()
    rows = np.arange(64) + r0  # (64,): indexing with it gives (64, hs), not (64, 1, hs)
    vals = np.where((rows < T)[:, None], bits[np.minimum(rows, T - 1), :hs], 0).astype(np.uint16)
    want[core_offsets(64, hs).ravel()] = vals.ravel()
    got = dump.get()
    bad = int((got != want).sum())
    out.append(("layout", bad == 0, f"{bad} of {64 * hs} words misplaced" if bad else "bit-exact, rows >= T zero"))

    def product(kernel, args_of, want, shape, smem):
        errs = []
        for swap in (0, 1):
            d = cp.full(shape, np.nan, dtype=cp.float32)
            # exchanged strides reach further: give that run room so that it reads garbage, not past the end
            mod.launch(kernel, (1,), (128,), args_of(d, swap), shared_mem=smem if swap == 0 else SWAP_SMEM)
            errs.append(rel(d.get().astype(np.float64), want))
            if swap == 0 and errs[0] < TOL:
                return True, f"rel err {errs[0]:.2e}"
        hint = ("passes with LBO and SBO exchanged: swap them in desc_kmajor/desc_mnmajor" if errs[1] < TOL
                else "fails with LBO and SBO exchanged too (layout, fragment order or fences)")
        return False, f"rel err {errs[0]:.2e}; {hint} (swapped: {errs[1]:.2e})"

    a_d, a = rounded(rng, (64, hs), name)
    b_d, b = rounded(rng, (bn, hs), name)
    ok, detail = product("probe_ss", lambda d, s: (d, a_d, b_d, i32(s)), a @ b.T, (64, bn), (64 + bn) * hs * 2)
    out.append((f"ss m64n{bn}k16 x{hs // 16}", ok, detail))

    p = rng.random((64, bn)).astype(np.float32)
    p_r = p.astype(host_dtype(name)).astype(np.float64)  # p_frags rounds P to the dtype (round to nearest)
    v_d, v = rounded(rng, (bn, hs), name)
    ok, detail = product("probe_rs", lambda d, s: (d, cp.asarray(p), v_d, i32(s)), p_r @ v, (64, hs), bn * hs * 2)
    out.append((f"rs m64n{hs}k16 x{bn // 16} (B transposed)", ok, detail))

    T = 2 * bn + 37
    bb_d, bb = rounded(rng, (T, hs), name)
    n_tiles = -(-T // bn)
    pad = np.zeros((n_tiles * bn, hs))
    pad[:T] = bb
    d = cp.full((64, bn), np.nan, dtype=cp.float32)
    mod.launch("probe_pipeline", (1,), (128,), (d, a_d, bb_d, i32(T)), shared_mem=(64 + 2 * bn) * hs * 2)
    err = rel(d.get().astype(np.float64), a @ pad.reshape(n_tiles, bn, hs).sum(0).T)
    out.append((f"pipeline {n_tiles} tiles, T={T}", err < TOL, f"rel err {err:.2e}"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/cuda/wgmma_probe.py", description=__doc__.splitlines()[0])
    ap.add_argument("--hs", default="64,80,128", help="comma list of head sizes (multiples of 16 up to 128)")
    ap.add_argument("--dtype", default="fp16,bf16", help="comma list of fp16, bf16")
    a = ap.parse_args(argv)
    import cupy as cp
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"device {dev.id}: {name}, compute capability {dev.compute_capability}")
    if int(dev.compute_capability) != 90:
        print("FAIL: wgmma needs compute capability 9.0 (sm_90a)")
        return 1
    v6 = load_sidecar()
    failed = 0
    rng = np.random.default_rng(0)
    for dt in a.dtype.split(","):
        for hs in (int(x) for x in a.hs.split(",")):
            try:
                rows = run_probes(v6, dt, hs, rng)
            except Exception as ex:  # a compile error or a trap: reported, and the other builds still run
                rows = [("compile/launch", False, f"{type(ex).__name__}: {str(ex)[:2000]}")]
            for probe, ok, detail in rows:
                failed += not ok
                print(f"{'PASS' if ok else 'FAIL'} {dt} hs={hs} {probe}: {detail}", flush=True)
            if any("CUDA_ERROR" in d or "cudaError" in d or "illegal" in d for _, _, d in rows):
                print("a kernel faulted (trap or bad address) and the CUDA context is lost: stopping here")
                return 1
    print(f"{failed} probe(s) failed" if failed else "all probes passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
