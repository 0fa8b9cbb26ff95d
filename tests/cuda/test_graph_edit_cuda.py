"""The passes' graphs with cuBLAS(Lt)'s counter memsets moved beside the kernel before them
(andrea/backends/cuda/graph_edit.py, CudaBackend(graph_edits=...)): the same records, weights and
Adam state bits as the graphs as captured, over steps replayed from the graphs and an evaluation;
on Hopper at ANDREA-12M's shape (where cuBLASLt's algorithms zero their counter) the edit moved
memsets, and the capture showed the premise (every edge from our kernels to a library's is
programmatic).

    python -m pytest -q -m gpu tests/cuda/test_graph_edit_cuda.py
"""
import numpy as np
import pytest

from cudakit import fp8_gpu
from fp8kit import assert_same_runs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores and CuPy")]


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
    return (recs, eng.host_state()), be


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_graph_edits_same_bits(precision):
    import cupy as cp
    on, be_on = run(precision, True)
    off, be_off = run(precision, False)
    assert_same_runs(on, off, what="the edited graphs changed the run")
    assert be_off.graph_memsets_moved == 0
    if int(cp.cuda.Device().compute_capability) >= 90:
        assert be_on.graph_memsets_moved > 0, "no memset moved: the premise or the shapes changed"


def test_library_edges_and_moves_on_a_captured_pass():
    """graph_edit's queries on a real capture: the edges from our kernels to cuBLAS(Lt)'s are all
    programmatic (the premise), the movable memsets are 4-byte ones in a workspace, and after the
    edit none is movable any more and each product has a programmatic edge from the kernel before."""
    import cupy as cp
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
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
    drv, ours = ge.Driver(), be.rt.pdl_functions
    spaces = [(be.blas.workspace.data.ptr, be.blas.workspace.data.ptr + be.blas.workspace.nbytes),
              (be.lt.workspace.data.ptr, be.lt.workspace.data.ptr + be.lt.workspace.nbytes)]
    edges = ge.library_edges(drv, g.graph, ours)
    assert edges["programmatic"] > 0 and edges["full"] == 0, edges
    clone = drv.clone(g.graph)
    moves = ge.movable_memsets(drv, clone, ours, spaces)
    assert moves
    for m, k in moves:
        p = drv.memset(m)
        assert p.elementSize * p.width * p.height == 4 and any(a <= p.dst < b for a, b in spaces)
    products = {m: [s for s, _ in drv.succs(m)] for m, _ in moves}
    assert ge.hoist_counter_memsets(drv, clone, ours, spaces) == len(moves)
    assert ge.movable_memsets(drv, clone, ours, spaces) == []
    for m, k in moves:
        assert all(ge.is_programmatic(d) for q, d in drv.preds(products[m][0]) if q == k)
        assert any(q == k for q, _ in drv.preds(products[m][0]))
        assert k not in [q for q, _ in drv.preds(m)]
    drv.destroy(g=clone)
    assert np.isfinite(eng.val_loss([batches[0]]))
