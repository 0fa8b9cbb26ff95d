"""CUDA: the FP8 engine (train.precision=fp8): bit-identical runs, the weight cache, input slots, delayed scaling against the reference's FP8 section, on the GPU (skipped without one); moved from tests/test_fp8_cuda.py.

    python -m pytest -m gpu tests/cuda/test_engine_cuda.py -q
"""
import numpy as np
import pytest

from fp8kit import MODEL, assert_same_runs, batch, cfg_for, check_cache, check_resume, check_slots, delayed_engine, engine_t64, fp8_engine, launches, slot_engine
from cudakit import fp8_gpu, small_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores and CuPy")]


def test_engine_fp8_uses_fp8_and_two_runs_same_bits(tmp_path):
    from andrea.core.engine import Engine
    runs = []
    for _ in range(2):
        eng = Engine(cfg_for(tmp_path, batch_size=4, seq_len=32, precision="fp8"))
        assert eng.be.fp8 is not None and str(eng.params_c.dtype) == "bfloat16"
        assert {"fp8_x", "fp8_dy", "fp8_dyt", "fp8_w", "fp8_meta"} <= {r[0] for r in eng.be.workspace_rows(
            4, 32, 48, 3, eng.params_c.dtype, fp8=True)}
        losses = [eng.train_step(s, [batch(s)])["loss"] for s in range(1, 8)]
        runs.append((losses, eng.host_state()))
    assert all(np.isfinite(runs[0][0])), runs[0][0]
    assert runs[0][0] == runs[1][0], "losses differ between two identical fp8 runs"
    for a, b in zip(runs[0][1], runs[1][1]):
        assert np.array_equal(a, b), "weights or Adam state differ between two identical fp8 runs"
    bf = Engine(cfg_for(tmp_path, batch_size=4, seq_len=32, precision="bf16"))
    l_bf = [bf.train_step(s, [batch(s)])["loss"] for s in range(1, 8)]
    assert l_bf != runs[0][0], "fp8 gave the bf16 losses: the FP8 products did not run"
    assert max(abs(a - b) for a, b in zip(l_bf, runs[0][0])) < 0.05 * l_bf[0]


def test_fp8_refuses_sizes_it_cannot_run(tmp_path):
    from andrea.core.engine import Engine
    with pytest.raises(ValueError, match="multiple of 16"):
        Engine(cfg_for(tmp_path, batch_size=3, seq_len=37, precision="fp8"))


def test_weight_cache_same_bits_as_per_product_casts(tmp_path):
    """Steps of two microbatches with the FP8 weight cache, a skipped (non-finite) step among them,
    and a resume from a state: the copies match what each product's own quantisation makes of the
    weights (check_cache) after start-up, after updates, after the skipped step and after
    load_state; a step's products quantise no weight themselves and the optimizer's graph rewrites
    every copy with one k_fp8_cast_transpose_many, the amax taken by the update
    (k_adamw_step_amax). (The MLP's act and dact take their amax in k_fp8_gelu_amax and
    k_fp8_dgelu_colsum_amax, so 9 k_fp8_amax passes a layer remain with the cache and without the
    input slots: 3 inputs, 3 output gradients, the 3 inputs again.)"""
    from andrea.backends.cuda import CudaBackend
    n_layer, n_micro = MODEL["n_layer"], 2
    mid = None
    eng = fp8_engine(tmp_path)
    check_cache(eng, "start-up")
    recs, log = [], None
    for s in range(1, 8):
        if s == 1:
            log = launches(eng.be)
        if s == 5:  # a non-finite loss gradient: the step is skipped, the weights stay
            eng.loss_scale = float("inf")
        rec = dict(eng.train_step(s, [batch(2 * s), batch(2 * s + 1)]))
        if s == 1:
            eng.be.synchronize()
            counts = {k: log.count(k) for k in ("k_fp8_amax", "k_fp8_amax_many", "k_fp8_cast_transpose_many")}
            del eng.be.rt.launch  # the recording off again
        if s == 5:
            eng.loss_scale = 1.0
            check_cache(eng, "skipped step")
        if s == 3:
            mid = eng.state()
        recs.append(rec)
    check_cache(eng, "after 7 steps")
    on = recs, counts, eng.host_state()
    assert [r["skipped"] for r in on[0]] == [False] * 4 + [True] + [False] * 2, on[0]
    assert all(np.isfinite(r["loss"]) for r in on[0] if not r["skipped"])
    # the input slots take 3 (X^T kept) and, under current scaling, 2 (amax in the layer norms)
    # more amax passes a layer away (test_input_slots_in_the_engine)
    # (with delayed scaling ln1 and ln2 are delayed tensors: their layer norms reduce no amax, and
    # step 1 takes it first with k_fp8_amax, as for every delayed tensor)
    slots = 3 + 2 * (CudaBackend.fp8_scaling != "delayed")
    # the optimizer takes the cached weights' amax in its update (k_adamw_step_amax): no
    # k_fp8_amax_many before the cast
    assert on[1] == {"k_fp8_amax": (9 - slots) * n_layer * n_micro, "k_fp8_amax_many": 0,
                     "k_fp8_cast_transpose_many": 1}
    # resume: a fresh engine (its copies made from its own initial weights) loads the state after
    # step 3 and runs steps 4..7: the same bits as the straight run
    check_resume(fp8_engine(tmp_path, seed=99), mid, on, check_cache)


