"""Helpers of the CUDA kernel tests (tests/cuda/test_*_cuda.py): sizes, tolerances, host/device copies, the error measure."""
import contextlib
import numpy as np
import pytest

from andrea.backends import ref


B, T, C, V = 2, 77, 200, 1001


PREC = {"fp32": (np.float32, 1e-5), "fp16": (np.float16, 1e-2)}


def rnd(rng, shape, dt, scale=1.0, shift=0.0):
    """float64 host values already rounded to dt, so the reference sees the GPU's inputs."""
    return (rng.standard_normal(shape) * scale + shift).astype(dt).astype(np.float64)


def dev(x, dt):
    import cupy as cp
    return cp.asarray(np.ascontiguousarray(x).astype(dt))


def nan_buf(shape, dt):
    import cupy as cp
    return cp.full(shape, np.nan, dtype=dt)


def host(a):
    import cupy as cp
    return cp.asnumpy(a).astype(np.float64)


def rel_err(got, want):
    if not np.all(np.isfinite(got)):
        return float("inf")
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (den if den > 0 else 1.0))


def assert_close(name, got, want, tol):
    err = rel_err(got, want)
    if not err < tol:
        g, w = got.reshape(-1), want.reshape(-1)
        k = int(np.nanargmax(np.abs(g - w))) if np.isfinite(g).any() else 0
        first = ", ".join(f"({a:.6g} vs {b:.6g})" for a, b in zip(g[:4], w[:4]))
        pytest.fail(f"{name}: rel err {err:.3g} >= {tol:g}; first pairs {first}; "
                    f"largest diff at {k}: {g[k]:.6g} vs {w[k]:.6g}; NaN count {np.isnan(g).sum()}")


class Grad:
    """A gradient buffer pre-filled with random values (scaled like the expected increment), so
    the test checks that the kernel adds rather than writes; accumulate=False (a kernel that
    writes the buffer): filled with NaN instead, so an element it reads or leaves fails."""

    def __init__(self, rng, want_inc, dt, accumulate=True):
        scale = float(np.sqrt(np.mean(want_inc ** 2))) or 1.0
        self.pre = rnd(rng, want_inc.shape, dt, scale) if accumulate else np.zeros(want_inc.shape)
        self.want = want_inc
        self.d = dev(self.pre, dt) if accumulate else nan_buf(want_inc.shape, dt)

    def check(self, name, tol):
        assert_close(name, host(self.d) - self.pre, self.want, tol)


def zeros_like64(*arrays):
    return [np.zeros(a.shape) for a in arrays]


def use_tuning(monkeypatch, be, **settings):
    """The backend's launch geometry with settings changed for this test (cuda/tuning.Tuning, a
    frozen copy; the FP8 state keeps its own reference, set here too where there is one)."""
    tuning = be.tuning.with_settings(settings)
    monkeypatch.setattr(be, "tuning", tuning)
    if be.fp8 is not None:
        monkeypatch.setattr(be.fp8, "tuning", tuning)
    return tuning


# The one-pass backward (version 3) at widths from one vector a lane to 1024 columns in fp32 (one
# block a SM), row counts that do not divide into the blocks (8191, 3001, 999, 77) and fewer rows
# than blocks (5); 8192 x 384 is the ANDREA-12M step. blocks: Tuning.ln_blocks (0: the default grid).
LN_BWD_SHAPES = [(8192, 384, "float16", 0), (8191, 384, "bfloat16", 0), (77, 64, "float16", 0),
                 (3001, 768, "float16", 0), (3001, 768, "bfloat16", 0), (1025, 768, "float32", 0),
                 (5, 1024, "float16", 0), (999, 384, "float16", 7), (999, 200, "float32", 6)]


def lt_used(be, epilogue):
    """True when cuBLASLt planned a product with this epilogue (so the test ran its path)."""
    lt = be.lt
    return lt is not None and any(key[10] == epilogue for key in lt.plans)


# 16-bit dtypes take the fused path (version 4, or versions 8 and 7 on wgmma) at head sizes that are
# multiples of 16 up to 128: 64, 32, 16, 80 and 128 here; T = 77, 130 and 1000 end mid-tile (tiles
# of 64 and 128 rows)
FUSED_CASES = [(2, 77, 128), (4, 130, 128), (3, 77, 48), (2, 1000, 160), (2, 77, 256), (1, 1000, 128),
               (1, 130, 64)]


