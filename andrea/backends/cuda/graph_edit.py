"""A captured pass's CUDA graph edited before it is instantiated: cuBLAS(Lt)'s counter memsets replaced
by a kernel node (GraphRunner applies it where the backend's graph_edits is on).

Some cuBLAS and cuBLASLt algorithms zero 4 bytes at the start of their workspace (a counter their
kernel uses) with a memset right before the kernel. Captured after a kernel K of ours, such a
product is the chain K -> memset -> product. On an H200 (dev/step_timeline.py) the device sat idle
about 1.5 us before each such memset and 2.9 us after it, where a product right after one of our
kernels starts within 0.1 us of that kernel's end over the same kind of (full) edge. Moving the
memset beside K (dev/graph_probe.py --hoist) left the product still 3.5 us behind K: the memset
node on its path, not its place, is what costs.

The edit: each such memset node (4 bytes into the cuBLAS or cuBLASLt workspace, whose successors
are kernels) is replaced by a kernel node of one thread that stores the same 4 bytes
(k_graph_counter_store, below), with the memset's dependencies and dependents. The product reads the
same counter and everything else as before, so the bits are the same
(tests/cuda/test_graph_edit_cuda.py). The kernel is a graph utility, not an operation of the model:
it lives here, not in kernels/.

Everything goes through the driver (ctypes on libcuda): the graph CuPy captured is cloned, edited
and instantiated here; EditedGraph launches that instance and keeps the original alive.
"""
from __future__ import annotations

import ctypes

from .runtime import cp

# the replacement: one thread stores the 32-bit pattern the memset wrote (a full edge in and out)
COUNTER_STORE = r'''
extern "C" __global__ void k_graph_counter_store(unsigned int* dst, unsigned int pattern) { *dst = pattern; }
'''

CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_GRAPH_NODE_TYPE_MEMSET = 2
COUNTER_BYTES = 4


class MemsetParams(ctypes.Structure):
    """CUDA_MEMSET_NODE_PARAMS."""
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2."""
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.POINTER(ctypes.c_void_p)),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


_STORE: dict = {}  # device id -> k_graph_counter_store compiled for it


def store_function() -> int:
    """k_graph_counter_store's CUfunction on the current device, compiled once."""
    dev = cp.cuda.Device().id
    if dev not in _STORE:
        _STORE[dev] = cp.RawKernel(COUNTER_STORE, "k_graph_counter_store")
    return _STORE[dev].kernel.ptr


def pattern32(p: MemsetParams) -> int | None:
    """The 32-bit word a 4-byte memset writes, or None where it is not one aligned word."""
    if p.elementSize * p.width * p.height != COUNTER_BYTES or p.dst % 4:
        return None
    if p.elementSize == 1:
        return (p.value & 0xFF) * 0x01010101
    if p.elementSize == 2:
        return (p.value & 0xFFFF) * 0x00010001
    return p.value & 0xFFFFFFFF


