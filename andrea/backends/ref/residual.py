"""The residual add (kernels/residual.cu)."""
from __future__ import annotations

import numpy as np


def k_residual_add(out, a, b):
    """out = a + b."""
    np.add(a, b, out=out)


def k_residual_add_bwd(da, db, dout):
    """da += dout, db += dout."""
    da += dout
    db += dout
