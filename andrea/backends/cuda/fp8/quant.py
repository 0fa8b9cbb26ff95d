"""The FP8 quantisation launchers: every kernel of kernels/fp8.cu (amax, casts, cast-and-transpose
with their fused column sums and amax, the *_many launches of the weight cache, the delayed
scales' roll, the FP8 transpose), behind the reference's names and arguments.

A scale lives in a meta row (float32 (2m,): amax at 0, 1/scale at m; META_STRIDE floats a tensor
in the engine's rows). The layers' FP8 forms (ops/) and the FP8 state (state.py) call these.
"""
from __future__ import annotations

import numpy as np

from ..geometry import sm_limits
from ...interface import FP8_FORMATS, FP8_FWD, FP8_HIST, S_SKIP
from ..runtime import THREADS, blocks, check, cp, i32, i64
from .plan import DELAYED_HIST_AT, FP8_MULTIPLE, MANY_BLOCKS, TABLE_COLS, TILE


class Quant:
    """The fp8.cu launchers of one backend: its Runtime (rt) and Tuning (tile rows, amax blocks)."""

    def __init__(self, rt, tuning):
        self.rt, self.tuning = rt, tuning

    @staticmethod
    def fmt_defs(fmt):
        """The -D options of a kernel file built for FP8 format fmt: none for E4M3, fp8.cuh's
        default (so its kernels share one build with the launches that pass no format)."""
        if fmt not in FP8_FORMATS:
            raise ValueError(f"FP8 format {fmt!r}: expected one of {', '.join(FP8_FORMATS)}")
        return ("-DFP8_E5M2=1",) if fmt == "e5m2" else ()

    @staticmethod
    def inv_at(kernel, meta):
        """Where 1/scale goes in meta: float32 (2m,) holds amax at 0 and 1/scale at m."""
        check(kernel, "meta", meta, dtype=np.float32)
        if meta.ndim != 1 or meta.size < 2 or meta.size % 2:
            raise ValueError(f"{kernel}: meta has shape {meta.shape}; expected (2m,): amax at 0, 1/scale at m")
        return i32(meta.size // 2)

    @staticmethod
    def check_x(kernel, x):
        check(kernel, "x", x)
        if x.size % FP8_MULTIPLE or x.data.ptr % 16:
            raise ValueError(f"{kernel}: x has {x.size} values (need a multiple of {FP8_MULTIPLE}) "
                             f"at address {x.data.ptr:#x} (need 16-byte alignment)")

    def amax_grid(self, kernel, meta, x, zeroed):
        """Checks, the memset of meta[0] (unless zeroed) and the grid of an amax launch of x."""
        check(kernel, "meta", meta, dtype=np.float32)
        self.check_x(kernel, x)
        if not zeroed:
            cp.cuda.runtime.memsetAsync(meta.data.ptr, 0, 4, cp.cuda.get_current_stream().ptr)
        grid = blocks(x.size // 8, THREADS)
        if self.tuning.fp8_amax_blocks:  # a few blocks an SM, each thread four loads at a time (fp8.cu)
            grid = min(grid, self.tuning.fp8_amax_blocks * sm_limits(x.device.id)["sms"])
        return grid

    def k_fp8_amax(self, meta, x, zeroed=False):
        """meta[0] = max |x| (NaN if any x is NaN); zeroes meta[0] first (a memset, so it captures)
        unless zeroed says it is zero already."""
        grid = self.amax_grid("k_fp8_amax", meta, x, zeroed)
        self.rt.launch("fp8.cu", "k_fp8_amax", x.dtype, grid, THREADS, (meta, x, i64(x.size)))

    def k_fp8_gelu_amax(self, meta, pre, zeroed=False):
        """meta[0] = max |act|, act = gelu(pre) rounded to pre's dtype (fp8.cu's sigmoid form),
        without writing act (and, for 16-bit pre, without a GELU per value: fp8.cu
        fp8_amax_block); zeroes meta[0] first unless zeroed."""
        grid = self.amax_grid("k_fp8_gelu_amax", meta, pre, zeroed)
        self.rt.launch("fp8.cu", "k_fp8_gelu_amax", pre.dtype, grid, THREADS, (meta, pre, i64(pre.size)))

    def k_fp8_cast(self, out, meta, x, fmt):
        """out (uint8, x's size) = fp8 bytes of x * scale (scale from meta[0]); 1/scale into meta
        (meta[1] of a (2,) pair, as the reference; meta[m] of a (2m,) slot)."""
        inv_at = self.inv_at("k_fp8_cast", meta)
        self.check_x("k_fp8_cast", x)
        check("k_fp8_cast", "out", out, dtype=np.uint8)
        if out.size != x.size:
            raise ValueError(f"k_fp8_cast: out has {out.size} bytes, x {x.size} values")
        self.rt.launch("fp8.cu", "k_fp8_cast", x.dtype, blocks(x.size // 8, THREADS), THREADS,
                       (out, meta, inv_at, x, i64(x.size)), defs=self.fmt_defs(fmt))

    def cast_transpose_launch(self, kernel, out, out_t, meta, x, fmt):
        """Checks, grid, arguments and defines of a launch of k_fp8_cast_transpose or
        k_fp8_gelu_cast_transpose (the same signature): (grid, args, defs)."""
        inv_at = self.inv_at(kernel, meta)
        self.check_x(kernel, x)
        if x.ndim != 2 or x.shape[0] % FP8_MULTIPLE or x.shape[1] % FP8_MULTIPLE:
            raise ValueError(f"{kernel}: x has shape {x.shape}; expected (R, K), both multiples of {FP8_MULTIPLE}")
        R, K = x.shape
        for name, a in (("out", out), ("out_t", out_t)):
            if a is not None:
                check(kernel, name, a, dtype=np.uint8)
                if a.size != x.size:
                    raise ValueError(f"{kernel}: {name} has {a.size} bytes, x {x.size} values")
        null = np.uint64(0)
        rows = self.tuning.fp8_tile_rows  # one of tuning.FP8_TILE_ROWS (Tuning checks it)
        return ((-(-K // TILE), -(-R // rows)),
                (out if out is not None else null, out_t if out_t is not None else null, meta, inv_at, x, i32(R),
                 i32(K)),
                self.fmt_defs(fmt) + (f"-DFP8_TILE_ROWS={rows}",))

    def k_fp8_cast_transpose(self, out, out_t, meta, x, fmt):
        """x (R, K) to out (R, K) and/or out_t (K, R) (None skips one), as k_fp8_cast."""
        grid, args, defs = self.cast_transpose_launch("k_fp8_cast_transpose", out, out_t, meta, x, fmt)
        self.rt.launch("fp8.cu", "k_fp8_cast_transpose", x.dtype, grid, THREADS, args, defs=defs)

    def k_fp8_cast_transpose_colsum(self, out, out_t, meta, x, fmt, partial):
        """k_fp8_cast_transpose, and partial (ceil(R / rows), K) float32 = the column sums of x
        over each tile of rows = Tuning.fp8_tile_rows rows (ref.fp8_tile_colsum's order):
        the first pass of a bias gradient, k_colsum_final of them the second."""
        kernel = "k_fp8_cast_transpose_colsum"
        grid, args, defs = self.cast_transpose_launch(kernel, out, out_t, meta, x, fmt)
        R, K = x.shape
        check(kernel, "partial", partial, (grid[1] * K,), np.float32)
        self.rt.launch("fp8.cu", "k_fp8_cast_transpose_colsum", x.dtype, grid, THREADS, args + (partial,),
                       defs=defs)

    def k_fp8_gelu_cast_transpose(self, out, out_t, meta, pre, fmt):
        """act = gelu(pre) (R, K), rounded to pre's dtype, to out (R, K) and/or out_t (K, R) as
        k_fp8_cast_transpose casts it (scale from meta[0]: k_fp8_gelu_amax), without writing act."""
        grid, args, defs = self.cast_transpose_launch("k_fp8_gelu_cast_transpose", out, out_t, meta, pre, fmt)
        self.rt.launch("fp8.cu", "k_fp8_gelu_cast_transpose", pre.dtype, grid, THREADS, args,
                       defs=defs)

    def k_fp8_cast_transpose_amax(self, out, out_t, meta, x, fmt, amax_out):
        """k_fp8_cast_transpose, and amax_out (a (1,) float32 view, or None: not taken) =
        max(amax_out, max |x|)."""
        kernel = "k_fp8_cast_transpose_amax"
        grid, args, defs = self.cast_transpose_launch(kernel, out, out_t, meta, x, fmt)
        self.rt.launch("fp8.cu", "k_fp8_cast_transpose_amax", x.dtype, grid, THREADS,
                       args + (self.amax_out(kernel, amax_out),), defs=defs)

    def k_fp8_cast_transpose_colsum_amax(self, out, out_t, meta, x, fmt, partial, amax_out):
        """k_fp8_cast_transpose_colsum, and amax_out (a (1,) float32 view, or None) = max(amax_out,
        max |x|)."""
        kernel = "k_fp8_cast_transpose_colsum_amax"
        grid, args, defs = self.cast_transpose_launch(kernel, out, out_t, meta, x, fmt)
        check(kernel, "partial", partial, (grid[1] * x.shape[1],), np.float32)
        self.rt.launch("fp8.cu", "k_fp8_cast_transpose_colsum_amax", x.dtype, grid, THREADS,
                       args + (partial, self.amax_out(kernel, amax_out)), defs=defs)

    def k_fp8_gelu_cast_transpose_amax(self, out, out_t, meta, pre, fmt, amax_out):
        """k_fp8_gelu_cast_transpose, and amax_out (a (1,) float32 view, or None: not taken) =
        max(amax_out, max |act|)."""
        kernel = "k_fp8_gelu_cast_transpose_amax"
        grid, args, defs = self.cast_transpose_launch(kernel, out, out_t, meta, pre, fmt)
        self.rt.launch("fp8.cu", "k_fp8_gelu_cast_transpose_amax", pre.dtype, grid, THREADS,
                       args + (self.amax_out(kernel, amax_out),), defs=defs)

    def k_fp8_dgelu_cast_transpose_colsum_amax(self, out, out_t, meta, dact, pre, fmt, partial, amax_out):
        """d = dact * gelu'(pre) (R, K) rounded to dact's dtype (not stored), cast as
        k_fp8_cast_transpose_colsum casts it (partial: ceil(R / Tuning.fp8_tile_rows) rows of
        column sums), and amax_out (a (1,) float32 view, or None) = max(amax_out, max |d|)."""
        kernel = "k_fp8_dgelu_cast_transpose_colsum_amax"
        grid, args, defs = self.cast_transpose_launch(kernel, out, out_t, meta, dact, fmt)
        check(kernel, "pre", pre, dact.shape, dact.dtype)
        if pre.data.ptr % 16:
            raise ValueError(f"{kernel}: pre at {pre.data.ptr:#x}; expected 16-byte alignment")
        check(kernel, "partial", partial, (grid[1] * dact.shape[1],), np.float32)
        out_, out_t_, meta_, inv_at, x, R, K = args
        self.rt.launch("fp8.cu", "k_fp8_dgelu_cast_transpose_colsum_amax", dact.dtype, grid, THREADS,
                       (out_, out_t_, meta_, inv_at, x, pre, R, K, partial, self.amax_out(kernel, amax_out)),
                       defs=defs)

    @staticmethod
    def amax_out(kernel, amax_out):
        if amax_out is None:
            return np.uint64(0)
        check(kernel, "amax_out", amax_out, (1,), np.float32)
        return amax_out

    def k_fp8_delayed_roll(self, rows, state):
        """The delayed scales' rows (n, META_STRIDE) at the end of an optimizer step
        (ref.k_fp8_delayed_roll; the step's skip flag read from the optimizer state on the device)."""
        check("k_fp8_delayed_roll", "rows", rows, dtype=np.float32)
        check("k_fp8_delayed_roll", "state", state, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] < DELAYED_HIST_AT + FP8_HIST:
            raise ValueError(f"k_fp8_delayed_roll: rows has shape {rows.shape}; expected (n, >= "
                             f"{DELAYED_HIST_AT + FP8_HIST})")
        n = rows.shape[0]
        self.rt.launch("fp8.cu", "k_fp8_delayed_roll", np.float32, -(-n // 32), 32,
                       (rows, i32(n), i32(rows.shape[1]), state, i32(S_SKIP)))

    def k_fp8_dgelu_colsum_amax(self, partial, meta, dact, pre, rows_per_chunk):
        """dact (N, H) *= gelu'(pre) in place (k_mlp_bwd_gelu's derivative); partial (chunks, H)
        float32 = the column sums of the new dact over each chunk of rows_per_chunk rows, in
        k_colsum_partial's order (k_colsum_final of them gives GradPass.add's bits); meta[0] =
        max |new dact| (zeroed first: a memset). H a multiple of 8, rows 16-byte aligned."""
        kernel = "k_fp8_dgelu_colsum_amax"
        check(kernel, "meta", meta, dtype=np.float32)
        check(kernel, "pre", pre, dact.shape, dact.dtype)
        self.check_x(kernel, dact)
        N, H = dact.shape
        vec = 16 // dact.dtype.itemsize
        chunks = -(-N // rows_per_chunk)
        check(kernel, "partial", partial, (chunks * H,), np.float32)
        if H % vec or pre.data.ptr % 16:
            raise ValueError(f"{kernel}: H = {H} (need a multiple of {vec}), pre at {pre.data.ptr:#x} "
                             "(need 16-byte alignment)")
        cp.cuda.runtime.memsetAsync(meta.data.ptr, 0, 4, cp.cuda.get_current_stream().ptr)
        self.rt.launch("fp8.cu", "k_fp8_dgelu_colsum_amax", dact.dtype, (-(-H // (32 * vec)), chunks),
                       THREADS, (partial, meta, dact, pre, i64(N), i32(H), i32(rows_per_chunk)),
                       defs=self.fmt_defs(FP8_FWD))

    @staticmethod
    def check_many(kernel, meta, table):
        check(kernel, "meta", meta, dtype=np.float32)
        check(kernel, "table", table, dtype=np.int64)
        if table.ndim != 2 or table.shape[1] != TABLE_COLS or meta.ndim != 2 or meta.shape[0] != table.shape[0] \
                or meta.shape[1] % 2 or meta.shape[1] * 4 % 16:
            raise ValueError(f"{kernel}: meta {meta.shape} and table {table.shape}; expected (n, 2m) float32 with "
                             f"m * 8 bytes a multiple of 16, and (n, {TABLE_COLS}) int64")

    def make_table(self, xs, outs, outs_t, table=None):
        """The (n, TABLE_COLS) int64 device table of a *_many launch for tensors xs (each (R, K),
        the compute dtype) and their uint8 outputs outs (R, K) / outs_t (K, R) (an entry None
        skips that output): written now (a synchronous copy: at start-up, never inside a graph),
        into table where given. Every size and address is checked here, once."""
        rows = []
        for i, (x, o, ot) in enumerate(zip(xs, outs, outs_t, strict=True)):
            what = f"make_table: tensor {i}"
            self.check_x(what, x)
            if x.ndim != 2 or x.shape[0] % FP8_MULTIPLE or x.shape[1] % FP8_MULTIPLE:
                raise ValueError(f"{what}: shape {x.shape}; expected (R, K), both multiples of {FP8_MULTIPLE}")
            if x.dtype != xs[0].dtype:
                raise ValueError(f"{what}: dtype {x.dtype}, the first tensor's is {xs[0].dtype}")
            R, K = x.shape
            for name, a, shape in (("out", o, (R, K)), ("out_t", ot, (K, R))):
                if a is not None:
                    check(what, name, a, shape, np.uint8)
                    if a.data.ptr % 16:
                        raise ValueError(f"{what}: {name} at {a.data.ptr:#x}; expected 16-byte alignment")
            rows.append([x.data.ptr, 0 if o is None else o.data.ptr, 0 if ot is None else ot.data.ptr, R, K])
        host = np.array(rows, dtype=np.int64).reshape(-1, TABLE_COLS)
        if table is None:
            table = cp.empty(host.shape, dtype=np.int64)
        check("make_table", "table", table, host.shape, np.int64)
        table.set(host)
        return table

    def many_grid(self, table_host, per_block):
        """(blocks per tensor, tensors): enough blocks for the largest tensor, at most MANY_BLOCKS."""
        most = max(int(np.prod(r)) for r in table_host)
        return (max(1, min(MANY_BLOCKS, -(-most // per_block))), len(table_host))

    def k_fp8_amax_many(self, meta, table, dtype, sizes):
        """meta (n, 2m) = 0, then meta[t, 0] = max |x_t| for every tensor t of table (make_table);
        dtype: the tensors' dtype, sizes: their (R, K) (the launch reads neither: the table holds
        them on the device; the grid comes from sizes)."""
        self.check_many("k_fp8_amax_many", meta, table)
        cp.cuda.runtime.memsetAsync(meta.data.ptr, 0, meta.nbytes, cp.cuda.get_current_stream().ptr)
        self.rt.launch("fp8.cu", "k_fp8_amax_many", dtype, self.many_grid(sizes, 8 * THREADS), THREADS,
                       (meta, i32(meta.shape[1]), table))

    def k_fp8_cast_transpose_many(self, meta, table, fmt, dtype, sizes):
        """For every tensor t of table: its out and/or out_t as k_fp8_cast_transpose writes them,
        scale from meta[t, 0], 1/scale into meta[t, m] (meta (n, 2m))."""
        self.check_many("k_fp8_cast_transpose_many", meta, table)
        tiles = [(-(-R // TILE) * -(-K // TILE), 1) for R, K in sizes]
        self.rt.launch("fp8.cu", "k_fp8_cast_transpose_many", dtype, self.many_grid(tiles, 1), THREADS,
                       (meta, i32(meta.shape[1]), i32(meta.shape[1] // 2), table), defs=self.fmt_defs(fmt))

    def k_fp8_transpose(self, out_t, x):
        """out_t (K, R) = x.T of FP8 bytes x (R, K), R and K multiples of 16, 16-byte aligned."""
        R, K = x.shape
        check("k_fp8_transpose", "x", x, dtype=np.uint8)
        check("k_fp8_transpose", "out_t", out_t, (K, R), np.uint8)
        if R % FP8_MULTIPLE or K % FP8_MULTIPLE or x.data.ptr % 16 or out_t.data.ptr % 16:
            raise ValueError(f"k_fp8_transpose: x {x.shape} at {x.data.ptr:#x}, out_t at {out_t.data.ptr:#x}; "
                             f"expected both sizes multiples of {FP8_MULTIPLE}, 16-byte aligned arrays")
        self.rt.launch("fp8.cu", "k_fp8_transpose", np.float32, (-(-K // TILE), -(-R // TILE)), THREADS,
                       (out_t, x, i32(R), i32(K)))