class Driver:
    """The graph calls of libcuda this module needs; an error names the call and the driver's error."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def _ok(self, what: str, rc: int) -> None:
        if rc:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(s))
            raise RuntimeError(f"{what}: {s.value.decode() if s.value else f'CUresult {rc}'}")

    def nodes(self, g: int) -> list:
        n = ctypes.c_size_t(0)
        self._ok("cuGraphGetNodes", self.lib.cuGraphGetNodes(ctypes.c_void_p(g), None, ctypes.byref(n)))
        arr = (ctypes.c_void_p * max(n.value, 1))()
        self._ok("cuGraphGetNodes", self.lib.cuGraphGetNodes(ctypes.c_void_p(g), arr, ctypes.byref(n)))
        return [int(x or 0) for x in arr[:n.value]]

    def kind(self, node: int) -> int:
        t = ctypes.c_int(-1)
        self._ok("cuGraphNodeGetType", self.lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)))
        return t.value

    def _edges(self, fn: str, node: int) -> list:
        # the edge data is asked for too: a graph with programmatic edges answers
        # CUDA_ERROR_LOSSY_QUERY without it
        n = ctypes.c_size_t(0)
        self._ok(fn, getattr(self.lib, fn)(ctypes.c_void_p(node), None, None, ctypes.byref(n)))
        if n.value == 0:  # (arrays with a count of 0 are an invalid value)
            return []
        arr = (ctypes.c_void_p * n.value)()
        data = (ctypes.c_uint64 * n.value)()
        self._ok(fn, getattr(self.lib, fn)(ctypes.c_void_p(node), arr, data, ctypes.byref(n)))
        return [(int(arr[i] or 0), int(data[i])) for i in range(n.value)]

    def preds(self, node: int) -> list:
        """[(predecessor, edge data)]."""
        return self._edges("cuGraphNodeGetDependencies_v2", node)

    def succs(self, node: int) -> list:
        """[(successor, edge data)]."""
        return self._edges("cuGraphNodeGetDependentNodes_v2", node)

    def edge(self, g: int, a: int, b: int, add: bool = True, data: int | None = None) -> None:
        """Add (or remove) a -> b; data: its CUgraphEdgeData as an int, from_port | to_port << 8 |
        type << 16 (None: a full edge)."""
        fn = "cuGraphAddDependencies_v2" if add else "cuGraphRemoveDependencies_v2"
        x, y = (ctypes.c_void_p * 1)(a), (ctypes.c_void_p * 1)(b)
        d = None if data is None else (ctypes.c_uint64 * 1)(data)
        self._ok(fn, getattr(self.lib, fn)(ctypes.c_void_p(g), x, y, d, ctypes.c_size_t(1)))

    def memset(self, node: int) -> MemsetParams:
        p = MemsetParams()
        self._ok("cuGraphMemsetNodeGetParams", self.lib.cuGraphMemsetNodeGetParams(ctypes.c_void_p(node),
                                                                                   ctypes.byref(p)))
        return p

    def add_store_node(self, g: int, func: int, deps: list, dst: int, pattern: int) -> int:
        """A kernel node of func(dst, pattern), one thread, after deps (full edges); returns it."""
        a_dst, a_pat = ctypes.c_uint64(dst), ctypes.c_uint32(pattern)
        args = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(a_dst), ctypes.c_void_p),
                                     ctypes.cast(ctypes.byref(a_pat), ctypes.c_void_p))
        p = KernelNodeParams(func=func, gridDimX=1, gridDimY=1, gridDimZ=1, blockDimX=1, blockDimY=1, blockDimZ=1,
                             kernelParams=args)
        node = ctypes.c_void_p()
        d = (ctypes.c_void_p * max(len(deps), 1))(*deps)
        self._ok("cuGraphAddKernelNode_v2", self.lib.cuGraphAddKernelNode_v2(
            ctypes.byref(node), ctypes.c_void_p(g), d if deps else None, ctypes.c_size_t(len(deps)), ctypes.byref(p)))
        return node.value

    def destroy_node(self, node: int) -> None:
        self._ok("cuGraphDestroyNode", self.lib.cuGraphDestroyNode(ctypes.c_void_p(node)))

    def clone(self, g: int) -> int:
        out = ctypes.c_void_p()
        self._ok("cuGraphClone", self.lib.cuGraphClone(ctypes.byref(out), ctypes.c_void_p(g)))
        return out.value

    def instantiate(self, g: int) -> int:
        ex = ctypes.c_void_p()
        self._ok("cuGraphInstantiateWithFlags",
                 self.lib.cuGraphInstantiateWithFlags(ctypes.byref(ex), ctypes.c_void_p(g), ctypes.c_ulonglong(0)))
        return ex.value

    def launch(self, ex: int, stream_ptr: int) -> None:
        self._ok("cuGraphLaunch", self.lib.cuGraphLaunch(ctypes.c_void_p(ex), ctypes.c_void_p(stream_ptr)))

    def dot(self, g: int) -> str:
        """Graph g as DOT (cuGraphDebugDotPrint, flags 0), as CuPy's Graph.debug_dot_str gives it."""
        import os
        import tempfile
        fd, path = tempfile.mkstemp(suffix=".dot")
        os.close(fd)
        try:
            self._ok("cuGraphDebugDotPrint", self.lib.cuGraphDebugDotPrint(ctypes.c_void_p(g), path.encode(),
                                                                          ctypes.c_uint(0)))
            with open(path) as f:
                return f.read()
        finally:
            os.unlink(path)

    def destroy(self, g: int = 0, ex: int = 0) -> None:
        if ex:
            self.lib.cuGraphExecDestroy(ctypes.c_void_p(ex))
        if g:
            self.lib.cuGraphDestroy(ctypes.c_void_p(g))


def counter_memsets(drv: Driver, g: int, workspaces) -> list:
    """[(memset node, its 32-bit pattern)] of graph g: the 4-byte memsets into one of workspaces
    ([(start, end)] device address ranges) whose successors are all kernel nodes."""
    out = []
    for m in drv.nodes(g):
        if drv.kind(m) != CU_GRAPH_NODE_TYPE_MEMSET:
            continue
        p = drv.memset(m)
        word = pattern32(p)
        if word is None or not any(a <= p.dst < b for a, b in workspaces):
            continue
        succ = drv.succs(m)
        if not succ or any(drv.kind(x) != CU_GRAPH_NODE_TYPE_KERNEL for x, _ in succ):
            continue
        out.append((m, word))
    return out


def replace_counter_memsets(drv: Driver, g: int, store_func: int, workspaces) -> int:
    """The edit of this module's header on graph g, in place: each counter memset becomes a kernel
    node of store_func (k_graph_counter_store's CUfunction) with its dependencies and dependents.
    Returns how many."""
    found = counter_memsets(drv, g, workspaces)
    for m, word in found:
        dst = drv.memset(m).dst
        preds = [q for q, _ in drv.preds(m)]
        succ = [x for x, _ in drv.succs(m)]
        z = drv.add_store_node(g, store_func, preds, dst, word)
        for x in succ:
            drv.edge(g, z, x)
        drv.destroy_node(m)
    return len(found)


class EditedGraph:
    """A captured CuPy graph, cloned, edited by replace_counter_memsets and, where it replaced any,
    instantiated through the driver: launch(stream=) as CuPy's Graph; .graph is the edited CUgraph,
    .original the capture."""

    def __init__(self, original, store_func: int, workspaces, drv: Driver | None = None):
        self.drv = drv or Driver()
        self.original = original
        self.graph = self.drv.clone(original.graph)
        try:
            self.replaced = replace_counter_memsets(self.drv, self.graph, store_func, workspaces)
            # nothing replaced: the capture runs as it is (graphs.edited), so no instance of the clone
            self.exec = self.drv.instantiate(self.graph) if self.replaced else 0
        except Exception:
            self.drv.destroy(g=self.graph)
            raise

    def launch(self, stream=None):
        s = stream if stream is not None else cp.cuda.get_current_stream()
        self.drv.launch(self.exec, s.ptr)

    def debug_dot_str(self):
        """The edited graph as DOT (what runs; .original.debug_dot_str() is the capture's)."""
        return self.drv.dot(self.graph)

    def __del__(self):
        drv, ex, g = getattr(self, "drv", None), getattr(self, "exec", 0), getattr(self, "graph", 0)
        if drv is not None:
            try:
                drv.destroy(g=g, ex=ex)
            except Exception:  # interpreter shutdown: the driver may be gone
                pass
