"""Every CUDA kernel pair against the NumPy reference, on the GPU (skipped without one).

    python -m pytest -m gpu tests/test_cuda_kernels.py -q

Method (per kernel, per precision): fresh random inputs at odd sizes (T=77, C=200, V=1001, head
sizes 40 and 25, which do not divide 64); the reference runs in float64 on the same inputs rounded
to the compute dtype; forward outputs are filled with NaN before the launch so an unwritten element
fails; gradient buffers are pre-filled with random values and the test compares what the kernel
ADDED, except an activation gradient in the write mode (accumulate=False, parametrised "write"),
which is filled with NaN and compared as it is. The error is norm(got - ref) / norm(ref); NaN or Inf anywhere fails.
Tolerances: fp32 1e-5 (float32 arithmetic with TF32 off sits near 1e-7..1e-6 on these sizes);
fp16 1e-2 (inputs, activations and intermediates rounded to 11 significant bits, ~5e-4 each).
"""
import contextlib
import zlib

import numpy as np
import pytest

from andrea.backends import cuda_available
from andrea.backends import ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]

B, T, C, V = 2, 77, 200, 1001
PREC = {"fp32": (np.float32, 1e-5), "fp16": (np.float16, 1e-2)}


@pytest.fixture(scope="module")
def be():
    from andrea.backends import get_backend
    return get_backend("cuda")


@pytest.fixture(params=list(PREC))
def prec(request):
    return PREC[request.param]


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


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


@pytest.fixture(params=[True, False], ids=["add", "write"])
def accumulate(request):
    """The backward kernels' two modes for the activation gradient: add into it (the default), or
    write it (accumulate=False, the first writer in model.backward)."""
    return request.param


# ---------------------------------------------------------------- embedding
def test_embed(be, prec, rng):
    dt, tol = prec
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[0, :20] = 7  # a long run of one token, and one shared across the batch
    tokens[1, 5] = 7
    wte, wpe = rnd(rng, (V, C), dt), rnd(rng, (T + 5, C), dt)
    out = np.zeros((B, T, C))
    ref.k_embed_fwd(out, tokens, wte, wpe)
    got = nan_buf((B, T, C), dt)
    be.k_embed_fwd(got, dev(tokens, np.int32), dev(wte, dt), dev(wpe, dt))
    assert_close("k_embed_fwd out", host(got), out, tol)

    dout = rnd(rng, (B, T, C), dt)
    dwte, dwpe = zeros_like64(wte, wpe)
    ref.k_embed_bwd(dwte, dwpe, dout, tokens)
    gwte, gwpe = Grad(rng, dwte, np.float32), Grad(rng, dwpe, np.float32)
    be.k_embed_bwd(gwte.d, gwpe.d, dev(dout, dt), dev(tokens, np.int32))
    gwte.check("k_embed_bwd dwte", tol)
    gwpe.check("k_embed_bwd dwpe", tol)


def test_embed_bwd_deterministic_large(be):
    """B*T = 8192 (the shared-memory sort's largest) and 12288 (the global-memory sort), with
    heavy repeats: two launches give the same bits, and the sum matches the reference."""
    import cupy as cp
    rng = np.random.default_rng(5)
    for Bq, Tq in ((8, 1024), (12, 1024)):
        tokens = rng.integers(0, 50, (Bq, Tq)).astype(np.int32)
        dout = rng.standard_normal((Bq, Tq, 64)).astype(np.float32)
        outs = []
        for _ in range(2):
            dwte, dwpe = cp.zeros((50, 64), cp.float32), cp.zeros((Tq, 64), cp.float32)
            be.k_embed_bwd(dwte, dwpe, cp.asarray(dout), cp.asarray(tokens))
            outs.append(cp.asnumpy(dwte))
        assert np.array_equal(outs[0], outs[1]), "k_embed_bwd is not bit-reproducible"
        want = np.zeros((50, 64))
        np.add.at(want, tokens.reshape(-1), dout.reshape(-1, 64).astype(np.float64))
        assert_close(f"k_embed_bwd dwte B*T={Bq * Tq}", outs[0].astype(np.float64), want, 1e-5)


# B*T: a single key, sizes that are no power of two or end mid-block/mid-tile (77, 2049, 8191,
# 12289), the ANDREA-12M step (8192), and two beyond the one-block sort's shared memory (20000,
# 70001, with several 2048-key tiles); each size through both paths (embed_rank_max forced)
@pytest.mark.parametrize("N,V", [(1, 7), (77, 5), (2049, 50304), (8191, 3), (8192, 8192), (12289, 50), (20000, 1000),
                                 (70001, 30)])
def test_embed_sort_rank(be, rng, N, V, monkeypatch):
    """k_embed_bwd's keys sorted by rank (k_embed_sort_rank) and by the bitonic sort (k_embed_sort):
    both equal NumPy's sort of the packed keys (padding 0xffffffff), tokens heavily repeated, and
    dwte is the same bits either way."""
    import cupy as cp
    tokens = rng.integers(0, V, (1, N)).astype(np.int32)
    C2 = 16
    dout = rnd(rng, (1, N, C2), np.float32)
    shift = max(1, (N - 1).bit_length())
    want = np.full(1 << shift, 0xffffffff, np.uint32)
    want[:N] = np.sort((tokens.reshape(-1).astype(np.uint64) << shift | np.arange(N, dtype=np.uint64)).astype(np.uint32))
    got = {}
    for name, rank_max in (("rank", 1 << 30), ("bitonic", 0)):
        use_tuning(monkeypatch, be, embed_rank_max=rank_max)
        launched = []
        launch = be.rt.launch
        monkeypatch.setattr(be.rt, "launch", lambda f, k, *a, **kw: (launched.append(k), launch(f, k, *a, **kw))[1])
        dwte, dwpe = cp.zeros((V, C2), cp.float32), cp.zeros((N, C2), cp.float32)
        be.k_embed_bwd(dwte, dwpe, dev(dout, np.float32), dev(tokens, np.int32))
        monkeypatch.setattr(be.rt, "launch", launch)
        assert launched[0] == {"rank": "k_embed_sort_rank", "bitonic": "k_embed_sort"}[name]
        keys = cp.asnumpy(be.workspace.get("embed_keys", 1 << shift, np.uint32))
        assert np.array_equal(keys, want), f"{name}: keys not sorted as NumPy sorts them"
        got[name] = cp.asnumpy(dwte)
    assert np.array_equal(got["rank"].view(np.uint32), got["bitonic"].view(np.uint32))
    # the bits: each token's rows added in float32 from zero in position order (a sequential cumsum)
    flat, rows32 = tokens.reshape(-1), dout.reshape(N, C2).astype(np.float32)
    order = np.argsort(flat, kind="stable")
    starts = np.flatnonzero(np.r_[True, flat[order][1:] != flat[order][:-1]])
    want32 = np.zeros((V, C2), np.float32)
    for a, b in zip(starts, np.r_[starts[1:], N]):
        want32[flat[order[a]]] = np.cumsum(rows32[order[a:b]], axis=0, dtype=np.float32)[-1]
    assert np.array_equal(got["rank"].view(np.uint32), want32.view(np.uint32)), "dwte: not the position-order sums"
    want_dwte = np.zeros((V, C2))
    np.add.at(want_dwte, tokens.reshape(-1), dout.reshape(N, C2))
    assert_close(f"k_embed_bwd dwte N={N}", got["rank"].astype(np.float64), want_dwte, 1e-5)


