"""The launcher of layernorm_v2.cu's backward: the block partials of dweight/dbias, then two
k_colsum_final launches add them in block order; 264 blocks (two per SM of an H200)."""
import numpy as np

from andrea.backends.cuda.ops import THREADS, i32, i64

BLOCKS = 264


def k_layernorm_bwd(be, dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True):
    C = inp.shape[-1]
    N = inp.size // C
    ct = inp.dtype
    vec = 16 // ct.itemsize
    if C > 1024 or C % vec:
        raise SystemExit(f"layernorm_v2: C={C} is not a width of version 3 (whole 16-byte vectors, C <= 1024)")
    rpb = -(-N // BLOCKS)
    n_blocks = -(-N // rpb)
    pdw = be.workspace.get("colsum_a", n_blocks * C, np.float32)
    pdb = be.workspace.get("colsum_b", n_blocks * C, np.float32)
    be.rt.launch("layernorm.cu", "k_layernorm_bwd_fused", ct, n_blocks, THREADS,
                 (dinp, pdw, pdb, dout, inp, weight, mean, rstd, i64(N), i32(C), i32(rpb)),
                 defs=(f"-DLN_MAXC={-(-C // (32 * vec)) * 32 * vec}", f"-DLN_ACCUMULATE={int(bool(accumulate))}"))
    be.rt.launch("linear.cu", "k_colsum_final", ct, -(-C // 8), THREADS, (dweight, pdw, i32(n_blocks), i32(C)))
    be.rt.launch("linear.cu", "k_colsum_final", ct, -(-C // 8), THREADS, (dbias, pdb, i32(n_blocks), i32(C)))
