"""Host-side helpers of the CUDA backend that need no GPU."""
import math

import numpy as np
import pytest

from andrea.backends.cuda.geometry import attn_scale


@pytest.mark.parametrize("hs", [1, 7, 16, 48, 64, 97, 128])
def test_attn_scale_is_one_over_sqrt_head_size_in_float32(hs):
    s = attn_scale(hs)
    assert isinstance(s, np.float32)
    assert s == np.float32(1.0 / math.sqrt(hs))