def fused_path(be, monkeypatch, hopper: bool, hs: int) -> list:
    """Select the fused kernels: the forward (version 8) and the backward's dQ and dK/dV (version 7)
    on wgmma from attention_hopper.cu (compute capability 9.0 only, else the case is skipped), or
    version 4's (mma.sync). Returns the list the Runtime's launches are recorded in from here on,
    as (file, kernel, arch)."""
    use_tuning(monkeypatch, be, hopper_attention=hopper)
    if hopper:
        import cupy as cp
        if int(cp.cuda.Device().compute_capability) != 90:
            pytest.skip("the wgmma kernels need compute capability 9.0")
        assert be._hopper(hs), "this case must exercise attention_hopper.cu's kernels"
    launched, launch = [], be.rt.launch

    def record(fname, kernel, *args, **kw):
        launched.append((fname, kernel, kw.get("arch")))
        return launch(fname, kernel, *args, **kw)

    monkeypatch.setattr(be.rt, "launch", record)
    return launched


def assert_fused_kernels(launched: list, hopper: bool):
    """The fused kernels that ran are those of the path asked for: no silent fall-back."""
    want = ("attention_hopper.cu", "sm_90a") if hopper else ("attention.cu", None)
    for kernel in ("k_attn_flash_fwd", "k_attn_flash_bwd_dq", "k_attn_flash_bwd_dkv"):
        got = {(f, a) for f, k, a in launched if k == kernel}
        assert got == {want}, f"{kernel} ran from {got}; expected {want}"
    # the wgmma dQ kernel computes D itself; version 4's backward reads it from k_attn_flash_D
    got = {(f, a) for f, k, a in launched if k == "k_attn_flash_D"}
    assert got == (set() if hopper else {("attention.cu", None)}), f"k_attn_flash_D ran from {got}"


def check_attention(be, prec, rng, n_head, B, T, C, accumulate=True):
    dt, tol = prec
    qkv = rnd(rng, (B, T, 3 * C), dt)
    out, lse = np.zeros((B, T, C)), np.zeros((B, n_head, T))
    ref.k_attn_fwd(out, lse, qkv, n_head)
    g_out, g_lse = nan_buf((B, T, C), dt), nan_buf((B, n_head, T), np.float32)
    be.k_attn_fwd(g_out, g_lse, dev(qkv, dt), n_head)
    assert_close("k_attn_fwd out", host(g_out), out, tol)
    assert_close("k_attn_fwd lse", host(g_lse), lse, 1e-5 if dt == np.float32 else 1e-3)
    assert g_lse.dtype == np.float32

    out = out.astype(dt).astype(np.float64)  # the backward pass reads the saved (rounded) output
    dout = rnd(rng, (B, T, C), dt)
    dqkv = np.zeros_like(qkv)
    ref.k_attn_bwd(dqkv, dout, qkv, out, lse, n_head)
    g = Grad(rng, dqkv, dt, accumulate)
    be.k_attn_bwd(g.d, dev(dout, dt), dev(qkv, dt), dev(out, dt), dev(lse, np.float32), n_head, accumulate=accumulate)
    g.check("k_attn_bwd dqkv", tol)


