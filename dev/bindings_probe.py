"""Our ctypes bindings against NVIDIA's typed ones: the same bits, CUDA-graph capture, launch cost.

    python dev/bindings_probe.py [--json FILE] [--launches 20000] [--calls 5000] [--rounds 3]

Three pairs, each "ours" (andrea/backends/cuda/) against "theirs":

1. launch: kernels/residual.cu's k_residual_add (float32, compiled by Runtime.function) launched
   with the programmatic-stream-serialization attribute through pdl.Driver.launch (ctypes
   cuLaunchKernelEx, called as Runtime.launch calls it) and through cuda-bindings'
   cuda.bindings.driver.cuLaunchKernelEx (a CUlaunchConfig carrying one CUlaunchAttribute
   CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, the kernel's parameters as the documented
   ((values), (ctypes types)) pair). Checked: a chain t = a + b, out = t + a over 1,000,003
   elements bit for bit against NumPy, eagerly and captured in a CUDA graph and replayed. Timed:
   host microseconds per launch over --launches launches of 4,099 elements (a warm-up first);
   also CuPy's own kernel call (no attribute) and the whole Runtime.launch, for scale.
2. cuBLAS: cublas.Cublas.gemm against nvmath-python's nvmath.bindings.cublas (create,
   set_math_mode DEFAULT_MATH, set_stream then set_workspace of the same 32 MiB, gemm_ex with
   COMPUTE_32F and GEMM_DEFAULT, host alpha/beta), wrapped as Cublas.gemm is (row-major, same
   operand swap). fp16 and bf16 products at odd sizes, two of them accumulating into float32
   with beta = 1. Checked: theirs bit for bit against ours, each captured and replayed against
   its eager result. Timed: device microseconds per product at the big size (CUDA events),
   host microseconds per call over --calls calls of a tiny product, through the wrappers and
   through the bare calls (ctypes cublasGemmEx against nvmath's gemm_ex, arguments prepared).
3. cuBLASLt: cublaslt.CublasLt.matmul with the bias epilogue (bf16, D = A @ B.T + bias) against
   the same plan built through nvmath.bindings.cublasLt (matmul_desc_create,
   matmul_desc_set_attribute, matrix_layout_create, matmul_preference_*, the heuristic's first
   algorithm, matmul). Checked: the heuristic's algorithm bytes, the product's bits, capture.

Reading the table: one row per binding and case. "bits = ours": theirs against ours, bit for
bit ("ref" on our row). "vs NumPy": the launch section's result bit for bit against NumPy's
float32 sums; the products' largest error against a float64 product of the same rounded
operands, relative to the largest entry (a sanity figure, not bits). "graph": the capture
replayed, bit for bit against the binding's own eager result. "host us": Python
wall-clock microseconds per call for the loop of calls alone, "wall us" with the synchronize
at the end. "device us" on the tiny rows: the same call captured 100 times in a graph and
replayed, per call; a host figure close to it (or "wall us" well above "host us") means the
loop waited on the device and the figure is not the binding's cost. "x ours": host us over our
row's (below 1: theirs is cheaper). The median of --rounds interleaved rounds.
A row that says "not installed" names the package missing on this machine; "error: ..." a call
that failed (the other rows still ran).

CuPy's libcublas and libcublasLt are loaded (as in training) before nvmath is imported; the lines
after the table list every libcublas/libcublasLt/libcuda mapped into the process: two copies of one would
make different bits possible for that reason alone. Needs a CUDA GPU and CuPy; elsewhere it
says so and exits 2. nvmath-python is not part of the project's environment: install it beside
it for this run (--target a folder on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.metadata as md
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WS = 32 << 20  # the workspace both cuBLAS and cuBLASLt handles get (cublas.CUBLAS_WORKSPACE)
N_BITS = 1_000_003  # elements of the launch section's bit checks (odd)
N_TIME = 4_099  # elements of its timing loop: a kernel far shorter than a launch
GRAPH_COPIES = 100  # calls captured in one graph for the tiny rows' device time
cp = np = None  # cupy and numpy, imported by main once a GPU is known to be there
ROWS: list = []


def row(section, case, binding, **kw):
    ROWS.append(dict(section=section, case=case, binding=binding, **kw))


def dist_version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def bits(x):
    h = cp.asnumpy(x) if isinstance(x, cp.ndarray) else np.asarray(x)
    return np.ascontiguousarray(h).reshape(-1).view(np.uint8)


def same(x, y) -> bool:
    bx, by = bits(x), bits(y)
    return bx.shape == by.shape and bool(np.array_equal(bx, by))


def yes(flag: bool) -> str:
    return "same bits" if flag else "DIFFERENT"


def err(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def memcpy(dst, src, stream):
    """dst's bytes = src's on stream (any dtype, bf16 included: no CuPy kernel)."""
    dst.data.copy_from_device_async(src.data, dst.nbytes, stream)


def capture_on(stream, fn, binds=()):
    """fn() recorded on stream as a CUDA graph (as graphs.capture does: handles bound first)."""
    with stream:
        for b in binds:
            b.bind_stream()
        stream.begin_capture()
        try:
            fn()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 - the capture's own error is the one to show
                pass
            raise
        return stream.end_capture()


def graph_us(stream, fn, binds=(), copies=GRAPH_COPIES, replays=5) -> float:
    """Device microseconds per call of fn: `copies` calls in one graph, replayed between events."""
    g = capture_on(stream, lambda: [fn() for _ in range(copies)], binds)
    from andrea.backends.cuda.graphs import replay_ms
    return replay_ms(g, stream, replays) * 1e3 / copies


def eager_once(fn, stream):
    with stream:
        fn()
    stream.synchronize()


def host_us(fn, n: int, stream, warm: int = 200):
    """(loop, wall) microseconds per call: n calls of fn after a warm-up, the synchronize at the end
    outside the first figure and inside the second."""
    for _ in range(warm):
        fn()
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    stream.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def time_rows(section, case, fns: dict, n: int, stream, rounds: int, ref: str, device=None):
    """One timing row per entry of fns (name -> a no-argument call, or a "not installed"
    string), interleaved rounds, medians; x ours against the row named ref."""
    res = {k: [] for k, f in fns.items() if callable(f)}
    failed = {}
    for _ in range(rounds):
        for k in list(res):
            try:
                with stream:
                    res[k].append(host_us(fns[k], n, stream))
            except Exception as e:  # noqa: BLE001 - a probe: say it and go on
                failed[k] = err(e)
                del res[k]
    base = statistics.median(h for h, _ in res[ref]) if ref in res else None
    for k, f in fns.items():
        extra = {"device us": device[k]} if device and k in device else {}
        if k in res:
            h = statistics.median(x for x, _ in res[k])
            w = statistics.median(x for _, x in res[k])
            row(section, case, k, **{"host us": h, "wall us": w, "x ours": h / base if base else None}, **extra)
        else:
            row(section, case, k, note=failed.get(k, f), **extra)


# --------------------------------------------------------------------------- 1. driver launch


def _dims(d) -> tuple:
    d = tuple(d) if isinstance(d, tuple) else (d,)
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


class TheirDriver:
    """pdl.Driver's launch through cuda-bindings: cuLaunchKernelEx with a CUlaunchConfig whose one
    attribute is CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1, the parameters as
    ((values), (types)): a device array as its pointer (ctypes.c_void_p), a NumPy scalar as the
    ctypes type of its dtype, a Python int as c_longlong and a float as c_double (pdl.pack_args'
    rules; a float16/bfloat16 scalar has no ctypes type and would need the packed void** form)."""

    CTYPES = {"b1": ctypes.c_bool, "i1": ctypes.c_byte, "u1": ctypes.c_ubyte, "i2": ctypes.c_short,
              "u2": ctypes.c_ushort, "i4": ctypes.c_int, "u4": ctypes.c_uint, "i8": ctypes.c_longlong,
              "u8": ctypes.c_ulonglong, "f4": ctypes.c_float, "f8": ctypes.c_double}

    def __init__(self, driver):
        self.drv = driver
        self.attr = driver.CUlaunchAttribute()
        self.attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self.attr.value.programmaticStreamSerializationAllowed = 1
        self.success = driver.CUresult.CUDA_SUCCESS
        self.funcs: dict = {}  # CUfunction pointer -> driver.CUfunction
        self.configs: dict = {}  # (grid, block, shared, stream) -> CUlaunchConfig (launch_reused)

    def function(self, func_ptr: int):
        f = self.funcs.get(func_ptr)
        if f is None:
            f = self.funcs[func_ptr] = self.drv.CUfunction(func_ptr)
        return f

    def config(self, grid, block, shared_mem: int, stream_ptr: int):
        g, b = _dims(grid), _dims(block)
        c = self.drv.CUlaunchConfig()
        c.gridDimX, c.gridDimY, c.gridDimZ = g
        c.blockDimX, c.blockDimY, c.blockDimZ = b
        c.sharedMemBytes = int(shared_mem)
        c.hStream = int(stream_ptr or 0)
        c.attrs = [self.attr]
        c.numAttrs = 1
        return c

    def params(self, args, ndarray_type=None) -> tuple:
        vals, types = [], []
        for i, a in enumerate(args):
            if ndarray_type is not None and isinstance(a, ndarray_type):
                vals.append(a.data.ptr)
                types.append(ctypes.c_void_p)
                continue
            if isinstance(a, (bool, np.bool_)):
                vals.append(bool(a))
                types.append(ctypes.c_bool)
            elif isinstance(a, int):
                vals.append(a)
                types.append(ctypes.c_longlong)
            elif isinstance(a, float):
                vals.append(a)
                types.append(ctypes.c_double)
            elif isinstance(a, np.generic) and a.dtype.str[1:] in self.CTYPES:
                vals.append(a.item())
                types.append(self.CTYPES[a.dtype.str[1:]])
            else:
                raise TypeError(f"kernel argument {i}: {type(a).__name__} has no ctypes type for cuda-bindings")
        return tuple(vals), tuple(types)

    def _call(self, kernel, cfg, f, args, ndarray_type):
        res = self.drv.cuLaunchKernelEx(cfg, f, self.params(args, ndarray_type), 0)
        rc = res[0] if isinstance(res, tuple) else res
        if rc != self.success:
            raise RuntimeError(f"{kernel}: cuda.bindings cuLaunchKernelEx failed: {rc!r}")

    def launch(self, kernel, func_ptr, grid, block, shared_mem, stream_ptr, args, ndarray_type=None):
        """pdl.Driver.launch's signature and work: a fresh config per launch."""
        self._call(kernel, self.config(grid, block, shared_mem, stream_ptr), self.function(func_ptr), args,
                   ndarray_type)

    def launch_reused(self, kernel, func_ptr, grid, block, shared_mem, stream_ptr, args, ndarray_type=None):
        """The same with the config made once per (grid, block, shared memory, stream) and kept."""
        key = (grid, block, shared_mem, stream_ptr)
        cfg = self.configs.get(key)
        if cfg is None:
            cfg = self.configs[key] = self.config(grid, block, shared_mem, stream_ptr)
        self._call(kernel, cfg, self.function(func_ptr), args, ndarray_type)


