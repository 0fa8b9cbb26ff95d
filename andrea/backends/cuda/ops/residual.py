"""The residual connection (kernels/residual.cu): k_residual_add, k_residual_add_bwd. (The add
that a layer norm follows runs fused into it: ops/layernorm.py k_residual_layernorm_fwd.)"""
from __future__ import annotations

from ..runtime import THREADS, blocks, check, i64


class ResidualOps:
    """k_residual_add and k_residual_add_bwd of the CUDA backend."""

    def k_residual_add(self, out, a, b):
        """out = a + b."""
        for n, x in (("out", out), ("a", a), ("b", b)):
            check("k_residual_add", n, x, a.shape, a.dtype)
        self.rt.launch("residual.cu", "k_residual_add", a.dtype, blocks(a.size), THREADS, (out, a, b, i64(a.size)))

    def k_residual_add_bwd(self, da, db, dout):
        """da += dout, db += dout."""
        for n, x in (("da", da), ("db", db), ("dout", dout)):
            check("k_residual_add_bwd", n, x, dout.shape, dout.dtype)
        self.rt.launch("residual.cu", "k_residual_add_bwd", dout.dtype, blocks(dout.size), THREADS,
                       (da, db, dout, i64(dout.size)))
