"""dev/graph_probe.py on the CPU: its reading of a CUDA graph's DOT (the nodes in order, the census
by type and kernel name, what follows each memset) and its exit code where no GPU is.

    python -m pytest tests/test_graph_probe.py -q
"""
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent

# the form cudaGraphDebugDotPrint writes (flags 0): a node's label is its index, then a kernel's
# name or the node's type and its parameters; nodes listed out of order on purpose
DOT = '''digraph dot {
subgraph cluster_4 {
label="graph_4" graph[style="dashed"];
"graph_4_node_1"[style="solid" shape="invtrapezium"label="1
MEMSET
(0,4)
"];

"graph_4_node_0"[style="bold" shape="octagon" label="0
k_layernorm_fwd_fp8
"];

"graph_4_node_2"[style="bold" shape="octagon" label="2
nvjet_sm90_qqtst_192x192_TNN
"];

"graph_4_node_3"[style="bold" shape="octagon" label="3
k_attn_flash_fwd_fp8
"];

"graph_4_node_4"[style="solid" shape="invtrapezium"label="4
MEMSET
(0,3145728)
"];

"graph_4_node_0" -> "graph_4_node_1" [style="solid"];
"graph_4_node_1" -> "graph_4_node_2" [style="solid"];
"graph_4_node_2" -> "graph_4_node_3" [style="solid"];
"graph_4_node_3" -> "graph_4_node_4" [style="solid"];
}
}
'''


@pytest.fixture(scope="module")
def gp():
    return load_script(ROOT / "dev" / "graph_probe.py", "graph_probe")


def test_dot_nodes_in_index_order(gp):
    assert gp.dot_nodes(DOT) == [("k_layernorm_fwd_fp8", ""), ("MEMSET", "(0,4)"),
                                 ("nvjet_sm90_qqtst_192x192_TNN", ""), ("k_attn_flash_fwd_fp8", ""),
                                 ("MEMSET", "(0,3145728)")]


def test_census(gp):
    types, kernels, after = gp.census(DOT)
    assert types == {"KERNEL": 3, "MEMSET": 2}
    assert kernels == {"k_layernorm_fwd_fp8": 1, "nvjet_sm90_qqtst_192x192_TNN": 1, "k_attn_flash_fwd_fp8": 1}
    assert after == {"nvjet_sm90_qqtst_192x192_TNN": 1}  # the last memset has no successor


def test_without_a_gpu_it_says_so(gp, capsys):
    from andrea.backends import cuda_available
    if cuda_available():
        pytest.skip("a GPU is here")
    assert gp.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_node_of_another_label_form_is_named_not_lost(gp):
    """A node whose label is not "index / name / arguments" (or has none) keeps its index, named
    "?", so that the edges after it still name the right nodes (a list short of it raised)."""
    odd = DOT.replace('label="3\nk_attn_flash_fwd_fp8\n"', 'shape="box"')
    nodes = gp.dot_nodes(odd)
    assert len(nodes) == 5 and nodes[3] == ("?", "") and nodes[4] == ("MEMSET", "(0,3145728)")
    types, kernels, after = gp.census(odd)
    assert types == {"KERNEL": 3, "MEMSET": 2} and kernels["?"] == 1
