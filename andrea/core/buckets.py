"""The gradient sum over the ranks in buckets, issued during the last backward pass of a step.

    cap = bucket_bytes_requested()          # ANDREA_DDP_BUCKET_MB (default 25 MB on NumPy ranks, 0 on GPUs; 0: no buckets)
    plan = plan_buckets(layout, n_layer, grads.size, cap)   # [Bucket], in the order they are issued
    gb = GradBuckets(comm, grads, plan, zero1)
    model.backward(..., ready=gb.ready)     # the last microbatch's pass: ready(l) after layer l,
                                            # ready(None) once every gradient is final

Without buckets the engine sums the whole gradient buffer over the ranks in one call after the
last backward pass (Engine._optimizer). With them, the sum of a layer's weight gradients is issued
as soon as the backward pass has finished them, last layer first, as PyTorch DDP does, so that on
the GPU it runs while the earlier layers' backward kernels do.

What is final when. The backward pass (model.backward) runs the layers from the last to the
first; layer l's four matrices (qkv_w, attn_out_w, mlp_w1, mlp_w2) are written only by layer l's
kernels, by matrix products that finish them at once (interface.param_grad_pass may hold back only
the column sums of biases and layer-norm weights). The biases and layer-norm parameters, wte (the
classifier's and the embedding's contributions: the first and the last kernel of the pass), wpe,
and ZeRO-1's padding are final only when the pass closes: they are the last bucket.

The buckets are contiguous: the flat buffer keeps every layer's matrices together, layer after
layer (model.param_shapes), so layers L-1 .. k are the range [start of layer k, start of layer
L). A bucket takes whole layers, from the last, until it holds at least the cap's bytes (a layer
is never split: on ANDREA-120M one layer's matrices are 28 MB, so 25 MB gives a bucket a layer).
The last bucket is two ranges: [0, start of layer 0) (wte, wpe) and [n_decay, end) (the vectors).

The same bits as one sum of the whole buffer. The plan depends on the layout and the cap alone,
so every rank issues the same buckets in the same order. The sum is element by element over the
ranks: on MPI (NumPy) every element is rank 0's + rank 1's + ... in that order
(comm.MpiComm._sum_in_rank_order), whichever call carries it, so the buckets cannot change a bit;
under ZeRO-1 each bucket's elements go to the rank whose shard holds them and are added there in
the same rank order (MpiComm.reduce_scatter_sum with a range). NCCL does not promise an order per
element: with 2 ranks each element is one addition, a + b, which is the same bits in either order,
so buckets change nothing; with 3 or more the order can depend on where an element falls in the
call (docs/DISTRIBUTED.md).

CUDA: each bucket's NCCL call runs on a second stream (GradBuckets.stream), which waits for an
event recorded on the compute stream after the kernels that finish the bucket; ready(None) makes
the compute stream wait for the last of them, so the optimizer sees every sum. Inside a CUDA graph
capture (the engine's GraphRunner) the event record and wait are the fork and join of the capture:
the NCCL calls become nodes of the pass's graph, parallel to the earlier layers' kernels.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

BUCKET_ENV = "ANDREA_DDP_BUCKET_MB"  # bucket size in MiB (a float); 0: one sum after the backward pass
DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb
# ... on the NumPy engine's ranks, where the bucketed sum is tested (tests/test_ddp_buckets.py). On
# GPUs the default stays the one sum after the backward pass until tests/test_ddp_gpu.py's bucketed
# cases have passed on a machine of several GPUs; ANDREA_DDP_BUCKET_MB=25 asks for the buckets there.
DEFAULT_BUCKET_MB_CUDA = 0.0


def bucket_bytes_requested(env=None, default_mb: float = DEFAULT_BUCKET_MB) -> int:
    """The bucket cap in bytes from BUCKET_ENV (unset or empty: default_mb; 0: no buckets);
    anything but a number >= 0 is an error naming the variable."""
    env = os.environ if env is None else env
    text = env.get(BUCKET_ENV, "").strip()
    try:
        mb = float(text) if text else default_mb
    except ValueError:
        mb = -1.0
    if not mb >= 0 or mb == float("inf"):
        raise ValueError(f"environment variable {BUCKET_ENV}={env[BUCKET_ENV]!r}: expected the gradient bucket "
                         "size in MiB, a number >= 0 (0: no buckets, one sum after the backward pass)")
    return int(mb * 2 ** 20)


@dataclass(frozen=True)
class Bucket:
    """Part of the flat gradient buffer summed over the ranks in one go: ranges [lo, hi), issued
    after layer `after` of the backward pass (None: when the pass is over)."""
    after: Optional[int]
    ranges: Tuple[Tuple[int, int], ...]


def layer_ranges(layout, n_layer: int) -> List[Tuple[int, int]]:
    """[lo, hi) of each layer's matrices in the flat buffer; checks that they lie end to end,
    layer after layer, from the end of wpe to n_decay (what the contiguous buckets need)."""
    spans = []
    for l in range(n_layer):
        mine = [(off, off + int(np.prod(shape))) for name, off, shape in layout.entries
                if name.startswith(f"h{l}.") and len(shape) == 2]
        spans.append((min(a for a, _ in mine), max(b for _, b in mine)))
        if sum(b - a for a, b in mine) != spans[-1][1] - spans[-1][0]:
            raise ValueError(f"layer {l}'s matrices are not contiguous in the flat buffer")
    for (_, b), (a, _) in zip(spans, spans[1:] + [(layout.n_decay, 0)]):
        if a != b:
            raise ValueError("the layers' matrices do not lie end to end before n_decay")
    return spans


def plan_buckets(layout, n_layer: int, total: int, cap_bytes: int, itemsize: int = 4) -> List[Bucket]:
    """The buckets in the order they are issued (the same on every rank): whole layers from the
    last, each bucket at least cap_bytes where the layers allow, then the rest of [0, total)
    (total: the gradient buffer's length, ZeRO-1's padding included). [] when cap_bytes is 0."""
    if cap_bytes <= 0:
        return []
    spans = layer_ranges(layout, n_layer)
    out, hi = [], layout.n_decay
    for l in reversed(range(n_layer)):
        lo = spans[l][0]
        if (hi - lo) * itemsize >= cap_bytes or l == 0:
            out.append(Bucket(l, ((lo, hi),)))
            hi = lo
    head = spans[0][0] if n_layer else layout.n_decay
    out.append(Bucket(None, tuple(r for r in ((0, head), (layout.n_decay, total)) if r[1] > r[0])))
    return out


class GradBuckets:
    """Issues the plan's sums over the ranks during a backward pass (ready), in the plan's order.
    zero1: each bucket's elements are summed onto the rank whose shard holds them (the
    reduce-scatter of ZeRO-1, by range) instead of onto every rank."""

    def __init__(self, comm, grads, plan: List[Bucket], zero1: bool):
        self.comm, self.grads, self.plan, self.zero1 = comm, grads, plan, zero1
        self.at = {b.after: b for b in plan}
        self.cuda = not isinstance(grads, np.ndarray)
        self.stream = self.events = self.joined = None
        if self.cuda:  # made once, outside any capture
            import cupy as cp

            self.stream = cp.cuda.Stream(non_blocking=True)
            self.events = {b.after: cp.cuda.Event(disable_timing=True) for b in plan}
            self.joined = cp.cuda.Event(disable_timing=True)

    def ready(self, layer: Optional[int]) -> None:
        """The backward pass has finished layer `layer` (None: the whole pass, every gradient
        final): issue the bucket that waits for it, if any; at None also wait for every sum."""
        b = self.at.get(layer)
        if b is not None:
            self._issue(b)
        if layer is None and self.cuda:  # join: the optimizer reads the sums
            import cupy as cp

            self.joined.record(self.stream)
            cp.cuda.get_current_stream().wait_event(self.joined)

    def _issue(self, b: Bucket) -> None:
        if not self.cuda:
            self._sum(b)  # MPI: done when it returns
            return
        import cupy as cp

        ev = self.events[b.after]
        ev.record(cp.cuda.get_current_stream())  # after the kernels that finish the bucket
        self.stream.wait_event(ev)
        with self.stream:  # comm's NCCL calls go on the current stream: this one
            self._sum(b)

    def _sum(self, b: Bucket) -> None:
        for lo, hi in b.ranges:
            if self.zero1:
                self.comm.reduce_scatter_sum(self.grads, lo, hi)
            else:
                self.comm.allreduce_sum(self.grads[lo:hi])


def make_buckets(comm, grads, layout, n_layer: int, zero1: bool, cap_bytes=None) -> Optional[GradBuckets]:
    """The engine's GradBuckets, or None where the gradients are summed in one call after the
    backward pass: one rank, or a cap of 0 (cap_bytes None: from the environment, BUCKET_ENV)."""
    if comm.size == 1:
        return None
    default = DEFAULT_BUCKET_MB if isinstance(grads, np.ndarray) else DEFAULT_BUCKET_MB_CUDA
    cap = bucket_bytes_requested(default_mb=default) if cap_bytes is None else int(cap_bytes)
    plan = plan_buckets(layout, n_layer, grads.size, cap, np.dtype(grads.dtype).itemsize)
    return GradBuckets(comm, grads, plan, zero1) if plan else None


def said(buckets: Optional[GradBuckets]) -> str:
    """How the engine sums its gradients, for the memory plan's data-parallel line."""
    if buckets is None:
        return ", gradients summed after the backward pass"
    return f", gradients summed in {len(buckets.plan)} buckets during the backward pass"