def test_weight_cache_plan_and_views(tmp_path):
    """The engine's memory plan holds the cache (fp8 weight cache rows); the products read the
    arena's copies, not the workspace's weight slot."""
    from andrea.core.plan import fp8_cached_weights
    on = fp8_engine(tmp_path)
    assert "fp8 weight cache" in on.plan.by_group()
    data = on.bufs["fp8_wcache"]
    lo, hi = data.data.ptr, data.data.ptr + data.nbytes
    for name in fp8_cached_weights(on.cfg.model):
        q, q_t, row = on.be.fp8.cached(on.p[name])
        for a in (q, q_t):
            assert lo <= a.data.ptr and a.data.ptr + a.nbytes <= hi and a.data.ptr % 256 == 0, name


def test_input_slots_in_the_engine(tmp_path):
    """Steps of two microbatches (current scaling), a skipped step among them and a resume from a
    state: the slots hold what the per-product quantisation makes of each saved input, the
    backward quantises no kept input again and the products of ln1 and ln2 run no k_fp8_amax: per
    layer and microbatch 4 k_fp8_amax passes (of the 9 without slots: 3 inputs in the forward, 3
    output gradients and the 3 inputs again in the backward; act's and dact's amax come from
    k_fp8_gelu_amax and k_fp8_dgelu_colsum_amax); no k_fp8_cast (the forward's casts transpose
    too), and no second k_fp8_gelu_amax and k_fp8_gelu_cast_transpose in the backward (fp8(act)^T
    kept)."""
    n_layer, n_micro = MODEL["n_layer"], 2
    mid = None
    eng = slot_engine(tmp_path)
    recs, counts = [], None
    for s in range(1, 8):
        if s == 1:
            log = launches(eng.be)
        if s == 5:
            eng.loss_scale = float("inf")
        recs.append(dict(eng.train_step(s, [batch(2 * s), batch(2 * s + 1)])))
        if s == 1:
            eng.be.synchronize()
            counts = {k: log.count(k) for k in ("k_fp8_amax", "k_fp8_cast", "k_fp8_cast_transpose",
                                                "k_fp8_cast_transpose_colsum", "k_fp8_gelu_amax",
                                                "k_fp8_gelu_cast_transpose", "k_fp8_dgelu_colsum_amax",
                                                "k_mlp_bwd_gelu")}
            del eng.be.rt.launch
            check_slots(eng, "step 1")
        if s == 5:
            eng.loss_scale = 1.0
        if s == 3:
            mid = eng.state()
    base = recs, counts, eng.host_state()
    assert [r["skipped"] for r in base[0]] == [False] * 4 + [True] + [False] * 2, base[0]
    assert all(np.isfinite(r["loss"]) for r in base[0] if not r["skipped"])
    per = n_layer * n_micro
    # cast_transpose: dact, and 3 kept X^T in the forward; the 3 dY of the layers with a bias (QKV,
    # the projection, the MLP's second) cast with their column sums; act's are
    # k_fp8_gelu_cast_transpose's, once a layer
    n_amax, n_cast, n_ct = 4, 0, 4
    n_gelu = 1
    assert counts == {"k_fp8_amax": n_amax * per, "k_fp8_cast": n_cast * per,
                      "k_fp8_cast_transpose": n_ct * per, "k_fp8_cast_transpose_colsum": 3 * per,
                      "k_fp8_gelu_amax": n_gelu * per,
                      "k_fp8_gelu_cast_transpose": n_gelu * per, "k_fp8_dgelu_colsum_amax": per,
                      "k_mlp_bwd_gelu": 0}, counts
    eng = slot_engine(tmp_path, seed=99)
    check_resume(eng, mid, base)
    eng.val_loss([batch(40)])  # a forward pass outside the step's graphs: the slots follow it
    check_slots(eng, "after val_loss")