def section_launch(driver_mod, why, a):
    from andrea.backends.cuda.pdl import Driver
    from andrea.backends.cuda.runtime import THREADS, Runtime, blocks
    sec, kname = "1 launch", "k_residual_add"
    rt = Runtime()
    f = rt.function("residual.cu", kname, np.float32)
    ptr = f.kernel.ptr
    ours = Driver()
    theirs = TheirDriver(driver_mod) if driver_mod is not None else None
    cc = int(cp.cuda.Device().compute_capability)
    note = "" if cc >= 90 else f"sm_{cc}: Runtime would not use the attribute here"

    def via(drv, method="launch"):
        if drv is None:
            return None
        m = getattr(drv, method)
        return lambda grid, args, sptr: m(kname, ptr, grid, THREADS, 0, sptr, args, cp.ndarray)

    launchers = {"ours pdl.Driver.launch": via(ours),
                 "theirs cuLaunchKernelEx (config per launch)": via(theirs),
                 "theirs cuLaunchKernelEx (config reused)": via(theirs, "launch_reused")}
    rng = np.random.default_rng(0)
    ha, hb = (rng.standard_normal(N_BITS, dtype=np.float32) for _ in range(2))
    ref_t = ha + hb
    ref_out = ref_t + ha
    da, db = cp.asarray(ha), cp.asarray(hb)
    nan = cp.asarray(np.full(N_BITS, np.nan, np.float32))
    grid, n = blocks(N_BITS), np.int64(N_BITS)
    stream, cap = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    case = f"t=a+b, out=t+a, f32 n={N_BITS}"
    eager = {}
    for name, launch in launchers.items():
        if launch is None:
            row(sec, case, name, note=why)
            continue
        try:
            t, out = cp.empty_like(da), cp.empty_like(da)
            memcpy(t, nan, stream)
            memcpy(out, nan, stream)
            with stream:
                launch(grid, (t, da, db, n), stream.ptr)
                launch(grid, (out, t, da, n), stream.ptr)
            stream.synchronize()
            eager[name] = out
            ok_np = same(t, ref_t) and same(out, ref_out)
            ref = eager.get("ours pdl.Driver.launch")
            vs = "ref" if name.startswith("ours") else (yes(same(out, ref)) if ref is not None else "")
            tg, og = cp.empty_like(da), cp.empty_like(da)
            g = capture_on(cap, lambda: (launch(grid, (tg, da, db, n), cap.ptr),
                                         launch(grid, (og, tg, da, n), cap.ptr)))
            memcpy(tg, nan, cap)
            memcpy(og, nan, cap)
            g.launch(stream=cap)
            cap.synchronize()
            gr = yes(same(og, out) and same(tg, t))
            row(sec, case, name, **{"bits = ours": vs, "vs NumPy": yes(ok_np), "graph": gr}, note=note)
        except Exception as e:  # noqa: BLE001
            row(sec, case, name, note=err(e))

    # launch cost: a tiny grid, so the host is the bottleneck
    sa, sb, so = (cp.asarray(rng.standard_normal(N_TIME, dtype=np.float32)) for _ in range(3))
    gs, args_s = blocks(N_TIME), (so, sa, sb, np.int64(N_TIME))
    fns = {"cupy RawKernel call (no attribute)": lambda: f((gs,), (THREADS,), args_s),
           "ours Runtime.launch": lambda: rt.launch("residual.cu", kname, np.float32, gs, THREADS, args_s)}
    for name, launch in launchers.items():
        fns[name] = (lambda L=launch: L(gs, args_s, cp.cuda.get_current_stream().ptr)) if launch else why
    before = rt.pdl_launches
    dev = {}
    for k, fn in fns.items():
        if callable(fn):
            try:
                eager_once(fn, stream)  # first calls (handles, lazy loads) outside any capture
                dev[k] = graph_us(stream, fn)
            except Exception as e:  # noqa: BLE001
                dev[k] = None
                print(f"{k}: device time: {err(e)}", file=sys.stderr)
    time_rows(sec, f"launch cost, n={N_TIME}, {a.launches} launches", fns, a.launches, stream, a.rounds,
              "ours pdl.Driver.launch", dev)
    if rt.pdl_launches == before and cc >= 90:
        row(sec, "check", "ours Runtime.launch", note="did not take the programmatic path")