# ---------------------------------------------------------------- layer norm
@pytest.mark.parametrize("C", [200, 1100])  # one-pass backward (C <= 1024), and the two-pass one
def test_layernorm(be, prec, rng, C, accumulate):
    dt, tol = prec
    inp = rnd(rng, (B, T, C), dt, 2.0, 0.5)
    w, b = rnd(rng, (C,), dt, 0.5, 1.0), rnd(rng, (C,), dt, 0.1)
    out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))
    ref.k_layernorm_fwd(out, mean, rstd, inp, w, b)
    g_out, g_mean, g_rstd = nan_buf((B, T, C), dt), nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)
    be.k_layernorm_fwd(g_out, g_mean, g_rstd, dev(inp, dt), dev(w, dt), dev(b, dt))
    assert_close("k_layernorm_fwd out", host(g_out), out, tol)
    assert_close("k_layernorm_fwd mean", host(g_mean), mean, 1e-5)
    assert_close("k_layernorm_fwd rstd", host(g_rstd), rstd, 1e-5 if dt == np.float32 else 1e-3)

    dout = rnd(rng, (B, T, C), dt)
    dinp, dw, db = zeros_like64(inp, w, b)
    ref.k_layernorm_bwd(dinp, dw, db, dout, inp, w, mean, rstd)
    gi, gw, gb = Grad(rng, dinp, dt, accumulate), Grad(rng, dw, np.float32), Grad(rng, db, np.float32)
    be.k_layernorm_bwd(gi.d, gw.d, gb.d, dev(dout, dt), dev(inp, dt), dev(w, dt),
                       dev(mean, np.float32), dev(rstd, np.float32), accumulate=accumulate)
    gi.check("k_layernorm_bwd dinp", tol)
    gw.check("k_layernorm_bwd dweight", tol)
    gb.check("k_layernorm_bwd dbias", tol)


# The one-pass backward (version 3) at widths from one vector a lane to 1024 columns in fp32 (one
# block a SM), row counts that do not divide into the blocks (8191, 3001, 999, 77) and fewer rows
# than blocks (5); 8192 x 384 is the ANDREA-12M step. blocks: Tuning.ln_blocks (0: the default grid).
LN_BWD_SHAPES = [(8192, 384, "float16", 0), (8191, 384, "bfloat16", 0), (77, 64, "float16", 0),
                 (3001, 768, "float16", 0), (3001, 768, "bfloat16", 0), (1025, 768, "float32", 0),
                 (5, 1024, "float16", 0), (999, 384, "float16", 7), (999, 200, "float32", 6)]


@pytest.mark.parametrize("N,Cq,dt_name,blocks", LN_BWD_SHAPES)
def test_layernorm_bwd_one_pass(be, rng, N, Cq, dt_name, blocks, monkeypatch, accumulate):
    """k_layernorm_bwd through the one-pass kernel and the in-order sums of its block partials:
    against the reference, the same bits on a second launch and on a graph replay; in both modes
    (dinp added into, or written)."""
    import cupy as cp
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    dt = np.dtype(dt_name)
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 3e-2}[dt_name]
    if blocks:
        use_tuning(monkeypatch, be, ln_blocks=blocks)
    inp = rnd(rng, (N, Cq), dt, 2.0, 0.5)
    w, b = rnd(rng, (Cq,), dt, 0.5, 1.0), rnd(rng, (Cq,), dt, 0.1)
    out, mean, rstd = np.zeros((N, Cq)), np.zeros(N), np.zeros(N)
    ref.k_layernorm_fwd(out, mean, rstd, inp, w, b)
    mean, rstd = mean.astype(np.float32).astype(np.float64), rstd.astype(np.float32).astype(np.float64)
    dout = rnd(rng, (N, Cq), dt)
    dinp, dw, db = zeros_like64(inp, w, b)
    ref.k_layernorm_bwd(dinp, dw, db, dout, inp, w, mean, rstd)
    args = [dev(x, y) for x, y in ((dout, dt), (inp, dt), (w, dt), (mean, np.float32), (rstd, np.float32))]
    gi, gw, gb = Grad(rng, dinp, dt, accumulate), Grad(rng, dw, np.float32), Grad(rng, db, np.float32)
    pre = [g.d.copy() for g in (gi, gw, gb)]
    launched = []
    launch = be.rt.launch
    monkeypatch.setattr(be.rt, "launch", lambda f, k, *a, **kw: (launched.append(k), launch(f, k, *a, **kw))[1])
    be.k_layernorm_bwd(gi.d, gw.d, gb.d, *args, accumulate=accumulate)
    assert launched == ["k_layernorm_bwd_fused", "k_colsum_final", "k_colsum_final"]
    gi.check("k_layernorm_bwd dinp", tol)
    gw.check("k_layernorm_bwd dweight", tol)
    gb.check("k_layernorm_bwd dbias", tol)
    first = [cp.asnumpy(g.d).view(np.uint8) for g in (gi, gw, gb)]
    reset = lambda: [g.d.data.copy_from_device(p.data, p.nbytes) for g, p in zip((gi, gw, gb), pre)]  # noqa: E731
    reset()
    be.k_layernorm_bwd(gi.d, gw.d, gb.d, *args, accumulate=accumulate)
    for name, g, f in zip(("dinp", "dweight", "dbias"), (gi, gw, gb), first):
        assert np.array_equal(cp.asnumpy(g.d).view(np.uint8), f), f"{name} differs on a second launch"
    graph = be.capture(lambda: be.k_layernorm_bwd(gi.d, gw.d, gb.d, *args, accumulate=accumulate))
    for _ in range(2):
        reset()
        graph.launch()
        be.synchronize()
        for name, g, f in zip(("dinp", "dweight", "dbias"), (gi, gw, gb), first):
            assert np.array_equal(cp.asnumpy(g.d).view(np.uint8), f), f"{name} differs on a graph replay"


