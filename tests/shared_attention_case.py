"""Random inputs of the shared-context attention (k_attn_shared_fwd) and the whole sequences it
stands for, for its NumPy test (tests/ref/test_decode.py) and its GPU test
(tests/cuda/test_decode_cuda.py)."""
import numpy as np

GAP = 2  # NaN rows between the prefixes in saved: a read past a prefix shows


def shared_case(rng, NH, hs, groups=((9, (3, 1, 4)), (5, (2, 2)), (1, (1,)))):
    """Groups (prefix length, the row counts of its options), each option = its group's prefix +
    its own rows: (every whole sequence's qkv, saved (M,3C) holding the prefixes one after another
    with GAP NaN rows between them, the options' rows (R,1,3C), pre, plen, first (R,) int32, and
    each row's (sequence, position))."""
    C = NH * hs
    saved = np.full((sum(p + GAP for p, _ in groups), 3 * C), np.nan)
    seqs, rows, pre, plen, first, where = [], [], [], [], [], []
    at = 0
    for p, opts in groups:
        prefix = rng.normal(size=(p, 3 * C))
        saved[at:at + p] = prefix
        for s in opts:
            own = rng.normal(size=(s, 3 * C))
            f = len(rows)
            for i in range(s):
                rows.append(own[i])
                pre.append(at), plen.append(p), first.append(f), where.append((len(seqs), p + i))
            seqs.append(np.concatenate([prefix, own]))
        at += p + GAP
    ints = [np.array(a, np.int32) for a in (pre, plen, first)]
    return seqs, saved, np.array(rows)[:, None], *ints, where