# --------------------------------------------------------------------------- 2. cuBLAS


class TheirBlas:
    """cublas.Cublas through nvmath.bindings.cublas: the same handle set-up and the same gemm."""

    def __init__(self, C):
        from andrea.backends.cuda import cublas as ours
        self.C = C
        for mine, theirs in ((ours.COMPUTE_32F, C.ComputeType.COMPUTE_32F), (ours.GEMM_DEFAULT, C.GemmAlgo.DEFAULT),
                             (ours.OP_N, C.Operation.N), (ours.OP_T, C.Operation.T), (0, C.Math.DEFAULT_MATH)):
            if mine != int(theirs):
                raise RuntimeError(f"constant mismatch: ours {mine}, nvmath {theirs!r} = {int(theirs)}")
        self.compute, self.algo = int(C.ComputeType.COMPUTE_32F), int(C.GemmAlgo.DEFAULT)
        self.op_n, self.op_t = int(C.Operation.N), int(C.Operation.T)
        self.handle = C.create()
        C.set_math_mode(self.handle, int(C.Math.DEFAULT_MATH))
        self.workspace = cp.empty(WS, dtype=cp.uint8)
        self.stream = None
        self.scalars = np.array([1.0, 0.0], dtype=np.float32)  # host alpha, beta (pointer mode host)
        self.alpha_ptr = self.scalars.ctypes.data
        self.beta_ptr = self.alpha_ptr + 4

    def bind_stream(self):
        ptr = cp.cuda.get_current_stream().ptr
        if ptr != self.stream:
            self.C.set_stream(self.handle, ptr)
            self.C.set_workspace(self.handle, self.workspace.data.ptr, WS)
            self.stream = ptr

    def gemm(self, Cm, A, B, trans_a, trans_b, M, N, K, lda, ldb, ldc, alpha=1.0, beta=0.0):
        from andrea.backends.cuda.cublas import cuda_type
        self.bind_stream()
        if A.dtype != B.dtype:
            raise TypeError(f"gemm: A is {A.dtype} but B is {B.dtype}")
        ta, tb, tc = cuda_type(A.dtype), cuda_type(B.dtype), cuda_type(Cm.dtype)
        self.scalars[0], self.scalars[1] = alpha, beta
        op_a, op_b = (self.op_t if trans_a else self.op_n), (self.op_t if trans_b else self.op_n)
        self.C.gemm_ex(self.handle, op_b, op_a, N, M, K, self.alpha_ptr, B.data.ptr, tb, ldb, A.data.ptr, ta, lda,
                       self.beta_ptr, Cm.data.ptr, tc, ldc, self.compute, self.algo)


