"""dev/cuda/harness.py on the CPU: its cases and comparisons, run with the NumPy backend as the
"device" (float32 against the float64 reference), and a broken kernel it must catch.
On a GPU the same code checks CUDA variants: python dev/cuda/harness.py OP [vN ...]."""
from pathlib import Path

import numpy as np
import pytest

from andrea.backends import ref
from andrea.backends.interface import Backend
from andrea.backends.numpy_backend import NumpyBackend
from conftest import load_script

HARNESS = Path(__file__).resolve().parent.parent / "dev" / "cuda" / "harness.py"
SMALL = {"B": 2, "T": 9, "C": 16, "NH": 2, "V": 31}


@pytest.fixture(scope="module")
def harness():
    return load_script(HARNESS, "dev_cuda_harness")


def test_every_interface_kernel_has_a_case(harness):
    kernels = {c.kernel for cs in harness.cases.CASES.values() for c in cs}
    assert kernels == {n for n in vars(Backend) if n.startswith("k_")}


@pytest.mark.parametrize("op", ["embed", "layernorm", "linear", "attention", "decode", "mlp", "residual", "loss", "optim"])
def test_reference_in_float32_passes(harness, op):
    df = harness.run(op, ["main"], ["fp32"], reps=1, timing=True, backend=lambda *a: NumpyBackend(),
                     time_size=SMALL)
    assert len(df) == len(harness.cases.CASES[op])  # every case runs: the NumPy backend has every capability
    assert df.ok.all(), df.to_string()
    assert (df["rel err"] < 1e-5).all() and (df["ms"] > 0).all()


class Broken(NumpyBackend):
    """Writes instead of adding in one backward kernel, and forgets one forward element."""

    @staticmethod
    def k_residual_add_bwd(da, db, dout):
        da[...] = dout
        db += dout

    @staticmethod
    def k_layernorm_fwd(out, mean, rstd, inp, weight, bias):
        ref.k_layernorm_fwd(out, mean, rstd, inp, weight, bias)
        out.reshape(-1)[-1] = np.nan


@pytest.mark.parametrize("op,kernel", [("residual", "k_residual_add_bwd"), ("layernorm", "k_layernorm_fwd")])
def test_broken_kernel_fails(harness, op, kernel):
    df = harness.run(op, ["main"], ["fp32"], reps=1, timing=False, backend=lambda *a: Broken())
    bad = df[~df.ok]
    assert list(bad.kernel) == [kernel], df.to_string()


def test_unknown_variant_is_named(harness):
    with pytest.raises(SystemExit, match="layernorm_v99.cu: no such variant of layernorm"):
        harness.variants("layernorm", ["v99"])
    with pytest.raises(SystemExit, match="op 'softmax': expected one of"):
        harness.run("softmax", [], ["fp32"], 1, False)


def test_exp_size_is_the_experiments_step(harness):
    from andrea.pipeline.compose import compose_config
    size = harness.exp_size("ANDREA-12M")
    assert size["B"] * size["T"] == 8192 and size["C"] == 384  # the 12M step: 32 sequences of 256 tokens
    cfg = compose_config("ANDREA-120M")
    assert harness.exp_size("ANDREA-120M", batch=8) == {"B": 8, "T": 1024, "C": 768, "NH": 12, "V": 50304}
    assert harness.exp_size("ANDREA-120M")["B"] == cfg.train.batch_size != 8


def test_bad_exp_or_batch_is_named(harness):
    with pytest.raises(SystemExit, match="--exp ANDREA-7B: no such experiment"):
        harness.main(["layernorm", "--exp", "ANDREA-7B"])
    with pytest.raises(SystemExit, match="--batch 4: expected a positive B together with --exp"):
        harness.main(["layernorm", "--batch", "4"])


class AlwaysAdds(NumpyBackend):
    """Ignores accumulate=False: adds into the activation gradient it should write."""

    @staticmethod
    def k_attn_out_bwd(dinp, dw, db, dout, inp, w, accumulate=True):
        ref.k_attn_out_bwd(dinp, dw, db, dout, inp, w)


def test_write_mode_is_checked(harness):
    """Each backward kernel with an activation gradient has a case with accumulate=False, whose
    output starts as NaN: a kernel that adds there fails, in that case only."""
    modes = {(c.kernel, c.label) for cs in harness.cases.CASES.values() for c in cs if c.kwargs}
    assert {k for k, _ in modes} == {"k_layernorm_bwd", "k_attn_qkv_bwd", "k_attn_out_bwd", "k_attn_bwd",
                                     "k_mlp_bwd", "k_loss_bwd"}
    df = harness.run("linear", ["main"], ["fp32"], reps=1, timing=False, backend=lambda *a: AlwaysAdds())
    assert list(df[~df.ok].kernel) == ["k_attn_out_bwd accumulate=False"], df.to_string()
