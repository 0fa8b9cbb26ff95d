"""The launcher of layernorm_v4.cu's backward: blocks of 4 warps, as many as fit on the SMs at
once (occupancy API); rows a warp-step, slots and the early or late dinp load chosen as the
package's launcher chooses them for version 4, and the same reduction tree."""
import math

import numpy as np

from andrea.backends.cuda.ops import LN_FUSED_MAXC, LN_MAX_SLOTS, LN_ROWS_CHOICES, cp, i32, i64

THREADS_V4 = 128


def k_layernorm_bwd(be, dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    C = inp.shape[-1]
    N = inp.size // C
    ct = inp.dtype
    vec = 16 // ct.itemsize
    if C > LN_FUSED_MAXC or C % vec:
        raise SystemExit(f"layernorm_v4: C={C} is not a width of version 4 (whole 16-byte vectors, C <= 1024)")
    nq = C // vec

    def slots(r):
        return -(-r * nq // 32)
    fits = [r for r in LN_ROWS_CHOICES if r == 1 or slots(r) <= LN_MAX_SLOTS]
    rows = min(fits, key=lambda r: (slots(r) * 32 / (r * nq), r))
    drv = cp.cuda.driver
    for early in (1, 0):
        defs = (f"-DLN_ROWS={rows}", f"-DLN_SLOTS={slots(rows)}", f"-DLN_DINP_EARLY={early}")
        f = be.rt.function("layernorm.cu", "k_layernorm_bwd_tree", ct, defs)
        if drv.funcGetAttribute(3, f.kernel.ptr) == 0:  # 3: CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
            break
    per_sm = max(1, drv.occupancyMaxActiveBlocksPerMultiprocessor(f.kernel.ptr, THREADS_V4, 0))
    target = be.ln_blocks or per_sm * cp.cuda.Device().attributes["MultiProcessorCount"]
    rpb = -(-(-(-N // target)) // rows) * rows
    n_blocks = -(-N // rpb)
    group = be.ln_group or max(1, math.isqrt(n_blocks))
    n_groups = -(-n_blocks // group)
    pdw = be.workspace.get("colsum_a", (n_blocks + n_groups) * C, np.float32)
    pdb = be.workspace.get("colsum_b", (n_blocks + n_groups) * C, np.float32)
    cnt = be._ln_counters(n_groups + 1)
    be.rt.launch("layernorm.cu", "k_layernorm_bwd_tree", ct, n_blocks, THREADS_V4,
                 (dinp, dweight, dbias, pdw, pdb, cnt, dout, inp, weight, mean, rstd, i64(N), i32(C), i32(rpb),
                  i32(group)), defs=defs)