def _operands(rng, ct, ta, tb, M, N, K):
    """Host operands rounded to ct (float32 copies of the rounded values for the reference), lds."""
    ha = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32).astype(ct)
    hb = (rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32) * 0.05).astype(ct)
    lda, ldb = (M if ta else K), (K if tb else N)
    return ha, hb, lda, ldb


def _rel_err(out, ref) -> str:
    o = cp.asnumpy(out).astype(np.float64)
    return f"rel err {np.max(np.abs(o - ref)) / max(np.max(np.abs(ref)), 1e-30):.1e}"


def section_gemm(C, why, a):
    from andrea.backends.cuda.cublas import Cublas
    from andrea.backends.cuda.graphs import event_ms
    sec = "2 cuBLAS"
    bf16 = np.dtype("bfloat16")
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    ours = Cublas()
    theirs, twhy = None, why
    if C is not None:
        try:
            theirs = TheirBlas(C)
        except Exception as e:  # noqa: BLE001
            twhy = err(e)
    blases = {"ours Cublas.gemm": ours, "theirs nvmath cublas.gemm_ex": theirs}
    stream, cap = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(1)
    cases = [("fp16 NT -> fp16", f16, f16, False, True, 1000, 768, 3072, 0.0),
             ("bf16 NN -> bf16", bf16, bf16, False, False, 1001, 3072, 768, 0.0),
             ("fp16 TN -> f32, beta 1", f16, f32, True, False, 768, 3072, 1001, 1.0),
             ("bf16 TN -> f32, beta 1", bf16, f32, True, False, 768, 3072, 1001, 1.0)]
    for label, ct, ot, ta, tb, M, N, K, beta in cases:
        case = f"{label}, {M}x{N}x{K}"
        ha, hb, lda, ldb = _operands(rng, ct, ta, tb, M, N, K)
        a32, b32 = ha.astype(np.float64), hb.astype(np.float64)
        h0 = (rng.standard_normal((M, N), dtype=np.float32) if beta else np.full((M, N), np.nan, np.float32)).astype(ot)
        ref = (a32.T if ta else a32) @ (b32.T if tb else b32) + (beta * h0.astype(np.float64) if beta else 0.0)
        dA, dB, d0 = cp.asarray(ha), cp.asarray(hb), cp.asarray(h0)
        args = (dA, dB, ta, tb, M, N, K, lda, ldb, N)
        eager, dev = {}, {}
        for name, bl in blases.items():
            if bl is None:
                row(sec, case, name, note=twhy)
                continue
            try:
                out = cp.empty_like(d0)
                memcpy(out, d0, stream)
                with stream:
                    bl.gemm(out, *args, 1.0, beta)
                stream.synchronize()
                eager[name] = out
                ref_o = eager.get("ours Cublas.gemm")
                vs = "ref" if name.startswith("ours") else (yes(same(out, ref_o)) if ref_o is not None else "")
                og = cp.empty_like(d0)
                g = capture_on(cap, lambda: bl.gemm(og, *args, 1.0, beta), (bl,))
                memcpy(og, d0, cap)
                g.launch(stream=cap)
                cap.synchronize()
                gr = yes(same(og, out))
                row(sec, case, name, **{"bits = ours": vs, "vs NumPy": _rel_err(out, ref), "graph": gr})
            except Exception as e:  # noqa: BLE001
                row(sec, case, name, note=err(e))
        # device time, interleaved rounds, each product accumulating into a scratch output
        for _ in range(a.rounds):
            for name in eager:
                bl, scratch = blases[name], cp.empty_like(d0)
                memcpy(scratch, d0, stream)
                t = event_ms(lambda: bl.gemm(scratch, *args, 1.0, beta), reps=20, warmup=3, stream=stream)
                dev.setdefault(name, []).append(t * 1e3)
        for r in ROWS:
            if r["section"] == sec and r["case"] == case and r["binding"] in dev:
                r["device us"] = statistics.median(dev[r["binding"]])

    # launch cost: a tiny product, through the wrappers and through the bare calls
    M, N, K = 31, 64, 64
    ha, hb, lda, ldb = _operands(rng, f16, False, True, M, N, K)
    dA, dB = cp.asarray(ha), cp.asarray(hb)
    outs = {k: cp.zeros((M, N), f16) for k in ("ours", "theirs", "ours raw", "theirs raw")}
    case = f"launch cost, fp16 NT {M}x{N}x{K}, {a.calls} calls"
    with stream:
        ours.bind_stream()
        if theirs is not None:
            theirs.bind_stream()
    # the bare calls: every argument prepared (handle, pointers, host alpha 1 and beta 0), as ints
    # or ctypes objects; OP_T for B, OP_N for A (C^T = B^T-op A^T-op), CUDA_R_16F, COMPUTE_32F, GEMM_DEFAULT
    lib, alpha, beta0 = ours.lib, ctypes.c_float(1.0), ctypes.c_float(0.0)
    pa, pb, pc = ctypes.byref(alpha), ctypes.byref(beta0), outs["ours raw"].data.ptr
    pA, pB = dA.data.ptr, dB.data.ptr

    def ours_raw():
        st = lib.cublasGemmEx(ours.handle, 1, 0, N, M, K, pa, pB, 2, ldb, pA, 2, lda, pb, pc, 2, N, 68, -1)
        if st:
            raise RuntimeError(f"cublasGemmEx status {st}")

    fns = {"ours Cublas.gemm": lambda: ours.gemm(outs["ours"], dA, dB, False, True, M, N, K, lda, ldb, N),
           "theirs nvmath cublas.gemm_ex": twhy, "ours bare ctypes cublasGemmEx": ours_raw,
           "theirs bare nvmath cublas.gemm_ex": twhy}
    if theirs is not None:
        theirs.scalars[:] = (1.0, 0.0)  # its wrapper sets them per call; the bare call reads them as left
        tc, h, ap, bp, tpc = theirs.C, theirs.handle, theirs.alpha_ptr, theirs.beta_ptr, outs["theirs raw"].data.ptr
        fns["theirs nvmath cublas.gemm_ex"] = lambda: theirs.gemm(outs["theirs"], dA, dB, False, True, M, N, K, lda,
                                                                  ldb, N)
        fns["theirs bare nvmath cublas.gemm_ex"] = lambda: tc.gemm_ex(h, 1, 0, N, M, K, ap, pB, 2, ldb, pA, 2, lda,
                                                                      bp, tpc, 2, N, 68, -1)
    dev = {}
    binds = {"ours Cublas.gemm": (ours,), "ours bare ctypes cublasGemmEx": (ours,),
             "theirs nvmath cublas.gemm_ex": (theirs,), "theirs bare nvmath cublas.gemm_ex": (theirs,)}
    for k, fn in fns.items():
        if callable(fn):
            try:
                eager_once(fn, stream)
                dev[k] = graph_us(cap, fn, binds[k])
            except Exception as e:  # noqa: BLE001
                print(f"{k}: device time: {err(e)}", file=sys.stderr)
    with stream:  # the graphs bound the handles to cap: back to the timing stream
        ours.bind_stream()
        if theirs is not None:
            theirs.bind_stream()
    time_rows(sec, case, fns, a.calls, stream, a.rounds, "ours Cublas.gemm", dev)
    stream.synchronize()
    written = {"ours Cublas.gemm": "ours", "theirs nvmath cublas.gemm_ex": "theirs",
               "ours bare ctypes cublasGemmEx": "ours raw", "theirs bare nvmath cublas.gemm_ex": "theirs raw"}
    for r in ROWS:
        if r["section"] == sec and r["case"] == case and "host us" in r:
            k = written[r["binding"]]
            r["bits = ours"] = "ref" if k == "ours" else yes(same(outs["ours"], outs[k]))
    return ours, theirs


