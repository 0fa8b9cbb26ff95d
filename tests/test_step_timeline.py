"""dev/step_timeline.py on the CPU: its reading of a device timeline (kinds, gaps, overlaps, the
sums by boundary) on events made here, the kernel names it takes from kernels/, and its exit code
where no GPU is.

    python -m pytest tests/test_step_timeline.py -q
"""
from pathlib import Path

import pandas as pd
import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def st():
    return load_script(ROOT / "dev" / "step_timeline.py", "step_timeline")


def events(rows):
    return pd.DataFrame(rows, columns=["cat", "name", "ts", "dur"])


# two "steps": ours -> library (gap 2) -> memset (gap 5) -> ours overlapping it by 1, then the same
# again 100 us later; listed out of order on purpose
STEP = [("kernel", "k_attn_flash_fwd", 0.0, 10.0), ("kernel", "nvjet_sm90_tst_128x256", 12.0, 18.0),
        ("gpu_memset", "Memset (Device)", 35.0, 2.0), ("kernel", "void k_adamw_step<float>(float*)", 36.0, 4.0)]
ROWS = [(c, n, t + 100.0 * r, d) for r in (1, 0) for c, n, t, d in STEP]


def test_kernel_names_come_from_the_sources(st):
    names = st.our_kernel_names()
    assert {"k_attn_flash_fwd", "k_adamw_step", "loss_bwd_fp8_regs"} <= names
    assert not any(n.startswith("nvjet") for n in names)


def test_kinds(st):
    ours = {"k_attn_flash_fwd", "k_adamw_step"}
    assert st.kind_of("k_attn_flash_fwd", "kernel", ours) == "ours"
    assert st.kind_of("void k_adamw_step<float>(float*)", "kernel", ours) == "ours"
    assert st.kind_of("nvjet_sm90_tst_128x256", "kernel", ours) == "library"
    assert st.kind_of("Memset (Device)", "gpu_memset", ours) == "memset"
    assert st.kind_of("Memcpy DtoD", "gpu_memcpy", ours) == "memcpy"


def test_gaps_and_sums(st):
    t = st.timeline(events(ROWS), {"k_attn_flash_fwd", "k_adamw_step"}, 2)
    assert list(t.ts) == sorted(t.ts)
    # within a step: 2 idle (ours -> library), 5 idle (library -> memset), -1 (memset -> ours);
    # between the steps: 100 - 40 = 60 idle (ours -> ours); the last event has no gap
    assert list(t.gap[:4]) == [2.0, 5.0, -1.0, 60.0]
    assert pd.isna(t.gap.iloc[-1])
    s = st.summary(t, 2)
    assert s["events_per_step"] == 4
    assert s["span_us"] == pytest.approx(140.0 / 2)
    assert s["busy_us"] == pytest.approx(2 * 34.0 / 2)
    assert s["idle_us"] == pytest.approx((2 * (2 + 5) + 60) / 2)
    assert s["overlap_us"] == pytest.approx(2 * 1 / 2)
    b = st.gaps_by_boundary(t, 2)
    assert b.loc["ours -> library", "us_per_step"] == pytest.approx(2.0)
    assert b.loc["library -> memset", "us_per_step"] == pytest.approx(5.0)
    assert b.loc["ours -> ours", "us_per_step"] == pytest.approx(30.0)
    assert b.loc["memset -> ours", "us_per_step"] == 0.0  # an overlap is not idle time
    assert b.index[0] == "ours -> ours"  # the largest first
    top = st.largest_gaps(t, 2)
    assert top.iloc[0].name == ("void k_adamw_step<float>(float*)", "k_attn_flash_fwd")
    k = st.kernels_by_name(t, 2)
    assert k.loc[("library", "nvjet_sm90_tst_128x256"), "us_per_step"] == pytest.approx(18.0)


def test_a_gap_counts_from_the_latest_end_so_far(st):
    # a memset started beside a long kernel: the product after both waits on the kernel's end,
    # not the memset's, so only 1 us of idle lies before it (not the 8 from the memset's end)
    rows = [("kernel", "k_attn_flash_fwd", 0.0, 10.0), ("gpu_memset", "Memset (Device)", 1.0, 1.0),
            ("kernel", "nvjet_sm90_tst", 11.0, 5.0)]
    t = st.timeline(events(rows), {"k_attn_flash_fwd"}, 1)
    assert list(t.gap[:2]) == [-9.0, 1.0]
    s = st.summary(t, 1)
    assert s["idle_us"] == 1.0 and s["overlap_us"] == 9.0


def test_no_events_is_an_error(st):
    with pytest.raises(SystemExit, match="no device events"):
        st.timeline(events([]), set(), 1)


def test_exits_2_without_a_gpu(st, capsys):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed: the script would run")
    except ImportError:
        pass
    assert st.main(["--exp", "ANDREA-tiny"]) == 2
    assert "needs CuPy" in capsys.readouterr().err