@pytest.mark.parametrize("C", [C, 201])  # rows of 200 are whole 16-byte vectors (version 2), of 201 not
def test_residual_layernorm(be, prec, rng, C):
    """The fused residual add + layer norm: the same bits as k_residual_add then k_layernorm_fwd
    on the GPU, and the reference's values."""
    dt, tol = prec
    a, b = rnd(rng, (B, T, C), dt), rnd(rng, (B, T, C), dt)
    w, bias = rnd(rng, (C,), dt, 0.1, 1.0), rnd(rng, (C,), dt, 0.1)
    res, out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))
    ref.k_residual_layernorm_fwd(res, out, mean, rstd, a, b, w, bias)
    g = [nan_buf((B, T, C), dt), nan_buf((B, T, C), dt), nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)]
    ins = (dev(a, dt), dev(b, dt), dev(w, dt), dev(bias, dt))
    be.k_residual_layernorm_fwd(*g, *ins)
    for name, got, want in zip(("res", "out", "mean", "rstd"), g, (res, out, mean, rstd)):
        assert_close(f"k_residual_layernorm_fwd {name}", host(got), want, tol)
    s = [nan_buf((B, T, C), dt), nan_buf((B, T, C), dt), nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)]
    be.k_residual_add(s[0], ins[0], ins[1])
    be.k_layernorm_fwd(s[1], s[2], s[3], s[0], ins[2], ins[3])
    for x, y in zip(g, s):
        assert np.array_equal(host(x), host(y))


# ---------------------------------------------------------------- linear layers
@pytest.fixture(params=[True, False], ids=["cublaslt", "cublas"])
def lt(request, be, monkeypatch):
    """Both paths of the products with a bias or GELU: cuBLASLt epilogues, and cuBLAS + kernels."""
    monkeypatch.setattr(be, "cublaslt", request.param)
    return request.param


def lt_used(be, epilogue):
    """True when cuBLASLt planned a product with this epilogue (so the test ran its path)."""
    lt = be.lt
    return lt is not None and any(key[10] == epilogue for key in lt.plans)


# oc = C + 1: bias-gradient rows that are not whole 16-byte vectors
@pytest.mark.parametrize("op,oc", [("attn_qkv", 3 * C), ("attn_out", C), ("attn_out", C + 1)])
def test_linear(be, prec, rng, op, oc, lt, accumulate):
    dt, tol = prec
    fwd, bwd = f"k_{op}_fwd", f"k_{op}_bwd"
    inp, w, b = rnd(rng, (B, T, C), dt), rnd(rng, (oc, C), dt, 0.05), rnd(rng, (oc,), dt, 0.1)
    out = np.zeros((B, T, oc))
    getattr(ref, fwd)(out, inp, w, b)
    got = nan_buf((B, T, oc), dt)
    getattr(be, fwd)(got, dev(inp, dt), dev(w, dt), dev(b, dt))
    assert_close(f"{fwd} out", host(got), out, tol)
    assert lt_used(be, "bias") or not lt

    dout = rnd(rng, (B, T, oc), dt)
    dinp, dw, db = zeros_like64(inp, w, b)
    getattr(ref, bwd)(dinp, dw, db, dout, inp, w)
    gi, gw, gb = Grad(rng, dinp, dt, accumulate), Grad(rng, dw, np.float32), Grad(rng, db, np.float32)
    getattr(be, bwd)(gi.d, gw.d, gb.d, dev(dout, dt), dev(inp, dt), dev(w, dt), accumulate=accumulate)
    gi.check(f"{bwd} dinp", tol)
    gw.check(f"{bwd} dw", tol)
    gb.check(f"{bwd} db", tol)
    # again on the same buffers: db adds once more (no state left behind by the first launch);
    # dinp adds once more, or is written again to the same values
    getattr(be, bwd)(gi.d, gw.d, gb.d, dev(dout, dt), dev(inp, dt), dev(w, dt), accumulate=accumulate)
    assert_close(f"{bwd} db, second launch", host(gb.d) - gb.pre, 2 * db, tol)
    assert_close(f"{bwd} dinp, second launch", host(gi.d) - gi.pre, (2 if accumulate else 1) * dinp, tol)


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("n_head", [5, 8])  # head sizes 40 and 25: version 1 (scores materialised)
def test_attention(be, prec, rng, n_head, accumulate):
    check_attention(be, prec, rng, n_head, B, T, C, accumulate)


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


@pytest.mark.parametrize("prec_name,hopper", [("fp16", True), ("fp16", False), ("fp32", None)],
                         ids=["fp16-wgmma", "fp16-mma", "fp32"])  # float32 takes version 1 either way