# --------------------------------------------------------------------------- 3. cuBLASLt


class TheirLt:
    """The bias case of cublaslt.CublasLt.plan/matmul through nvmath.bindings.cublasLt."""

    def __init__(self, L):
        from andrea.backends.cuda import cublaslt as ours
        A = L.MatmulDescAttribute
        for mine, theirs in ((ours.DESC_TRANSA, A.TRANSA), (ours.DESC_TRANSB, A.TRANSB),
                             (ours.DESC_EPILOGUE, A.EPILOGUE), (ours.DESC_BIAS_POINTER, A.BIAS_POINTER), (ours.DESC_BIAS_DATA_TYPE, A.BIAS_DATA_TYPE),
                             (ours.EPILOGUES["bias"], L.Epilogue.BIAS),
                             (ours.PREF_MAX_WORKSPACE_BYTES, L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES)):
            if mine != int(theirs):
                raise RuntimeError(f"constant mismatch: ours {mine}, nvmath {theirs!r} = {int(theirs)}")
        self.L, self.A = L, A
        self.handle = L.create()
        self.workspace = cp.empty(WS, dtype=cp.uint8)
        self.pref = L.matmul_preference_create()
        ws = np.array([WS], dtype=np.uint64)
        L.matmul_preference_set_attribute(self.pref, int(L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES),
                                          ws.ctypes.data, ws.nbytes)
        self.scalars = np.array([1.0, 0.0], dtype=np.float32)
        self.bias_ptr = np.zeros(1, dtype=np.uint64)
        self.plans: dict = {}

    def _set(self, desc, attr, arr):
        self.L.matmul_desc_set_attribute(desc, int(attr), arr.ctypes.data, arr.nbytes)

    def plan(self, ta, tb, M, N, K, lda, ldb, ldd, ab_type, d_type, bias_type, bias_ptr):
        key = (ta, tb, M, N, K, lda, ldb, ldd, ab_type, d_type, bias_type)
        p = self.plans.get(key)
        if p is not None:
            return p
        L, A = self.L, self.A
        desc = L.matmul_desc_create(68, 0)  # CUBLAS_COMPUTE_32F, CUDA_R_32F scale
        self._set(desc, A.TRANSA, np.array([1 if tb else 0], np.int32))
        self._set(desc, A.TRANSB, np.array([1 if ta else 0], np.int32))
        self._set(desc, A.EPILOGUE, np.array([int(L.Epilogue.BIAS)], np.uint32))
        self._set(desc, A.BIAS_DATA_TYPE, np.array([bias_type], np.int32))
        self.bias_ptr[0] = bias_ptr
        self._set(desc, A.BIAS_POINTER, self.bias_ptr)
        lay_b = L.matrix_layout_create(ab_type, *((K, N) if tb else (N, K)), ldb)
        lay_a = L.matrix_layout_create(ab_type, *((M, K) if ta else (K, M)), lda)
        lay_d = L.matrix_layout_create(d_type, N, M, ldd)
        res, count = L.MatmulHeuristicResult(), np.zeros(1, np.int32)
        L.matmul_algo_get_heuristic(self.handle, desc, lay_b, lay_a, lay_d, lay_d, self.pref, 1, res.ptr,
                                    count.ctypes.data)
        if count[0] < 1 or int(res.state) != 0:
            raise RuntimeError(f"nvmath cuBLASLt: no algorithm ({int(count[0])} found)")
        p = self.plans[key] = (desc, lay_b, lay_a, lay_d, res)
        return p

    def matmul(self, D, A, B, ta, tb, M, N, K, lda, ldb, ldd, ab_type, d_type, bias, bias_type):
        desc, lay_b, lay_a, lay_d, res = self.plan(ta, tb, M, N, K, lda, ldb, ldd, ab_type, d_type, bias_type,
                                                   bias.data.ptr)
        self.bias_ptr[0] = bias.data.ptr
        self._set(desc, self.A.BIAS_POINTER, self.bias_ptr)
        ap = self.scalars.ctypes.data
        self.L.matmul(self.handle, desc, ap, B.data.ptr, lay_b, A.data.ptr, lay_a, ap + 4, D.data.ptr, lay_d,
                      D.data.ptr, lay_d, res.ptr, self.workspace.data.ptr, WS, cp.cuda.get_current_stream().ptr)


