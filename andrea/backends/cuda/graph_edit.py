"""A captured pass's CUDA graph edited before it is instantiated: cuBLAS(Lt)'s counter memsets moved
off the products' critical path (GraphRunner applies it where the backend's graph_edits is on).

Some cuBLAS and cuBLASLt algorithms zero 4 bytes at the start of their workspace (a counter their
kernel uses) with a memset right before the kernel. Captured after a kernel K of ours, such a
product is the chain K -> memset -> product. A memset node cannot start a programmatic edge, so the
product is launched only once the memset has completed; on an H200 that left about 1.5 us idle
before the memset and 2.9 us after it (dev/step_timeline.py), where a product right after one of
our kernels, with no memset between, starts within 0.1 us of that kernel's end (the capture made
a programmatic edge to it: cuBLASLt launches its kernels with programmatic dependent launch).

The edit applies where the capture shows the libraries launching with the programmatic attribute
(every edge from one of our kernels to a library's kernel is programmatic: library_edges), to
every such memset M with one predecessor K that is one of our kernels launched with the attribute,
M's target inside the cuBLAS or cuBLASLt workspace and M's successors library kernels:
- M takes K's predecessors as its own, so it runs beside K. The product before K, the last user of
  the counter, precedes K's predecessors (the passes are one chain), so it has completed;
- K -> each successor of M becomes an edge like the programmatic one into K (PROGRAMMATIC_EDGE
  where K has none), as the capture makes when no memset stands between;
- M -> successor stays a full edge: the product still starts after the zero is written.
The product reads what it read before (K's outputs through its own wait for K, the zeroed counter),
so the bits are the same (GPU test tests/cuda/test_graph_edit_cuda.py).

Everything goes through the driver (ctypes on libcuda): the graph CuPy captured is cloned, edited
and instantiated here; EditedGraph launches that instance and keeps the original alive.
"""
from __future__ import annotations

import ctypes

CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_GRAPH_NODE_TYPE_MEMSET = 2
# CUgraphEdgeData as a little-endian int: from_port | to_port << 8 | type << 16; from
# CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC (1), type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC (1)
PROGRAMMATIC_EDGE = 1 | 1 << 16
COUNTER_BYTES = 4


def is_programmatic(data: int) -> bool:
    return (data >> 16) & 0xFF != 0


class MemsetParams(ctypes.Structure):
    """CUDA_MEMSET_NODE_PARAMS."""
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


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
        arr = (ctypes.c_void_p * max(n.value, 1))()
        data = (ctypes.c_uint64 * max(n.value, 1))()
        self._ok(fn, getattr(self.lib, fn)(ctypes.c_void_p(node), arr, data, ctypes.byref(n)))
        return [(int(arr[i] or 0), int(data[i])) for i in range(n.value)]

    def preds(self, node: int) -> list:
        """[(predecessor, edge data)]."""
        return self._edges("cuGraphNodeGetDependencies_v2", node)

    def succs(self, node: int) -> list:
        """[(successor, edge data)]."""
        return self._edges("cuGraphNodeGetDependentNodes_v2", node)

    def edge(self, g: int, a: int, b: int, add: bool = True, data: int | None = None) -> None:
        """Add (or remove) a -> b; data: its edge data (None: a full edge)."""
        fn = "cuGraphAddDependencies_v2" if add else "cuGraphRemoveDependencies_v2"
        x, y = (ctypes.c_void_p * 1)(a), (ctypes.c_void_p * 1)(b)
        d = None if data is None else (ctypes.c_uint64 * 1)(data)
        self._ok(fn, getattr(self.lib, fn)(ctypes.c_void_p(g), x, y, d, ctypes.c_size_t(1)))

    def memset(self, node: int) -> MemsetParams:
        p = MemsetParams()
        self._ok("cuGraphMemsetNodeGetParams", self.lib.cuGraphMemsetNodeGetParams(ctypes.c_void_p(node),
                                                                                   ctypes.byref(p)))
        return p

    def function(self, node: int) -> int:
        """The CUfunction of a kernel node, or its CUkernel where it was given one (fields 0 and 7
        of CUDA_KERNEL_NODE_PARAMS_v2): the kernel's identity within the process."""
        buf = (ctypes.c_uint64 * 16)()  # the struct is 72 bytes on 64-bit; room to spare
        self._ok("cuGraphKernelNodeGetParams_v2", self.lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), buf))
        return int(buf[0] or buf[7])

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

    def destroy(self, g: int = 0, ex: int = 0) -> None:
        if ex:
            self.lib.cuGraphExecDestroy(ctypes.c_void_p(ex))
        if g:
            self.lib.cuGraphDestroy(ctypes.c_void_p(g))


