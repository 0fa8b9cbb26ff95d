"""The host side of the scorer's batches, shared by the whole-sequence path (score.py) and the
shared-context path (shared.py): views of planned buffers, the batches of a list of lengths, and
the per-request sums of the values of its scored positions.

    for idx, T in batches(lengths, window, batch_tokens):   # longest first, B * T <= batch_tokens
        ...
    loss[idx], flags = per_request(values, hits, n_cont)    # each request's last n_cont values
    sel = tails(ends, n_cont)                               # their flat positions
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

T_MULTIPLE = 64  # batch lengths are rounded up to this (at most the window): few shapes, aligned tiles


def view(buf, shape):
    """A (shape) view of the first elements of a planned buffer."""
    n = int(np.prod(shape))
    return buf.reshape(-1)[:n].reshape(shape)


def batches(lengths: Sequence[int], window: int, batch_tokens: int) -> List[Tuple[List[int], int]]:
    """[(indices, T)]: longest first, T = the first one's length rounded up to T_MULTIPLE (at most
    window), as many as fit in batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    out, k = [], 0
    while k < len(order):
        T = min(window, -(-lengths[order[k]] // T_MULTIPLE) * T_MULTIPLE)
        B = max(1, batch_tokens // T)
        out.append((order[k:k + B], T))
        k += B
    return out


class Scored:
    """The per-request results of a score(): each batch's scored values arrive as a download (row 0
    the positions' losses, row 1 their greedy flags) that is read LAG batches later, so that the
    host prepares and launches the next batches while the device runs this one."""

    LAG = 2  # batches in flight before the oldest is read (the backend's page-locked ring holds 4)

    def __init__(self, n: int, count, argmax: bool):
        self.loss, self.count = np.zeros(n), np.asarray(count)
        self.greedy = np.zeros(n, dtype=bool) if argmax else None
        self.pending: List[tuple] = []

    def add(self, download, n_values: int, requests) -> None:
        """A batch's download of n_values scored values, those of the requests (in order, the last
        count[r] values of each)."""
        self.pending.append((download, n_values, list(requests)))
        while len(self.pending) > self.LAG:
            self._read(*self.pending.pop(0))

    def _read(self, download, n_values: int, rs) -> None:
        values = download.get()
        hits = values[1, :n_values] > 0.5 if self.greedy is not None else None
        self.loss[rs], flags = per_request(values[0, :n_values].astype(np.float64), hits, self.count[rs])
        if self.greedy is not None:
            self.greedy[rs] = flags

    def result(self):
        """(loss, count, greedy or None) per request, every batch read."""
        for p in self.pending:
            self._read(*p)
        self.pending = []
        return self.loss, self.count, self.greedy


def tails(ends, counts) -> np.ndarray:
    """The last counts[i] indices before ends[i], run after run: the scored positions of each
    request, given where its positions end (flat) and how many of the last it asks for."""
    ends, counts = np.asarray(ends), np.asarray(counts)
    run = np.repeat(np.arange(counts.size), counts)
    return (ends - counts)[run] + np.arange(run.size) - (np.cumsum(counts) - counts)[run]


def per_request(values, hits, counts) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """(sum, and with hits all) of consecutive runs of counts[i] >= 1 values: the requests' summed
    losses and greedy flags from their scored positions', in request order."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.add.reduceat(values, starts), (None if hits is None else np.logical_and.reduceat(hits, starts))
