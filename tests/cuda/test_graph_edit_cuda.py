"""The passes' graphs with cuBLAS(Lt)'s counter memsets replaced by a kernel node
(andrea/backends/cuda/graph_edit.py, CudaBackend(graph_edits=...)): the same records, weights and
Adam state bits as the graphs as captured, over steps replayed from the graphs and an evaluation;
on Hopper at ANDREA-12M's shape (where cuBLASLt's algorithms zero their counter) the edit replaced
memsets; on a real capture, what the edit finds and leaves.

    python -m pytest -q -m gpu tests/cuda/test_graph_edit_cuda.py
"""
import numpy as np
import pytest

from cudakit import fp8_gpu
from fp8kit import assert_same_runs

from andrea.backends import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")]


def run(precision, on, steps=6):
    from andrea.bench.step import bench_config, cuda_backend, random_batches
    from andrea.core.engine import Engine
    cfg = bench_config("ANDREA-12M", precision, 32, steps + 1)
    be = cuda_backend(None, graph_edits=on)
    eng = Engine(cfg, backend=be)
    batches = random_batches(cfg.model.vocab_size, 32, cfg.model.context)
    recs = []
    for s in range(1, steps + 1):
        recs.append(dict(eng.train_step(s, [batches[s % 4]])))
        if s == 3:
            recs.append(eng.val_loss([batches[0]]))
    eng.be.synchronize()
    return (recs, eng.host_state()), be, [g for g, _ in eng.graphs.graphs.values()]


@pytest.mark.parametrize("precision", ["fp16", pytest.param("fp8", marks=pytest.mark.skipif(
    not fp8_gpu(), reason="needs FP8 tensor cores (compute capability 8.9 or later)"))])
def test_graph_edits_same_bits(precision):
    import cupy as cp
    on, be_on, graphs_on = run(precision, True)
    off, be_off, _ = run(precision, False)
    assert_same_runs(on, off, what="the edited graphs changed the run")
    assert be_off.graph_memsets_replaced == 0
    if int(cp.cuda.Device().compute_capability) < 90:
        return  # the algorithms with counters were seen on sm_90; elsewhere the bits are the check
    assert be_on.graph_memsets_replaced > 0, "no counter memset replaced: the algorithms cuBLAS(Lt) picks changed"
    edited = [g for g in graphs_on if hasattr(g, "original")]
    assert edited, "no graph of the run was edited"
    for g in edited:  # what runs, as DOT: the counter stores in, fewer memsets than captured
        dot, captured = g.debug_dot_str(), g.original.debug_dot_str()
        dot, captured = (x.decode() if isinstance(x, bytes) else x for x in (dot, captured))
        assert "k_graph_counter_store" in dot and "k_graph_counter_store" not in captured
        assert dot.count("MEMSET") < captured.count("MEMSET")


def test_counter_memsets_replaced_on_a_captured_pass():
    """graph_edit on a real capture: the counter memsets are 4-byte ones in a workspace before
    kernels; after the edit there are none, as many kernel nodes more as memsets less, and each
    memset's dependents now follow a node that had its dependencies."""
    import cupy as cp
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("the shapes' cuBLASLt algorithms with counters were seen on sm_90")
    from andrea.backends.cuda import graph_edit as ge
    from andrea.bench.step import cuda_backend, spy_graphs, bench_config, random_batches
    from andrea.core.engine import Engine
    cfg = bench_config("ANDREA-12M", "fp16", 32, 4)
    be = cuda_backend(None, graph_edits=False)
    eng = Engine(cfg, backend=be)
    used = spy_graphs(eng)
    batches = random_batches(cfg.model.vocab_size, 32, cfg.model.context)
    for s in (1, 2, 3):
        eng.train_step(s, [batches[s]])
    g = eng.graphs.graphs[used["passes"]][0]
    drv = ge.Driver()
    spaces = [(be.blas.workspace.data.ptr, be.blas.workspace.data.ptr + be.blas.workspace.nbytes),
              (be.lt.workspace.data.ptr, be.lt.workspace.data.ptr + be.lt.workspace.nbytes)]
    clone = drv.clone(g.graph)
    found = ge.counter_memsets(drv, clone, spaces)
    assert found
    before = {m: ([q for q, _ in drv.preds(m)], [x for x, _ in drv.succs(m)]) for m, _ in found}
    for m, word in found:
        p = drv.memset(m)
        assert p.elementSize * p.width * p.height == 4 and any(a <= p.dst < b for a, b in spaces)
        assert word == 0  # cuBLAS(Lt) zero their counters
    kinds = [drv.kind(n) for n in drv.nodes(clone)]
    assert ge.replace_counter_memsets(drv, clone, ge.store_function(), spaces) == len(found)
    assert ge.counter_memsets(drv, clone, spaces) == []
    after = [drv.kind(n) for n in drv.nodes(clone)]
    assert after.count(ge.CU_GRAPH_NODE_TYPE_MEMSET) == kinds.count(ge.CU_GRAPH_NODE_TYPE_MEMSET) - len(found)
    assert after.count(ge.CU_GRAPH_NODE_TYPE_KERNEL) == kinds.count(ge.CU_GRAPH_NODE_TYPE_KERNEL) + len(found)
    for preds, succs in before.values():
        for x in succs:
            zs = [q for q, _ in drv.preds(x) if drv.kind(q) == ge.CU_GRAPH_NODE_TYPE_KERNEL
                  and sorted(p for p, _ in drv.preds(q)) == sorted(preds)]
            assert zs, "a dependent lost the memset's place"
    ex = drv.instantiate(clone)
    drv.launch(ex, cp.cuda.get_current_stream().ptr)
    cp.cuda.get_current_stream().synchronize()
    drv.destroy(g=clone, ex=ex)
    assert np.isfinite(eng.val_loss([batches[0]]))