def library_edges(drv: Driver, g: int, ours: set) -> dict:
    """{"programmatic": n, "full": m}: the edges in g from a kernel of ours to a kernel that is not
    ours (a library's). All programmatic means the library launched its kernels with the
    programmatic attribute (and so waits in them for the kernel before): the premise of the edit."""
    out = {"programmatic": 0, "full": 0}
    for n in drv.nodes(g):
        if drv.kind(n) != CU_GRAPH_NODE_TYPE_KERNEL or drv.function(n) in ours:
            continue
        for p, d in drv.preds(n):
            if drv.kind(p) == CU_GRAPH_NODE_TYPE_KERNEL and drv.function(p) in ours:
                out["programmatic" if is_programmatic(d) else "full"] += 1
    return out


def movable_memsets(drv: Driver, g: int, ours: set, workspaces) -> list:
    """[(memset, K)] of graph g the edit applies to: a 4-byte memset into one of workspaces
    ([(start, end)] device address ranges) whose one predecessor K is a kernel node of a function
    in ours (the CUfunctions launched with the programmatic attribute) and whose successors are
    all kernel nodes of a library (not ours)."""
    out = []
    for m in drv.nodes(g):
        if drv.kind(m) != CU_GRAPH_NODE_TYPE_MEMSET:
            continue
        p = drv.memset(m)
        if p.elementSize * p.width * p.height != COUNTER_BYTES or not any(a <= p.dst < b for a, b in workspaces):
            continue
        pre, succ = drv.preds(m), drv.succs(m)
        if len(pre) != 1 or not succ:
            continue
        k = pre[0][0]
        if drv.kind(k) != CU_GRAPH_NODE_TYPE_KERNEL or drv.function(k) not in ours:
            continue
        if any(drv.kind(s) != CU_GRAPH_NODE_TYPE_KERNEL or drv.function(s) in ours for s, _ in succ):
            continue
        out.append((m, k))
    return out


def hoist_counter_memsets(drv: Driver, g: int, ours: set, workspaces) -> int:
    """The edit of this module's header on graph g, in place; returns how many memsets moved. Only
    where every edge from a kernel of ours to a library's kernel in g is programmatic (else 0)."""
    edges = library_edges(drv, g, ours)
    if edges["full"] or not edges["programmatic"]:
        return 0
    moves = movable_memsets(drv, g, ours, workspaces)
    for m, k in moves:
        into_k = drv.preds(k)
        data = next((d for _, d in into_k if is_programmatic(d)), PROGRAMMATIC_EDGE)
        succ = [s for s, _ in drv.succs(m)]
        drv.edge(g, k, m, add=False)
        for q, _ in into_k:
            drv.edge(g, q, m)
        for s in succ:
            drv.edge(g, k, s, data=data)
    return len(moves)


class EditedGraph:
    """A captured CuPy graph, cloned, edited by hoist_counter_memsets and instantiated through the
    driver: launch(stream=) as CuPy's Graph; .graph is the edited CUgraph, .original the capture."""

    def __init__(self, original, ours: set, workspaces, drv: Driver | None = None):
        self.drv = drv or Driver()
        self.original = original
        self.graph = self.drv.clone(original.graph)
        try:
            self.moved = hoist_counter_memsets(self.drv, self.graph, ours, workspaces)
            self.exec = self.drv.instantiate(self.graph)
        except Exception:
            self.drv.destroy(g=self.graph)
            raise

    def launch(self, stream=None):
        from .runtime import cp
        s = stream if stream is not None else cp.cuda.get_current_stream()
        self.drv.launch(self.exec, s.ptr)

    def debug_dot_str(self):
        return self.original.debug_dot_str()

    def __del__(self):
        drv, ex, g = getattr(self, "drv", None), getattr(self, "exec", 0), getattr(self, "graph", 0)
        if drv is not None:
            try:
                drv.destroy(g=g, ex=ex)
            except Exception:  # interpreter shutdown: the driver may be gone
                pass