def section_lt(L, why, a):
    from andrea.backends.cuda.cublaslt import CublasLt
    from andrea.backends.cuda.graphs import event_ms
    sec = "3 cuBLASLt"
    bf16 = np.dtype("bfloat16")
    M, N, K, BF = 1001, 768, 3072, 14
    case = f"bf16 NT + bias epilogue -> bf16, {M}x{N}x{K}"
    rng = np.random.default_rng(2)
    ha, hb, lda, ldb = _operands(rng, bf16, False, True, M, N, K)
    hbias = rng.standard_normal(N, dtype=np.float32).astype(bf16)
    ref = ha.astype(np.float64) @ hb.astype(np.float64).T + hbias.astype(np.float64)
    dA, dB, dbias = cp.asarray(ha), cp.asarray(hb), cp.asarray(hbias)
    nan = cp.asarray(np.full((M, N), np.nan, np.float32).astype(bf16))
    stream, cap = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    ours = CublasLt()
    theirs, twhy = None, why
    if L is not None:
        try:
            theirs = TheirLt(L)
        except Exception as e:  # noqa: BLE001
            twhy = err(e)
    calls = {"ours CublasLt.matmul": lambda D: ours.matmul(D, dA, dB, False, True, M, N, K, lda, ldb, N, BF, BF,
                                                           "bias", bias=dbias, bias_type=BF),
             "theirs nvmath cublasLt.matmul": (lambda D: theirs.matmul(D, dA, dB, False, True, M, N, K, lda, ldb, N,
                                                                       BF, BF, dbias, BF)) if theirs else None}
    eager, dev = {}, {}
    for name, call in calls.items():
        if call is None:
            row(sec, case, name, note=twhy)
            continue
        try:
            out = cp.empty_like(nan)
            memcpy(out, nan, stream)
            with stream:
                call(out)
            stream.synchronize()
            eager[name] = out
            ref_o = eager.get("ours CublasLt.matmul")
            vs = "ref" if name.startswith("ours") else (yes(same(out, ref_o)) if ref_o is not None else "")
            og = cp.empty_like(nan)
            g = capture_on(cap, lambda: call(og))
            memcpy(og, nan, cap)
            g.launch(stream=cap)
            cap.synchronize()
            gr = yes(same(og, out))
            note = ""
            if name.startswith("theirs") and ours.plans:
                mine = bytes(next(iter(ours.plans.values()))[4].algo)
                their = ctypes.string_at(next(iter(theirs.plans.values()))[4].ptr, 64)
                note = "same heuristic algorithm" if mine == their else "OTHER heuristic algorithm"
            row(sec, case, name, **{"bits = ours": vs, "vs NumPy": _rel_err(out, ref), "graph": gr}, note=note)
        except Exception as e:  # noqa: BLE001
            row(sec, case, name, note=err(e))
    for _ in range(a.rounds):
        for name in eager:
            scratch = cp.empty_like(nan)
            t = event_ms(lambda: calls[name](scratch), reps=20, warmup=3, stream=stream)
            dev.setdefault(name, []).append(t * 1e3)
    for r in ROWS:
        if r["section"] == sec and r["binding"] in dev:
            r["device us"] = statistics.median(dev[r["binding"]])
    return ours, theirs


