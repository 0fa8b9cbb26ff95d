"""The floor table's bookkeeping (andrea/bench/floor.py), on the CPU: the products it lists for a
step are exactly the model's matrix work, counted independently from the parameter layout, and
the table's arithmetic (gap, ordering, the time outside kernels) is what it says."""
import pytest

from andrea.bench import floor
from andrea.config import ModelConfig
from andrea.core import model


@pytest.mark.parametrize("B,T,C,NH,V,L", [(3, 37, 48, 4, 101, 2), (8, 1024, 768, 12, 50304, 12)])
def test_products_are_six_flops_per_token_per_matrix_weight(B, T, C, NH, V, L):
    m = ModelConfig(name="t", n_layer=L, d_model=C, n_head=NH, context=T, vocab_size=V)
    layout = model.ParamLayout.from_config(m)
    # every weight that enters a product: the matrices, less wpe (added, never multiplied)
    matrix_weights = layout.n_decay - T * C
    work = floor.step_work(B, T, C, NH, V, L, layout.n_params)
    assert sum(w.gemm_flops() for w in work.values()) == 6 * B * T * matrix_weights
    # attention: forward 2*B*T^2*C per layer (causal half of QK^T and PV), backward 2.5 times that
    assert sum(w.attn_flops for w in work.values()) == pytest.approx(3.5 * L * 2 * B * T * T * C)
    # one entry per kernel the step launches
    assert set(work) >= {"k_loss_bwd", "k_mlp_fwd", "k_mlp_bwd", "k_attn_fwd", "k_attn_bwd", "k_adamw_step"}


def test_floors_use_each_products_own_rate_and_the_larger_of_flops_and_bytes():
    g1, g2 = (64, 32, 16, False, True), (16, 32, 64, True, False)
    work = {"a": floor.Work(1, [g1, g2]), "b": floor.Work(1, attn_flops=2e12, bytes=1e9),
            "c": floor.Work(1, attn_flops=1e9, bytes=4e9)}
    ms = floor.floors(work, {g1: 1.0, g2: 2.0}, peak_tflops=1000.0, bw_gbs=1000.0)
    assert ms["a"] == pytest.approx((2 * 64 * 32 * 16 / 1e12 + 2 * 16 * 32 * 64 / 2e12) * 1e3)
    assert ms["b"] == pytest.approx(2.0)  # 2 TFLOP at 1000 TFLOP/s beats 1 GB at 1000 GB/s
    assert ms["c"] == pytest.approx(4.0)  # 4 GB at 1000 GB/s


def test_table_sorts_by_gap_and_counts_the_time_outside_kernels():
    df = floor.table({"x": 3.0, "y": 1.0}, {"x": 2.5, "y": 0.2, "z": 0.1}, step_ms=5.0)
    body = df.drop(index="total")
    assert list(body.index) == ["(step outside its kernels)", "y", "x", "z"]
    assert body.loc["(step outside its kernels)", "ours_ms"] == pytest.approx(1.0)
    assert df.loc["total", "floor_ms"] == pytest.approx(2.8)
    assert df.loc["total", "gap_ms"] == pytest.approx(5.0 - 2.8)
    assert df.loc["y", "ours/floor"] == pytest.approx(5.0)