def test_input_slots_plan_and_views(tmp_path):
    """The plan's input-slot rows are the arena's, each kept X^T a 256-byte aligned (IC, B*T)
    view inside fp8_xt (IC = C, and 4C for act). The layer-norm launchers find a slot by the
    input they write (ln1, ln2; the attention output's is never asked for); act, the workspace
    every layer's slot names, is found by none."""
    from andrea.core.plan import fp8_input_slots
    both = slot_engine(tmp_path)
    assert "fp8_xt" in both.bufs and "fp8_xmeta" in both.bufs
    data = both.bufs["fp8_xt"]
    lo, hi = data.data.ptr, data.data.ptr + data.nbytes
    for w, l, x in fp8_input_slots(both.cfg.model):
        slot = both.be.fp8.slots[both.p[w].data.ptr]
        IC = 4 * 48 if x == "act" else 48
        assert slot.xt.shape == (IC, 4 * 32) and lo <= slot.xt.data.ptr < hi and slot.xt.data.ptr % 256 == 0, w
        want = None if x == "act" else slot
        assert both.be.fp8.slot_of_input.get(both.slot_input(l, x).data.ptr) is want, w


def test_engine_fp8_classifier_same_bits_and_resume(tmp_path):
    """An fp8 engine whose vocabulary is a multiple of 16 runs the classifier in FP8 (wte in the
    weight cache, refreshed on its own): two runs bit-identical, a resume from the state after step
    3 bit-exact with the copies matching the weights, and close to (not equal to) the classifier in
    bf16 (the backend's fp8_classifier 0)."""
    from andrea.backends import get_backend
    from andrea.core.engine import Engine
    from andrea.core.plan import fp8_cached_weights
    model = dict(MODEL, vocab_size=96)

    def make(classifier=True, seed=None):
        from andrea.config import load_run_config
        d = small_config(tmp_path, batch_size=4, seq_len=32, precision="fp8", **({"seed": seed} if seed else {}))
        d["model"], d["backend"] = model, {"name": "cuda"}
        be = get_backend("cuda")
        be.fp8_classifier = 2 if classifier else 0  # level 2 (the logits too), dlogits rounded stochastically
        eng = Engine(load_run_config(d), backend=be)
        assert eng.fp8_classifier is classifier
        return eng

    def run(eng, steps=range(1, 8), mid=None):
        recs = []
        for s in steps:
            recs.append(dict(eng.train_step(s, [batch(2 * s, V=96), batch(2 * s + 1, V=96)])))
            if s == 3 and mid is not None:
                mid.append(eng.state())
        return recs, eng.host_state()

    mid = []
    a = run(make(), mid=mid)
    b = run(make())
    assert all(np.isfinite(r["loss"]) for r in a[0])
    assert repr(a[0]) == repr(b[0]), "two fp8 runs with the FP8 classifier differ"
    eng = make(seed=99)
    assert fp8_cached_weights(eng.cfg.model, eng.fp8_classifier)[0] == "wte"
    eng.load_state(mid[0])
    check_cache(eng, "load_state")
    c = run(eng, range(4, 8))
    assert repr(c[0]) == repr(a[0][3:]), "resumed run differs"
    for x, y in zip(c[1], a[1]):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), "resumed run's state differs"
    check_cache(eng, "after the resumed steps")
    off = run(make(classifier=False))
    la, lo = [r["loss"] for r in a[0]], [r["loss"] for r in off[0]]
    assert la != lo and max(abs(p - q) for p, q in zip(la, lo)) < 0.05 * lo[0]