# ---------------------------------------------------------------- the parameter-gradient pass
class PassCase:
    """One layer's backward calls that end in column sums (k_mlp_bwd, two k_layernorm_bwd,
    k_attn_out_bwd, k_attn_qkv_bwd, chained as model.backward chains them) at width c, on a
    backend of its own with room reserved for n_layer layers; every gradient pre-filled with the
    same random values in each run."""

    def __init__(self, rng, dt, c, n_layer=2):
        import cupy as cp
        from andrea.backends import get_backend
        self.be = get_backend("cuda")
        self.be.reserve_workspace(B, T, c, 5, dt, n_layer=n_layer)
        self.dt, self.c, H = dt, c, 4 * c
        f32 = np.float32
        self.h = {"dout": dev(rnd(rng, (B, T, c), dt), dt), "x": dev(rnd(rng, (B, T, c), dt, 2.0, 0.5), dt),
                  "pre": dev(rnd(rng, (B, T, H), dt), dt), "w1": dev(rnd(rng, (H, c), dt, 0.07), dt),
                  "w2": dev(rnd(rng, (c, H), dt, 0.035), dt), "wo": dev(rnd(rng, (c, c), dt, 0.05), dt),
                  "wqkv": dev(rnd(rng, (3 * c, c), dt, 0.05), dt), "lnw": dev(rnd(rng, (c,), dt, 0.5, 1.0), dt),
                  "mean": dev(rnd(rng, (B, T), f32, 0.1), f32), "rstd": dev(rnd(rng, (B, T), f32, 0.1, 1.0), f32),
                  "dqkv": dev(rnd(rng, (B, T, 3 * c), dt), dt),
                  "act": cp.empty((B, T, H), dt), "dact": cp.empty((B, T, H), dt)}
        shapes = {"dln": (B, T, c), "dres": (B, T, c), "datty": (B, T, c), "dw1": (H, c), "db1": (H,),
                  "dw2": (c, H), "db2": (c,), "dwo": (c, c), "dbo": (c,), "dwqkv": (3 * c, c), "dbqkv": (3 * c,),
                  "ln1_w": (c,), "ln1_b": (c,), "ln2_w": (c,), "ln2_b": (c,)}
        self.pre = {k: rnd(rng, s, dt if len(s) == 3 else f32).astype(dt if len(s) == 3 else f32)
                    for k, s in shapes.items()}

    def grads(self):
        import cupy as cp
        return {k: cp.asarray(v) for k, v in self.pre.items()}

    def calls(self, g, reps=1):
        be, h = self.be, self.h
        for _ in range(reps):
            be.k_mlp_bwd(g["dln"], g["dw1"], g["db1"], g["dw2"], g["db2"], h["dout"], h["x"], h["pre"], h["w1"],
                         h["w2"], h["act"], h["dact"], accumulate=False)
            be.k_layernorm_bwd(g["dres"], g["ln2_w"], g["ln2_b"], g["dln"], h["x"], h["lnw"], h["mean"], h["rstd"])
            be.k_attn_out_bwd(g["datty"], g["dwo"], g["dbo"], g["dres"], h["x"], h["wo"], accumulate=False)
            be.k_attn_qkv_bwd(g["dln"], g["dwqkv"], g["dbqkv"], h["dqkv"], h["x"], h["wqkv"], accumulate=False)
            be.k_layernorm_bwd(g["dres"], g["ln1_w"], g["ln1_b"], g["dln"], h["x"], h["lnw"], h["mean"], h["rstd"])

    @contextlib.contextmanager
    def recording(self):
        """The names of the kernels launched inside the block, in order."""
        launched, launch = [], self.be.rt.launch
        self.be.rt.launch = lambda f, k, *a, **kw: (launched.append(k), launch(f, k, *a, **kw))[1]
        try:
            yield launched
        finally:
            self.be.rt.launch = launch

    def passes(self, g, deferred=True, reps=1):
        with self.be.param_grad_pass() if deferred else contextlib.nullcontext():
            self.calls(g, reps)

    def run(self, deferred, reps=1):
        """The gradients' bytes after the calls on fresh gradients, inside a param_grad_pass or
        not, and the kernels launched."""
        g = self.grads()
        with self.recording() as launched:
            self.passes(g, deferred, reps)
        return as_bytes(g), launched


def as_bytes(g):
    import cupy as cp
    return {k: cp.asnumpy(v).view(np.uint8) for k, v in g.items()}


PASS_CASES = [(dt, c) for dt in ("float32", "float16", "bfloat16") for c in (200, 201)]  # 201: rows not


def assert_same_bits(got, want, what):
    for k in want:
        assert np.array_equal(got[k], want[k]), f"{k}: {what} changed the bits"


# the row pass at the vocabulary sizes training runs: (dtype, V, loss_vectors, loss_prefetch,
# loss_blocks) -- version 2 (the row in registers) with its launch settings, blocks capped so that
# each walks many rows (the staged next row in turn in both buffers); float32 at 50304 is too long
# for the registers and takes version 1
LOSS_ROWS = [("float16", 50304, 8, 1, 0), ("bfloat16", 50304, 8, 1, 0), ("float16", 50304, 16, 1, 5),
             ("bfloat16", 50304, 4, 0, 7), ("float16", 8192, 8, 1, 3), ("bfloat16", 8192, 16, 1, 0),
             ("float32", 8200, 8, 1, 4), ("float32", 50304, 8, 1, 0)]


# ---------------------------------------------------------------- the optimizer step
def _state(scale, lr, step, skipped=0.0, good=0.0):
    st = np.zeros(ref.STATE_LEN)
    st[ref.S_SCALE], st[ref.S_LR], st[ref.S_STEP] = scale, lr, step
    st[ref.S_SKIPPED], st[ref.S_GOOD] = skipped, good
    return st


def _adamw_inputs(rng, n):
    p, g = rnd(rng, (n,), np.float32), rnd(rng, (n,), np.float32, 0.01)
    m, v = rnd(rng, (n,), np.float32, 0.001), np.abs(rnd(rng, (n,), np.float32, 1e-5))
    st = np.zeros(ref.STATE_LEN)
    st[ref.S_CLIP], st[ref.S_DECAY] = np.float32(0.37), np.float32(1 - 3e-3 * 0.1)
    st[ref.S_STEP_SIZE], st[ref.S_VHAT] = np.float32(3e-3 / (1 - 0.9 ** 7)), np.float32(1 / (1 - 0.95 ** 7))
    return [x.astype(np.float32) for x in (p, g, m, v)], st


def _top_conftest():
    """tests/conftest.py by its path: beside tests/cuda/conftest.py the module name `conftest` is this folder's."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("_tests_conftest", Path(__file__).resolve().parent.parent / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOP_CONFTEST = _top_conftest()
fp8_gpu = TOP_CONFTEST.fp8_gpu
small_config = TOP_CONFTEST.small_config
