"""linear_v1.cu's column sums: k_colsum_partial then k_colsum_final (two launches), for every bias
gradient of the linear layers' backward launchers."""
import types

import numpy as np

from andrea.backends.cuda.ops import COLSUM_CHUNKS, THREADS, i32, i64


def _colsum_add(be, out, x, N, Cc, slot="colsum_a"):
    rpc = -(-N // COLSUM_CHUNKS)
    chunks = -(-N // rpc)
    part = be.workspace.get(slot, chunks * Cc, np.float32)
    be.rt.launch("linear.cu", "k_colsum_partial", x.dtype, (-(-Cc // 32), chunks), (32, 8),
                 (part, x, i64(N), i32(Cc), i32(rpc)))
    be.rt.launch("linear.cu", "k_colsum_final", x.dtype, -(-Cc // 8), THREADS, (out, part, i32(chunks), i32(Cc)))


def _with_v1(name):
    def launcher(be, *args):
        be._colsum_add = types.MethodType(_colsum_add, be)  # this variant's backend only
        return getattr(type(be), name)(be, *args)
    return launcher


k_attn_qkv_bwd = _with_v1("k_attn_qkv_bwd")
k_attn_out_bwd = _with_v1("k_attn_out_bwd")