def test_delayed_scales_in_the_engine(tmp_path):
    """fp8_scaling="delayed" (eight tensors a layer: act, dact, the attention output, dqkv, the
    residual stream's two gradients, ln1 and ln2): step 1 takes their amax first (k_fp8_gelu_amax,
    the dGELU pass once more, k_fp8_amax), the steps after take none (no amax pass at all: the
    classifier is in bf16 at this vocabulary) and the layer norms write ln1 and ln2 as FP8
    operands (k_layernorm_fwd_fp8, no cast after); after a step of one microbatch each history's
    newest entry is that step's amax (act, the attention output, ln1 and ln2 of every layer, dact
    of layer 0, whose raw gradient the workspace still holds), the older ones moved one place; a skipped step leaves them. Two runs are bit-identical, and an evaluation
    pass between steps changes nothing; a resume from a state (its history in it) repeats the steps
    bit for bit, a state without one starts over with the amax taken first. The same steps with
    current scaling end close to these."""
    import cupy as cp
    from andrea.backends.cuda.fp8.plan import DELAYED_HIST_AT
    n_layer = MODEL["n_layer"]
    runs, mid = [], None
    for run in range(2):
        eng = delayed_engine(tmp_path)
        fp8, sc = eng.be.fp8, eng.fp8_scales
        assert not sc.live and eng.state().fp8_amax_history is None
        recs, counts = [], []
        for s in range(1, 8):
            log = launches(eng.be)
            if s == 5:
                eng.loss_scale = float("inf")
            micro = [batch(2 * s)] if s in (2, 3) else [batch(2 * s), batch(2 * s + 1)]
            before = sc.block.get()
            ln_w = {n: eng.p[n].copy() for n in eng.p if ".ln1_" in n or ".ln2_" in n}  # as the step's forward had them
            recs.append(dict(eng.train_step(s, micro)))
            eng.be.synchronize()
            counts.append({k: log.count(k) for k in ("k_fp8_amax", "k_fp8_gelu_amax", "k_fp8_dgelu_colsum_amax",
                                                     "k_fp8_dgelu_cast_transpose_colsum_amax",
                                                     "k_fp8_gelu_cast_transpose_amax", "k_fp8_cast_transpose_amax",
                                                     "k_fp8_cast_transpose_colsum_amax", "k_fp8_cast_transpose",
                                                     "k_fp8_delayed_roll", "k_layernorm_fwd_fp8")})
            del eng.be.rt.launch
            after = sc.block.get()
            h0, h1 = before[:, DELAYED_HIST_AT:DELAYED_HIST_AT + 16], after[:, DELAYED_HIST_AT:DELAYED_HIST_AT + 16]
            if s == 5:
                eng.loss_scale = 1.0
                np.testing.assert_array_equal(h1, h0, err_msg="a skipped step moved the history")
            else:
                np.testing.assert_array_equal(h1[:, 1:], h0[:, :-1], err_msg=f"step {s}: the history did not move")
                assert np.all(h1[:, 0] > 0) and np.all(after[:, 0] == h1.max(axis=1)) and np.all(after[:, 1] == 0)
            if s in (2, 3):  # one microbatch: its amax is the newest entry
                for l in range(n_layer):
                    m, a = cp.zeros(2, cp.float32), cp.zeros(2, cp.float32)
                    fp8.k_fp8_gelu_amax(m, eng.layers[l]["pre"].reshape(-1, 4 * 48))
                    fp8.k_fp8_amax(a, eng.layers[l]["atty"].reshape(-1, 48))
                    assert h1[8 * l, 0] == m.get()[0], f"step {s}: act amax of layer {l}"
                    assert h1[8 * l + 2, 0] == a.get()[0], f"step {s}: attention output amax of layer {l}"
                    # ln1 and ln2 (never written in bf16): their layer norms again, with an amax
                    src1 = eng.g["x0"] if l == 0 else eng.layers[l - 1]["res_out"]
                    for k, (src, name) in enumerate(((src1, "ln1"), (eng.layers[l]["xmid"], "ln2"))):
                        out, am = cp.empty_like(src), cp.zeros(2, cp.float32)
                        stats = [cp.empty(src.shape[:-1], cp.float32) for _ in range(2)]
                        eng.be.k_layernorm_fwd(out, *stats, src, ln_w[f"h{l}.{name}_w"], ln_w[f"h{l}.{name}_b"],
                                               amax=am)
                        assert h1[8 * l + 6 + k, 0] == am.get()[0], f"step {s}: {name} amax of layer {l}"
                d, m = eng.g["dact"].reshape(-1, 4 * 48).copy(), cp.zeros(2, cp.float32)
                fp8.k_fp8_dgelu_colsum_amax(cp.zeros(64 * 4 * 48, cp.float32), m, d,
                                            eng.layers[0]["pre"].reshape(-1, 4 * 48), 2)
                assert h1[1, 0] == m.get()[0], f"step {s}: dact amax of layer 0"
            if run == 0 and s in (1, 4):  # evaluation (right after the first step too): records nothing
                eng.val_loss([batch(40)])
            if s == 3:
                mid = eng.state()
                assert np.array(mid.fp8_amax_history).shape == (8 * n_layer, 16)
        runs.append((recs, eng.host_state()))
        # step 1: two microbatches, eager (ln1 and ln2 written in bf16, their amax taken, then cast);
        # step 2: one, eager (its graphs' first run with a history): ln1 and ln2 from their layer norms
        per = n_layer * 2
        assert counts[0] == {"k_fp8_amax": 6 * per, "k_fp8_gelu_amax": per, "k_fp8_dgelu_colsum_amax": 0,
                             "k_fp8_dgelu_cast_transpose_colsum_amax": 2 * per,
                             "k_fp8_gelu_cast_transpose_amax": per, "k_fp8_cast_transpose_amax": 3 * per,
                             "k_fp8_cast_transpose_colsum_amax": 3 * per, "k_fp8_cast_transpose": 0,
                             "k_fp8_delayed_roll": 1, "k_layernorm_fwd_fp8": 0}, counts[0]
        assert counts[1] == {"k_fp8_amax": 0, "k_fp8_gelu_amax": 0, "k_fp8_dgelu_colsum_amax": 0,
                             "k_fp8_dgelu_cast_transpose_colsum_amax": n_layer,
                             "k_fp8_gelu_cast_transpose_amax": n_layer, "k_fp8_cast_transpose_amax": n_layer,
                             "k_fp8_cast_transpose_colsum_amax": 3 * n_layer, "k_fp8_cast_transpose": 0,
                             "k_fp8_delayed_roll": 1, "k_layernorm_fwd_fp8": 2 * n_layer}, counts[1]
        assert sc.live
    (a, sa), (b, sb) = runs
    assert [r["skipped"] for r in a] == [False] * 4 + [True] + [False] * 2, a
    assert_same_runs((a, sa), (b, sb), "two delayed runs (one with an evaluation between steps) differ")
    # resume from the state after step 3 (with its history): steps 4..7 as straight

    def live(e, when):
        assert e.fp8_scales.live, when
    eng = delayed_engine(tmp_path, seed=99)
    check_resume(eng, mid, (a, None, sa), live)
    # a state without a history (a checkpoint of current scaling): the next step takes its amax first
    mid.fp8_amax_history = None
    eng.load_state(mid)
    assert not eng.fp8_scales.live
    # current scaling, the same steps: close, not equal
    cur = delayed_engine(tmp_path, "current")
    c = [dict(cur.train_step(s, [batch(2 * s)] if s in (2, 3) else [batch(2 * s), batch(2 * s + 1)]))
         for s in range(1, 5)]
    assert all(abs(x["loss"] - y["loss"]) < 0.02 * y["loss"] for x, y in zip(a[:4], c)), (a[:4], c)
    assert repr(a[1:4]) != repr(c[1:4])


