"""The launcher of mlp_v1.cu: the MLP backward as it was, GELU recomputed by one kernel and its
derivative in cuBLASLt's dGELU epilogue (k_mlp_bwd_dgelu where that does not apply)."""

from andrea.backends.cuda.ops import THREADS, blocks, i64


def k_mlp_bwd(be, dinp, dw1, db1, dw2, db2, dout, inp, pre, w1, w2, act, dact):
    H, C = w1.shape
    ct, N = w1.dtype, inp.size // C
    be.rt.launch("mlp.cu", "k_mlp_bwd_gelu", ct, blocks(N * H), THREADS, (act, pre, i64(N * H)))
    be.blas.gemm(dw2, dout, act, True, False, C, H, N, C, H, H, beta=1.0)
    be._colsum_add(db2, dout, N, C)
    if not be._lt_matmul(dact, dout, w2, False, False, N, H, C, C, H, H, "dgelu", aux=pre, aux_ld=H):
        be.blas.gemm(dact, dout, w2, False, False, N, H, C, C, H, H)
        be.rt.launch("mlp.cu", "k_mlp_bwd_dgelu", ct, blocks(N * H), THREADS, (dact, pre, i64(N * H)))
    be._linear_bwd("k_mlp_bwd", dinp, dw1, db1, dact, inp, w1)