@pytest.mark.parametrize("n_head,Tq,Cq", FUSED_CASES)
def test_attention_fused(be, prec_name, rng, n_head, Tq, Cq, accumulate, hopper, monkeypatch):
    prec, launched = PREC[prec_name], None
    if prec[0] == np.float16:
        assert be.attention_variant(np.float16, Cq // n_head) == "fused", "this case must exercise the fused kernels"
        launched = fused_path(be, monkeypatch, hopper, Cq // n_head)
    check_attention(be, prec, rng, n_head, 2, Tq, Cq, accumulate)
    if launched is not None:
        assert_fused_kernels(launched, hopper)


@pytest.mark.parametrize("hopper", [True, False], ids=["wgmma", "mma"])
@pytest.mark.parametrize("n_head,Tq,Cq", FUSED_CASES)
def test_attention_fused_bf16(be, rng, n_head, Tq, Cq, accumulate, hopper, monkeypatch):
    """bfloat16 through the same kernels (the mma instruction's bf16 form). Tolerance 3e-2: 8
    significant bits, ~4e-3 per rounding, over the chain S -> P -> dS -> dQ, dK."""
    import ml_dtypes
    assert be.attention_variant(ml_dtypes.bfloat16, Cq // n_head) == "fused"
    launched = fused_path(be, monkeypatch, hopper, Cq // n_head)
    check_attention(be, (ml_dtypes.bfloat16, 3e-2), rng, n_head, 2, Tq, Cq, accumulate)
    assert_fused_kernels(launched, hopper)


@pytest.mark.parametrize("hopper", [True, False], ids=["wgmma", "mma"])
@pytest.mark.parametrize("dt_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("n_head,Tq,Cq", [(2, 1000, 128), (1, 333, 128)])
def test_attention_fused_bitwise_rerun(be, rng, dt_name, n_head, Tq, Cq, hopper, monkeypatch):
    """The same inputs give the same bits, forward and backward (no atomics, fixed orders)."""
    import cupy as cp
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    dt = np.dtype(dt_name)
    assert be.attention_variant(dt, Cq // n_head) == "fused"
    launched = fused_path(be, monkeypatch, hopper, Cq // n_head)
    qkv, dout = dev(rnd(rng, (2, Tq, 3 * Cq), dt), dt), dev(rnd(rng, (2, Tq, Cq), dt), dt)
    pre = dev(rnd(rng, (2, Tq, 3 * Cq), dt), dt)
    runs = []
    for _ in range(2):
        out, lse = nan_buf((2, Tq, Cq), dt), nan_buf((2, n_head, Tq), np.float32)
        be.k_attn_fwd(out, lse, qkv, n_head)
        dqkv = pre.copy()
        be.k_attn_bwd(dqkv, dout, qkv, out, lse, n_head)
        runs.append([cp.asnumpy(a).view(np.uint8) for a in (out, lse, dqkv)])
    for name, a, b in zip(("out", "lse", "dqkv"), *runs):
        assert np.array_equal(a, b), f"{name} differs between two runs on the same inputs"
    # the write mode into NaN: the bits of adding into zeros (a zero result may differ in sign)
    added, written = cp.zeros_like(pre), nan_buf(pre.shape, dt)
    be.k_attn_bwd(added, dout, qkv, out, lse, n_head)
    be.k_attn_bwd(written, dout, qkv, out, lse, n_head, accumulate=False)
    a, w = cp.asnumpy(added).astype(np.float64), cp.asnumpy(written).astype(np.float64)
    assert np.array_equal(a, w), "dqkv written differs from dqkv added into zeros"
    assert_fused_kernels(launched, hopper)


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


# ---------------------------------------------------------------- MLP
# (2, 77, 200): B*T*4C in whole 16-byte vectors, k_mlp_bwd_gelu's vector path; (1, 77, 201): not
@pytest.mark.parametrize("shape", [(B, T, C), (1, T, 201)])
def test_mlp(be, prec, rng, lt, shape, accumulate):
    dt, tol = prec
    b, t, c = shape
    H = 4 * c
    inp = rnd(rng, (b, t, c), dt)
    w1, b1 = rnd(rng, (H, c), dt, 0.07), rnd(rng, (H,), dt, 0.1)
    w2, b2 = rnd(rng, (c, H), dt, 0.035), rnd(rng, (c,), dt, 0.1)
    out, pre, act = np.zeros((b, t, c)), np.zeros((b, t, H)), np.zeros((b, t, H))
    ref.k_mlp_fwd(out, pre, act, inp, w1, b1, w2, b2)
    g_out, g_pre, g_act = nan_buf((b, t, c), dt), nan_buf((b, t, H), dt), nan_buf((b, t, H), dt)
    be.k_mlp_fwd(g_out, g_pre, g_act, dev(inp, dt), dev(w1, dt), dev(b1, dt), dev(w2, dt), dev(b2, dt))
    assert_close("k_mlp_fwd out", host(g_out), out, tol)
    assert_close("k_mlp_fwd pre", host(g_pre), pre, tol)
    assert_close("k_mlp_fwd act", host(g_act), act, tol)
    assert lt_used(be, "gelu_aux_bias") or not lt

    pre = pre.astype(dt).astype(np.float64)
    dout = rnd(rng, (b, t, c), dt)
    dinp, dw1, db1, dw2, db2 = zeros_like64(inp, w1, b1, w2, b2)
    ref.k_mlp_bwd(dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, np.zeros_like(pre), np.zeros_like(pre))
    gs = [Grad(rng, dinp, dt, accumulate)] + [Grad(rng, x, np.float32) for x in (dw1, db1, dw2, db2)]
    be.k_mlp_bwd(*(g.d for g in gs), dev(dout, dt), dev(inp, dt), dev(pre, dt), dev(w1, dt),
                 dev(w2, dt), nan_buf((b, t, H), dt), nan_buf((b, t, H), dt), accumulate=accumulate)
    for g, n in zip(gs, ("dinp", "dw1", "db1", "dw2", "db2")):
        g.check(f"k_mlp_bwd {n}", tol)


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
# in whole 16-byte vectors (the two-kernel layer norm, the GELU pass without db1's partials)


def assert_same_bits(got, want, what):
    for k in want:
        assert np.array_equal(got[k], want[k]), f"{k}: {what} changed the bits"


@pytest.mark.parametrize("dt_name,c", PASS_CASES)
def test_param_grad_pass_same_bits(rng, dt_name, c):
    """Inside a param_grad_pass the column sums wait and run as ONE k_colsum_final_many at its end:
    every gradient (and activation gradient) has the bits of the sums run at once; a second sum into
    a gradient still waiting flushes the waiting ones first (same bits again)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    case = PassCase(rng, np.dtype(dt_name), c)
    now, launched_now = case.run(False)
    assert launched_now.count("k_colsum_final") == 8 and "k_colsum_final_many" not in launched_now
    later, launched = case.run(True)
    assert_same_bits(later, now, "deferring the column sums")
    assert launched.count("k_colsum_final_many") == 1 and "k_colsum_final" not in launched, launched
    assert launched[-1] == "k_colsum_final_many"  # at the close of the pass, after every other kernel
    assert case.be.colsums.depth == 0 and not case.be.colsums.waiting
    twice_now, _ = case.run(False, reps=2)
    twice, launched = case.run(True, reps=2)
    assert_same_bits(twice, twice_now, "deferring two sums into each gradient")
    assert launched.count("k_colsum_final_many") == 2 and "k_colsum_final" not in launched


@pytest.mark.parametrize("dt_name,c", [("float16", 200), ("float32", 201)])
def test_param_grad_pass_graphs(rng, dt_name, c):
    """The pass captured in a CUDA graph: after an eager run (its table of sums uploaded) the graph
    holds the one launch; captured first (no upload inside a capture) one k_colsum_final per sum.
    Both replay the bits of the sums run at once, twice in a row."""
    import cupy as cp
    case = PassCase(rng, np.dtype(dt_name), c)
    now, _ = case.run(False)
    for eager_first in (True, False):
        g = case.grads()
        if eager_first:
            case.passes(g)
        with case.recording() as launched:
            graph = case.be.capture(lambda: case.passes(g))
        if eager_first:
            assert launched.count("k_colsum_final_many") == 1 and "k_colsum_final" not in launched
        else:
            assert launched.count("k_colsum_final") == 8 and "k_colsum_final_many" not in launched
        for _ in range(2):
            for k, v in case.pre.items():
                g[k].set(v)
            graph.launch()
            case.be.synchronize()
            assert_same_bits(as_bytes(g), now,
                             f"a graph replay (captured {'after' if eager_first else 'before'} an eager run)")


def test_param_grad_pass_runs_out_of_room(rng):
    """Room reserved for one layer and three layers' calls in the pass: the sets of partials that no
    longer fit run at once in the workspace slots; the bits are those of every sum run at once."""
    case = PassCase(rng, np.dtype(np.float16), 200, n_layer=1)
    now, _ = case.run(False, reps=3)
    later, launched = case.run(True, reps=3)
    assert_same_bits(later, now, "running out of deferred room")
    assert "k_colsum_final_many" in launched and "k_colsum_final" in launched


def test_param_grad_pass_drops_sums_on_error(rng):
    """An exception inside the pass leaves nothing waiting, and the next pass starts clean."""
    case = PassCase(rng, np.dtype(np.float16), 200)
    now, _ = case.run(False)
    with pytest.raises(RuntimeError, match="boom"):
        with case.be.param_grad_pass():
            case.calls(case.grads())
            raise RuntimeError("boom")
    assert case.be.colsums.depth == 0 and not case.be.colsums.waiting and case.be.colsums.buf is None
    later, _ = case.run(True)
    assert_same_bits(later, now, "a pass after a failed one")


# ---------------------------------------------------------------- residual
def test_residual(be, prec, rng):
    dt, tol = prec
    a, b = rnd(rng, (B, T, C), dt), rnd(rng, (B, T, C), dt)
    out = np.zeros((B, T, C))
    ref.k_residual_add(out, a, b)
    got = nan_buf((B, T, C), dt)
    be.k_residual_add(got, dev(a, dt), dev(b, dt))
    assert_close("k_residual_add out", host(got), out, tol)
    dout = rnd(rng, (B, T, C), dt)
    da, db = zeros_like64(a, b)
    ref.k_residual_add_bwd(da, db, dout)
    ga, gb = Grad(rng, da, dt), Grad(rng, db, dt)
    be.k_residual_add_bwd(ga.d, gb.d, dev(dout, dt))
    ga.check("k_residual_add_bwd da", tol)
    gb.check("k_residual_add_bwd db", tol)


# ---------------------------------------------------------------- loss
@pytest.mark.parametrize("rows", [B * T, 64])  # one chunk; chunks of 64 rows, the last short
@pytest.mark.parametrize("V", [V, 1000])  # rows of 1000 are whole 16-byte vectors: the kernels' vector path
def test_loss(be, prec, rng, rows, V, accumulate):
    dt, tol = prec
    inp, wte = rnd(rng, (B, T, C), dt), rnd(rng, (V, C), dt, 0.1)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    losses, lse, logits = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B * T, V))
    ref.k_loss_fwd(losses, lse, logits, inp, wte, targets)
    g_losses, g_lse, g_logits = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32), nan_buf((rows, V), dt)
    be.k_loss_fwd(g_losses, g_lse, g_logits, dev(inp, dt), dev(wte, dt), dev(targets, np.int32))
    if rows == B * T:
        assert_close("k_loss_fwd logits", host(g_logits), logits.reshape(rows, V), tol)
    assert_close("k_loss_fwd losses", host(g_losses), losses, tol)
    assert_close("k_loss_fwd lse", host(g_lse), lse, tol)

    dloss = 1.0 / 7  # any scale; the engine passes loss_scale / (B*T)
    dinp, dwte = zeros_like64(inp, wte)
    r_losses, r_lse = np.zeros((B, T)), np.zeros((B, T))
    ref.k_loss_bwd(r_losses, r_lse, dinp, dwte, logits, inp, wte, targets, dloss)
    gi, gw = Grad(rng, dinp, dt, accumulate), Grad(rng, dwte, np.float32)
    b_losses, b_lse = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)
    args = (dev(inp, dt), dev(wte, dt), dev(targets, np.int32))
    be.k_loss_bwd(b_losses, b_lse, gi.d, gw.d, nan_buf((rows, V), dt), *args, dloss, accumulate=accumulate)
    assert_close("k_loss_bwd losses", host(b_losses), r_losses, tol)
    assert np.array_equal(host(b_lse), host(g_lse))  # the same row reduction as k_loss_fwd
    gi.check("k_loss_bwd dinp", tol)
    gw.check("k_loss_bwd dwte", tol)
    # dloss read from the device (the engine's, written by k_step_check): the same bits
    d2, w2 = dev(gi.pre, dt) if accumulate else nan_buf((B, T, C), dt), dev(gw.pre, np.float32)
    be.k_loss_bwd(b_losses, b_lse, d2, w2, nan_buf((rows, V), dt), *args, dev([dloss], np.float32),
                  accumulate=accumulate)
    assert np.array_equal(host(d2), host(gi.d)) and np.array_equal(host(w2), host(gw.d))


# the row pass at the vocabulary sizes training runs: (dtype, V, loss_vectors, loss_prefetch,
# loss_blocks) -- version 2 (the row in registers) with its launch settings, blocks capped so that
# each walks many rows (the staged next row in turn in both buffers); float32 at 50304 is too long
# for the registers and takes version 1
LOSS_ROWS = [("float16", 50304, 8, 1, 0), ("bfloat16", 50304, 8, 1, 0), ("float16", 50304, 16, 1, 5),
             ("bfloat16", 50304, 4, 0, 7), ("float16", 8192, 8, 1, 3), ("bfloat16", 8192, 16, 1, 0),
             ("float32", 8200, 8, 1, 4), ("float32", 50304, 8, 1, 0)]


@pytest.mark.parametrize("dt_name,Vr,vectors,prefetch,blocks", LOSS_ROWS)
def test_loss_rows(be, rng, dt_name, Vr, vectors, prefetch, blocks, monkeypatch):
    """k_loss_fwd and k_loss_bwd (one chunk of 154 rows) against the reference: losses, lse, the
    dlogits left in the workspace (also without the target entries, where the -1 would hide an
    error in the softmax), dinp (written) and dwte; lse the same bits in both; a rerun the same
    bits; the version that ran is the one the plan names."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    from andrea.backends.cuda.geometry import loss_row_plan
    dt = np.dtype(dt_name)
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 3e-2}[dt_name]
    use_tuning(monkeypatch, be, loss_vectors=vectors, loss_prefetch=prefetch, loss_blocks=blocks)
    assert (loss_row_plan(Vr, dt.itemsize, vectors) is None) == (dt_name == "float32" and Vr == 50304)
    Cq, N = 64, B * T
    inp, wte = rnd(rng, (B, T, Cq), dt), rnd(rng, (Vr, Cq), dt, 0.3)
    targets = rng.integers(0, Vr, (B, T)).astype(np.int32)
    losses, lse, logits = np.zeros((B, T)), np.zeros((B, T)), np.zeros((N, Vr))
    ref.k_loss_fwd(losses, lse, logits, inp, wte, targets)
    args = (dev(inp, dt), dev(wte, dt), dev(targets, np.int32))
    g_losses, g_lse = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32)
    launched = []
    launch = be.rt.launch
    monkeypatch.setattr(be.rt, "launch", lambda f, k, *a, **kw: (launched.append(k), launch(f, k, *a, **kw))[1])
    be.k_loss_fwd(g_losses, g_lse, nan_buf((N, Vr), dt), *args)
    assert launched == (["loss_fwd"] if dt_name == "float32" and Vr == 50304 else ["loss_fwd_regs"])
    assert_close("k_loss_fwd losses", host(g_losses), losses, tol)
    assert_close("k_loss_fwd lse", host(g_lse), lse, tol)

    dloss = 1.0 / 7
    dinp, dwte = zeros_like64(inp, wte)
    ref.k_loss_bwd(losses, lse, dinp, dwte, logits, inp, wte, targets, dloss)
    runs = []
    for _ in range(2):
        b_losses, b_lse, ws = nan_buf((B, T), np.float32), nan_buf((B, T), np.float32), nan_buf((N, Vr), dt)
        d_inp, d_wte = nan_buf((B, T, Cq), dt), dev(np.zeros((Vr, Cq)), np.float32)
        be.k_loss_bwd(b_losses, b_lse, d_inp, d_wte, ws, *args, dloss, accumulate=False)
        runs.append([host(a) for a in (b_losses, b_lse, ws, d_inp, d_wte)])
    got = runs[0]
    assert_close("k_loss_bwd losses", got[0], losses, tol)
    assert np.array_equal(got[1], host(g_lse))
    assert_close("k_loss_bwd dlogits", got[2], logits, tol)
    rows = np.arange(N)
    off = [a.copy() for a in (got[2], logits)]
    for a in off:
        a[rows, targets.reshape(N)] = 0.0
    assert_close("k_loss_bwd dlogits off the targets", off[0], off[1], tol)
    assert_close("k_loss_bwd dinp", got[3], dinp, tol)
    assert_close("k_loss_bwd dwte", got[4], dwte, tol)
    for a, b in zip(runs[0], runs[1]):
        assert np.array_equal(a, b)  # the same bits again


# ---------------------------------------------------------------- the optimizer step
def _state(scale, lr, step, skipped=0.0, good=0.0):
    st = np.zeros(ref.STATE_LEN)
    st[ref.S_SCALE], st[ref.S_LR], st[ref.S_STEP] = scale, lr, step
    st[ref.S_SKIPPED], st[ref.S_GOOD] = skipped, good
    return st


@pytest.mark.parametrize("max_norm,poison,fp16", [(0.0, None, False), (1e9, None, True),
                                                  (0.5, None, True), (0.5, np.inf, True),
                                                  (0.5, np.nan, False)])
def test_step_check(be, rng, max_norm, poison, fp16):
    """k_grad_norm_partial, k_loss_accum and k_step_check against the reference: off, not reached
    and active clipping, an fp16 overflow and a NaN gradient (the skip policy). k_step_check gets
    the same partials on both sides and works in float64 as Python does: the state must agree to
    the bit."""
    n = 100_003  # not a multiple of the partial count: the last chunk is short
    P = be.grad_norm_partials
    grads = rnd(rng, (n,), np.float32, 0.3)
    if poison is not None:
        grads[12_345] = poison
    partials = np.zeros(P)
    ref.k_grad_norm_partial(partials, grads)
    g_part = nan_buf((P,), np.float32)
    be.k_grad_norm_partial(g_part, dev(grads, np.float32))
    if poison is None:
        assert_close("k_grad_norm_partial", host(g_part), partials, 1e-5)
    losses = rnd(rng, (3, 77), np.float32, 1.0, 5.0).astype(np.float32)
    st = _state(1024.0 if fp16 else 1.0, 3e-4, 9, skipped=2, good=1999)
    g_st = dev(st, np.float64)
    ref.k_loss_accum(st, losses)
    be.k_loss_accum(g_st, dev(losses, np.float32))
    assert abs(host(g_st)[ref.S_LOSS_SUM] - st[ref.S_LOSS_SUM]) <= 1e-12 * abs(st[ref.S_LOSS_SUM])
    st = host(g_st)  # the same loss sum on both sides from here
    parts32 = host(g_part).astype(np.float32)
    dloss, g_dloss = np.zeros(1, np.float32), nan_buf((1,), np.float32)
    args = (2, losses.size, 0.9, 0.95, 0.1, max_norm, fp16, 2000, 2.0 ** 24)
    g_st = dev(st, np.float64)
    ref.k_step_check(st, dloss, parts32, *args)
    be.k_step_check(g_st, g_dloss, g_part, *args)
    got = host(g_st)
    for name, i in zip(ref.STATE_SLOTS, range(len(ref.STATE_SLOTS))):
        assert got[i] == st[i] or (np.isnan(got[i]) and np.isnan(st[i])), f"{name}: {got[i]!r} vs {st[i]!r}"
    assert host(g_dloss)[0] == dloss[0]
    assert bool(got[ref.S_SKIP]) == (poison is not None)


@pytest.mark.parametrize("P", [1, 1000, 4096, 5001])  # partials in shared memory (up to 4096), and past it
def test_step_check_partials(be, rng, P):
    """k_step_check sums any number of partials in order, in float64, to the reference's bits: the
    partials differ by orders of magnitude, so another order would round differently."""
    parts = (rng.random(P) * 10.0 ** rng.integers(-6, 6, P)).astype(np.float32)
    st = _state(1.0, 3e-4, 9, skipped=2, good=5)
    st[ref.S_LOSS_SUM] = 77.0 * 3.5
    g_st = dev(st, np.float64)
    dloss, g_dloss = np.zeros(1, np.float32), nan_buf((1,), np.float32)
    args = (1, 77, 0.9, 0.95, 0.1, 1.0, False, 2000, 2.0 ** 24)
    ref.k_step_check(st, dloss, parts, *args)
    be.k_step_check(g_st, g_dloss, dev(parts, np.float32), *args)
    got = host(g_st)
    for name, i in zip(ref.STATE_SLOTS, range(len(ref.STATE_SLOTS))):
        assert got[i] == st[i], f"{name}: {got[i]!r} vs {st[i]!r}"
    assert host(g_dloss)[0] == dloss[0]


def _adamw_inputs(rng, n):
    p, g = rnd(rng, (n,), np.float32), rnd(rng, (n,), np.float32, 0.01)
    m, v = rnd(rng, (n,), np.float32, 0.001), np.abs(rnd(rng, (n,), np.float32, 1e-5))
    st = np.zeros(ref.STATE_LEN)
    st[ref.S_CLIP], st[ref.S_DECAY] = np.float32(0.37), np.float32(1 - 3e-3 * 0.1)
    st[ref.S_STEP_SIZE], st[ref.S_VHAT] = np.float32(3e-3 / (1 - 0.9 ** 7)), np.float32(1 / (1 - 0.95 ** 7))
    return [x.astype(np.float32) for x in (p, g, m, v)], st


@pytest.mark.parametrize("cdt", [np.float32, np.float16, "bfloat16"])
def test_adamw_step_vector_bits(be, rng, cdt):
    """k_adamw_step moves float4 vectors when every buffer is 16-byte aligned and one element at a
    time otherwise (and for the last n % 4): both paths give the same bits. The same update runs on
    aligned buffers and on views that start one element in (every vector misaligned), with the
    decay boundary inside a vector (n_decay % 4 == 1)."""
    import cupy as cp
    import ml_dtypes
    cdt = ml_dtypes.bfloat16 if cdt == "bfloat16" else cdt
    n, n_decay = 40_007, 20_001
    host32, st = _adamw_inputs(rng, n)
    runs = []
    for off in (0, 1):
        bufs = [cp.zeros(n + 1, np.float32) for _ in host32]
        for b, x in zip(bufs, host32):
            b[off:off + n] = cp.asarray(x)
        views = [b[off:off + n] for b in bufs]
        pcb = dev(np.zeros(n + 1), cdt) if cdt != np.float32 else None
        pc = pcb[off:off + n] if pcb is not None else None
        be.k_adamw_step(views[0], pc, views[1], views[2], views[3], dev(st, np.float64), 0.9, 0.95, 1e-8,
                        n_decay)
        runs.append([cp.asnumpy(x).view(np.uint32) for x in views]
                    + ([cp.asnumpy(pc).view(np.uint16)] if pc is not None else []))
    for name, a, b in zip(("params", "grads", "m", "v", "params_c"), *runs):
        assert np.array_equal(a, b), f"k_adamw_step {name}: aligned and misaligned paths differ"
    want = [x.copy() for x in host32]
    ref.k_adamw_step(want[0], None, want[1], want[2], want[3], st, 0.9, 0.95, 1e-8, n_decay)
    assert_close("k_adamw_step params", runs[0][0].view(np.float32), want[0].astype(np.float64), 1e-6)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("cdt", [np.float32, np.float16])
def test_adamw_step(be, rng, skip, cdt):
    """float32 on both sides: the kernel rounds each operation as NumPy does; the compute copy is
    the cast of the new weights; the gradient is zeroed; a skipped step changes nothing else."""
    n, n_decay = 50_001, 30_000
    p, g = rnd(rng, (n,), np.float32), rnd(rng, (n,), np.float32, 0.01)
    m, v = rnd(rng, (n,), np.float32, 0.001), np.abs(rnd(rng, (n,), np.float32, 1e-5))
    host32 = [x.astype(np.float32) for x in (p, g, m, v)]
    devs = [dev(x, np.float32) for x in host32]
    st = np.zeros(ref.STATE_LEN)
    st[ref.S_SKIP] = float(skip)
    st[ref.S_CLIP], st[ref.S_DECAY] = np.float32(0.37), np.float32(1 - 3e-3 * 0.1)
    st[ref.S_STEP_SIZE], st[ref.S_VHAT] = np.float32(3e-3 / (1 - 0.9 ** 7)), np.float32(1 / (1 - 0.95 ** 7))
    pc_in = rnd(rng, (n,), cdt)
    pc = pc_in.astype(cdt)
    g_pc = dev(pc_in, cdt) if cdt != np.float32 else None
    ref.k_adamw_step(host32[0], pc if cdt != np.float32 else None, host32[1], host32[2], host32[3],
                     st, 0.9, 0.95, 1e-8, n_decay)
    be.k_adamw_step(devs[0], g_pc, devs[1], devs[2], devs[3], dev(st, np.float64), 0.9, 0.95, 1e-8,
                    n_decay)
    for name, want, got in zip(("params", "grads", "m", "v"), host32, devs):
        assert_close(f"k_adamw_step {name}", host(got), want.astype(np.float64), 1e-6)
    assert not host(devs[1]).any()
    if g_pc is not None:
        want_pc = pc_in if skip else host(devs[0]).astype(cdt).astype(np.float64)
        assert np.array_equal(host(g_pc), want_pc)
    if skip:
        assert np.array_equal(host(devs[0]), p) and np.array_equal(host(devs[2]), m)


def test_upload_and_download_async(be, rng):
    """The host copies the engine queues without waiting: many in flight, each sees its own data."""
    import cupy as cp

    from andrea.backends.cuda.backend import PINNED_DEPTH
    dst = cp.zeros((5, 7), cp.int32)
    srcs = [rng.integers(0, 1000, (5, 7)).astype(np.int32) for _ in range(2 * PINNED_DEPTH + 1)]
    pending = []
    for src in srcs:
        src = src.copy()
        be.upload(dst, src)
        src[...] = -1  # the caller may reuse its array at once
        pending.append(be.download_async(dst * 2))
    be.synchronize()
    for src, p in zip(srcs, pending):
        assert np.array_equal(p.get(), 2 * src)


def test_cast_params(be, rng):
    src = rnd(rng, (10_007,), np.float32)
    got = nan_buf((10_007,), np.float16)
    be.k_cast_params(got, dev(src, np.float32))
    assert np.array_equal(host(got), src.astype(np.float16).astype(np.float64))


def test_launcher_rejects_bad_arguments(be):
    import cupy as cp
    x = cp.zeros((2, 3, 8), cp.float32)
    with pytest.raises(TypeError, match="k_residual_add: b has dtype float16"):
        be.k_residual_add(x, x, x.astype(cp.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        be.k_residual_add(x, x, cp.zeros((2, 8, 3), cp.float32).transpose(0, 2, 1))


# ---------------------------------------------------------------- architecture-specific builds
def test_runtime_arch_sm90a(tmp_path):
    """Runtime.function(..., arch="sm_90a") builds through NVRTC for the architecture-specific target
    (what wgmma needs) and launches like any other kernel; the plain build of the same file does not
    see the sm_90a feature macro."""
    import cupy as cp
    from andrea.backends.cuda.runtime import Runtime
    if int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("sm_90a needs compute capability 9.0")
    src = tmp_path / "arch.cu"
    src.write_text('extern "C" __global__ void k_arch(int* out, int v) {\n'
                   "#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\n  out[0] = v;\n#else\n  out[0] = -v;\n#endif\n}\n")
    rt = Runtime(sources={"arch.cu": src})
    out = cp.zeros((1,), dtype=cp.int32)
    rt.launch("arch.cu", "k_arch", np.float32, 1, 1, (out, np.int32(7)), arch="sm_90a")
    assert int(out.get()[0]) == 7
    rt.launch("arch.cu", "k_arch", np.float32, 1, 1, (out, np.int32(7)))
    assert int(out.get()[0]) == -7


@pytest.mark.parametrize("dt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("N,Cc,rpc", [(1000, 776, 16), (77, 2304, 13), (8192, 3072, 128)])
def test_colsum_partial_vec_bits(be, rng, dt, N, Cc, rpc):
    """k_colsum_partial_vec (a vector of CT_VEC columns a thread) adds the same rows in the same
    order as k_colsum_partial (a column a thread): the partials agree to the bit, and with the
    float64 column sums of the reference."""
    import cupy as cp
    import ml_dtypes
    from andrea.backends.cuda.runtime import i32, i64
    cdt = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[dt]
    vec = 16 // np.dtype(cdt).itemsize
    Cc -= Cc % vec
    x = rnd(rng, (N, Cc), cdt)
    gx = dev(x, cdt)
    chunks = -(-N // rpc)
    outs = []
    for kernel, cols_per_block in (("k_colsum_partial", 32), ("k_colsum_partial_vec", 32 * vec)):
        part = nan_buf((chunks, Cc), np.float32)
        be.rt.launch("linear.cu", kernel, gx.dtype, (-(-Cc // cols_per_block), chunks), (32, 8),
                     (part, gx, i64(N), i32(Cc), i32(rpc)))
        outs.append(cp.asnumpy(part))
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    assert_close("k_colsum_partial_vec", outs[1].astype(np.float64).sum(0), x.astype(np.float64).sum(0), 1e-5)


def test_colsum_final_many_bits(be, rng):
    """k_colsum_final_many (a thread per column, the warp's shuffle tree replayed in registers) gives
    k_colsum_final's bits (a warp per column) for chunk counts below, at and past 32 and not
    multiples of it, and for widths that leave a block part-filled."""
    import cupy as cp
    from andrea.backends.cuda.colsum import DeferredColsums
    sizes = [(5, 300), (32, 17), (33, 513), (77, 256), (256, 768), (64, 2304)]
    parts = [dev(rnd(rng, (n, c), np.float32, 10.0 ** rng.integers(-3, 3)), np.float32) for n, c in sizes]
    base = [rnd(rng, (c,), np.float32) for _, c in sizes]
    now = [dev(b, np.float32) for b in base]
    for out, part, (n, c) in zip(now, parts, sizes):
        DeferredColsums(be.rt)._final(out, part, n, c)
    q = DeferredColsums(be.rt)
    buf = cp.zeros(sum(-(-n * c // 32) * 32 for n, c in sizes), np.float32)
    q.open(buf)
    later = [dev(b, np.float32) for b in base]
    for out, part, (n, c) in zip(later, parts, sizes):
        p = q.take(n * c)
        p[...] = part.reshape(-1)
        q.finish(out, p, n, c)
    q.close()
    for (n, c), a, b in zip(sizes, now, later):
        assert np.array_equal(cp.asnumpy(a).view(np.uint32), cp.asnumpy(b).view(np.uint32)), (n, c)


def test_adamw_step_keeps_grads(be, rng):
    """zero_grads=False: the same update (bits) as zeroing, and the gradient left as it was."""
    import cupy as cp
    n, n_decay = 10_003, 5_001
    host32, st = _adamw_inputs(rng, n)
    out = {}
    for zero in (True, False):
        devs = [dev(x, np.float32) for x in host32]
        be.k_adamw_step(devs[0], None, devs[1], devs[2], devs[3], dev(st, np.float64), 0.9, 0.95, 1e-8, n_decay,
                        zero_grads=zero)
        out[zero] = [cp.asnumpy(d).view(np.uint32) for d in devs]
    for name, a, b in zip(("params", "m", "v"), (out[True][0], out[True][2], out[True][3]),
                          (out[False][0], out[False][2], out[False][3])):
        assert np.array_equal(a, b), name
    assert not out[True][1].any()
    assert np.array_equal(out[False][1], host32[1].view(np.uint32))