def test_attention_cast_in_the_engine(tmp_path):
    """Delayed scaling with the attention writing its output and dqkv as FP8 operands (T = 64,
    head size 16), over steps of two microbatches and one, a skipped step and an evaluation: step
    2 (the first with a history) runs the _fp8 kernels (a forward and a backward a layer) and no
    cast of the attention output or dqkv, step 1 none."""
    n_layer = MODEL["n_layer"]
    eng = engine_t64(tmp_path)
    recs, counts = [], []
    for s in range(1, 6):
        log = launches(eng.be)
        if s == 4:
            eng.loss_scale = float("inf")
        micro = [batch(3 * s, B=2, T=64)] if s == 2 else [batch(3 * s, B=2, T=64), batch(3 * s + 1, B=2, T=64)]
        recs.append(dict(eng.train_step(s, micro)))
        eng.be.synchronize()
        counts.append((len(micro), {k: log.count(k) for k in ("k_attn_flash_fwd_fp8", "k_attn_flash_bwd_dq_fp8",
                                                              "k_attn_flash_bwd_dkv_fp8",
                                                              "k_fp8_cast_transpose_amax",
                                                              "k_fp8_cast_transpose_colsum_amax")}))
        del eng.be.rt.launch
        eng.loss_scale = 1.0
        if s == 3:
            recs.append(eng.val_loss([batch(50, B=2, T=64)]))
    # step 2 (one microbatch, eager: its graphs' first run with a history); the residual stream's
    # two gradients are still cast
    assert counts[1][1] == {"k_attn_flash_fwd_fp8": n_layer, "k_attn_flash_bwd_dq_fp8": n_layer,
                            "k_attn_flash_bwd_dkv_fp8": n_layer, "k_fp8_cast_transpose_amax": 0,
                            "k_fp8_cast_transpose_colsum_amax": 2 * n_layer}, counts[1]
    assert counts[0][1]["k_attn_flash_fwd_fp8"] == 0, "step 1 (no history yet) took the FP8 attention"


