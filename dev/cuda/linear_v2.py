"""linear_v2.cu's k_colsum: every bias gradient of the linear layers' backward launchers as one
launch (the last block of each column group adds the row chunks in order, elected by an integer
counter that it resets), 16-byte loads where the rows are whole aligned vectors."""
import types

import numpy as np

from andrea.backends.cuda.ops import COLSUM_CHUNKS, i32, i64

COUNTERS = 1024  # column groups: 32768 columns on the scalar path


def _colsum_add(be, out, x, N, Cc, slot="colsum_a"):
    rpc = -(-N // COLSUM_CHUNKS)
    chunks = -(-N // rpc)
    vec = 16 // x.dtype.itemsize
    use_vec = Cc % vec == 0 and x.data.ptr % 16 == 0
    groups = -(-Cc // (32 * (vec if use_vec else 1)))
    part = be.workspace.get(slot, chunks * Cc, np.float32)
    cnt = be.workspace.get("colsum_counters", max(groups, COUNTERS), np.uint32)
    if getattr(be, "_counters_zeroed", None) != cnt.data.ptr:  # zero between launches: each resets its own
        cnt.fill(0)
        be._counters_zeroed = cnt.data.ptr
    be.rt.launch("linear.cu", "k_colsum", x.dtype, (groups, chunks), (32, 8),
                 (out, part, cnt, x, i64(N), i32(Cc), i32(rpc), i32(int(use_vec))))


def _with_v2(name):
    def launcher(be, *args, **kw):
        be._colsum_add = types.MethodType(_colsum_add, be)  # this variant's backend only
        return getattr(type(be), name)(be, *args, **kw)
    return launcher


k_attn_qkv_bwd = _with_v2("k_attn_qkv_bwd")
k_attn_out_bwd = _with_v2("k_attn_out_bwd")