# --------------------------------------------------------------------------- main


def mapped_libraries() -> dict:
    """Every libcuda / libcublas / libcublasLt file mapped into this process, by stem."""
    found: dict = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                base = path.rsplit("/", 1)[-1]
                for stem in ("libcublasLt", "libcublas", "libcuda"):
                    if base.startswith(stem + ".so"):
                        found.setdefault(stem, [])
                        if path not in found[stem]:
                            found[stem].append(path)
                        break
    except OSError:
        pass
    return found


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.2f}" if v == v else ""
    return str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/bindings_probe.py", description=__doc__.splitlines()[0],
                                 epilog="The module docstring says how to read the table.")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows and versions as JSON")
    ap.add_argument("--launches", type=int, default=20_000, help="kernel launches per timing round")
    ap.add_argument("--calls", type=int, default=5_000, help="tiny cuBLAS calls per timing round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (the median is shown)")
    a = ap.parse_args(argv)

    global cp, np
    try:
        import cupy
        import numpy
        ndev = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - ImportError, or CuPy without a driver
        print(f"dev/bindings_probe.py: needs a CUDA GPU and CuPy; none here ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    if ndev < 1:
        print("dev/bindings_probe.py: needs a CUDA GPU and CuPy; CuPy sees no GPU", file=sys.stderr)
        return 2
    cp, np = cupy, numpy
    import pandas as pd

    cp.cuda.device.get_cublas_handle()  # CuPy's libcublas and libcublasLt load first, as in training
    try:
        from cuda.bindings import driver
        dwhy = ""
    except ImportError as e:
        driver, dwhy = None, f"not installed (cuda-bindings: {e})"
    try:
        from nvmath.bindings import cublas as nv_cublas, cublasLt as nv_lt
        nwhy = ""
    except ImportError as e:
        nv_cublas = nv_lt = None
        nwhy = f"not installed (nvmath-python: {e})"
    except Exception as e:  # noqa: BLE001 - installed but not importable (e.g. a cuda-core too old for it)
        nv_cublas = nv_lt = None
        nwhy = f"nvmath-python import failed: {type(e).__name__}: {e}"

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    versions = {"device": f"{name} (sm_{dev.compute_capability})",
                "driver": cp.cuda.runtime.driverGetVersion(), "cuda runtime": cp.cuda.runtime.runtimeGetVersion(),
                "cupy": cp.__version__, "numpy": np.__version__, "cuda-bindings": dist_version("cuda-bindings"),
                "cuda-core": dist_version("cuda-core"), "cuda-pathfinder": dist_version("cuda-pathfinder"),
                "nvmath-python": dist_version("nvmath-python"), "ml_dtypes": dist_version("ml_dtypes")}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if dwhy:
        print(f"cuda-bindings: {dwhy}")
    if nwhy:
        print(f"nvmath: {nwhy}")

    sections = (("1 launch", lambda: section_launch(driver, dwhy, a)),
                ("2 cuBLAS", lambda: section_gemm(nv_cublas, nwhy, a)),
                ("3 cuBLASLt", lambda: section_lt(nv_lt, nwhy, a)))
    handles = {}
    for sec, fn in sections:
        try:
            handles[sec] = fn()
        except Exception as e:  # noqa: BLE001 - one section failing leaves the others
            row(sec, "section", "", note=err(e))
    # library versions, as each binding's handle reports them
    try:
        if handles.get("2 cuBLAS"):
            ours, theirs = handles["2 cuBLAS"]
            v = ctypes.c_int(0)
            ours.lib.cublasGetVersion_v2(ours.handle, ctypes.byref(v))
            versions["cuBLAS (ours)"] = v.value
            if theirs is not None:
                versions["cuBLAS (nvmath)"] = theirs.C.get_version(theirs.handle)
        if handles.get("3 cuBLASLt"):
            ours, theirs = handles["3 cuBLASLt"]
            ours.lib.cublasLtGetVersion.restype = ctypes.c_size_t
            versions["cuBLASLt (ours)"] = ours.lib.cublasLtGetVersion()
            if theirs is not None:
                versions["cuBLASLt (nvmath)"] = theirs.L.get_version()
    except Exception as e:  # noqa: BLE001
        versions["library versions"] = err(e)
    libs = mapped_libraries()

    cols = ["section", "case", "binding", "bits = ours", "vs NumPy", "graph", "host us", "wall us", "x ours",
            "device us", "note"]
    shown = [{c: _cell(r.get(c)) for c in cols} for r in ROWS]
    with pd.option_context("display.max_colwidth", 90, "display.width", 300):
        print(pd.DataFrame(shown, columns=cols).to_string(index=False))
    print("library versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if "(" in k))
    for stem, paths in libs.items():
        flag = "  <- more than one copy mapped" if len(paths) > 1 else ""
        print(f"{stem}: {', '.join(paths)}{flag}")
    if a.json:
        clean = [{k: v for k, v in r.items() if v is not None} for r in ROWS]
        Path(a.json).write_text(json.dumps({"versions": versions, "libraries": libs, "rows": clean}, indent=1,
                                           default=str))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