def test_pdl_same_bits_t64(tmp_path):
    """Programmatic dependent launch (Runtime.pdl) at T = 64, where the attention runs its FP8
    forms (attention_hopper.cu) and the scales are delayed: the same records, weights and Adam
    state bits as ordinary launches over steps of two microbatches and one (eager, then from CUDA
    graphs), a skipped step and an evaluation; the attention's kernels went through
    cuLaunchKernelEx."""
    runs = []
    for on in (True, False):
        eng = engine_t64(tmp_path, pdl=on)
        launched = []
        launch = eng.be.rt.launch
        eng.be.rt.launch = lambda f, k, *a, **kw: (launched.append((k, eng.be.rt._pdl_launchable(f, k))),
                                                   launch(f, k, *a, **kw))[1]
        recs = []
        for s in range(1, 6):
            if s == 4:
                eng.loss_scale = float("inf")
            micro = [batch(7 * s, B=2, T=64)] if s == 2 else [batch(7 * s, B=2, T=64), batch(7 * s + 1, B=2, T=64)]
            recs.append(dict(eng.train_step(s, micro)))
            eng.be.synchronize()
            eng.loss_scale = 1.0
            if s == 3:
                recs.append(eng.val_loss([batch(70, B=2, T=64)]))
        del eng.be.rt.launch
        ready = {k for k, ok in launched if ok}
        assert {"k_attn_flash_fwd_fp8", "k_attn_flash_bwd_dq_fp8", "k_attn_flash_bwd_dkv_fp8"} <= ready, ready
        assert (eng.be.rt.pdl_launches > 0) == on, eng.be.rt.pdl_launches
        runs.append((recs, eng.host_state()))
    assert_same_runs(*runs, what="programmatic launches changed the run")

