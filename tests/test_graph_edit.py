"""andrea/backends/cuda/graph_edit.py without a GPU: the 32-bit word a captured memset writes, and
which memsets are not one aligned word (left alone by the edit). The edit on real graphs is
tests/cuda/test_graph_edit_cuda.py's.

    python -m pytest tests/test_graph_edit.py -q
"""
import pytest

from andrea.backends.cuda.graph_edit import MemsetParams, pattern32


def params(dst=0x1000, value=0, element=4, width=1, height=1):
    return MemsetParams(dst=dst, pitch=0, value=value, elementSize=element, width=width, height=height)


@pytest.mark.parametrize("element, width, value, word", [
    (4, 1, 0, 0), (4, 1, 0xDEADBEEF, 0xDEADBEEF),
    (1, 4, 0xAB, 0xABABABAB), (1, 4, 0x1AB, 0xABABABAB),  # a byte memset keeps the low byte
    (2, 2, 0x1234, 0x12341234), (2, 2, 0xABCD1234, 0x12341234),
])
def test_the_word_a_memset_writes(element, width, value, word):
    assert pattern32(params(value=value, element=element, width=width)) == word


@pytest.mark.parametrize("kw", [dict(width=2), dict(element=1, width=8), dict(element=4, width=1, height=2),
                                dict(dst=0x1002), dict(element=1, width=2)])
def test_not_one_aligned_word(kw):
    assert pattern32(params(**kw)) is None
