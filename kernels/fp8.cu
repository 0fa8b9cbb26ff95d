// fp8.cu: the FP8 operands of the linear layers' products (train.precision=fp8, docs/FP8.md).
// Per-tensor current scaling: k_fp8_amax finds max |x| of the whole tensor into meta[0] (zeroed by
// the launcher first), then k_fp8_cast / k_fp8_cast_transpose write fp8(x * scale) with scale =
// 2^k, the largest power of two with amax * 2^k <= the format's largest value, and meta[inv_at] =
// 2^-k for the product to multiply back. meta is float32 (2m,), amax first and 1/scale at m: the
// reference's (2,) pair, or wider where cuBLASLt reads 1/scale (the FP8 path's slots put it 128
// bytes in, aligned as cuBLASLt's scale pointers want). The product itself is
// cuBLASLt's (andrea/backends/cuda/fp8/). Reference: andrea/backends/ref/fp8.py, same names.
// k_fp8_amax_many and k_fp8_cast_transpose_many do the same for many tensors in one launch each
// (the FP8 copies of the weights, rewritten once per optimizer step), with the same code per tile.
//
// k_fp8_gelu_amax, k_fp8_gelu_cast_transpose and k_fp8_dgelu_colsum_amax are the FP8 MLP's passes
// over its 4C-wide tensors: act = gelu(pre) made into an FP8 operand straight from pre (act is
// never stored in 16 bits), and dact *= gelu'(pre) with its amax and the first bias's column
// partials in one pass (cuBLASLt's dGELU epilogue for FP8 products measured 166 us a call at
// ANDREA-120M, against about 30 for the product without it; docs/FP8.md).
//
// Delayed scaling (cuda/fp8/scales.py DelayedScales): the *_amax forms of the tile casts scale by meta[0]
// as it is (a delayed scale's row: the largest amax of the last steps) and reduce the amax of what
// they cast into amax_out for the steps after; k_fp8_dgelu_cast_transpose_colsum_amax makes dact *=
// gelu'(pre) and casts it in the same pass; k_fp8_delayed_roll moves the histories once a step.
// k_fp8_cast_transpose_colsum: the cast of a dY that also writes its tiles' column sums (a bias
// gradient's first pass).
//
// Compiled per compute dtype (-DCT) and per format (fp8.cuh: -DFP8_E5M2=1 for E5M2, else E4M3,
// and the conversion instruction, which traps below sm_89; the backend refuses train.precision=fp8
// there before any launch). Sizes: every length and row length a multiple of 8 (the launcher asks
// 16, what cuBLASLt's FP8 products need), arrays 16-byte aligned. Deterministic: a maximum does
// not depend on the order it is taken in.
#include "common.cuh"
#include "fp8.cuh"
#include "gelu.cuh"

// Eight compute-dtype values, loaded as whole 16-byte vectors (two for float); eight fp8 bytes
// are one Bytes8 (fp8.cuh). (Own types: NVRTC compiles without CUDA headers.)
struct alignas(16) Pack8 { CT v[8]; };

// Eight values times scale to eight fp8 bytes, element i in byte i.
__device__ __forceinline__ Bytes8 fp8x8(const Pack8& p, float s) {
  Bytes8 r;
  r.x = fp8x2(to_f(p.v[0]) * s, to_f(p.v[1]) * s) | (fp8x2(to_f(p.v[2]) * s, to_f(p.v[3]) * s) << 16);
  r.y = fp8x2(to_f(p.v[4]) * s, to_f(p.v[5]) * s) | (fp8x2(to_f(p.v[6]) * s, to_f(p.v[7]) * s) << 16);
  return r;
}

// act = gelu(x) of eight values, each rounded to CT (gelu.cuh's sigmoid form: every FP8 kernel
// computes act and gelu' this way, so the forward's act and any recomputation of it agree).
__device__ __forceinline__ Pack8 gelu8(const Pack8& p) {
  Pack8 a;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float g, dg;
    gelu_sigmoid_and_slope(to_f(p.v[j]), g, dg);
    a.v[j] = from_f<CT>(g);
  }
  return a;
}

// dact * gelu'(pre) of eight values, each rounded to CT: k_fp8_dgelu_colsum_amax's new dact.
__device__ __forceinline__ Pack8 dgelu8(const Pack8& d, const Pack8& p) {
  Pack8 a;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float g, dg;
    gelu_sigmoid_and_slope(to_f(p.v[j]), g, dg);
    a.v[j] = from_f<CT>(to_f(d.v[j]) * dg);
  }
  return a;
}

// The bits a value adds to a maximum: ABS |x| (abs_bits), GELU |gelu8(x)|, POS max(x, 0), except
// that a negative value of magnitude 2^64 or more (-inf and a negative NaN too) gives
// AMAX_FULL_PASS, above every float: gelu8 caps its exponential, so |gelu8(x)| = |x| e^-80 is no
// longer small there, and the thread makes the full pass (fp8_amax_block).
enum { AMAX_ABS, AMAX_GELU, AMAX_POS };
#define AMAX_FULL_PASS 0xffffffffu
#define AMAX_NEG_BIG 0x5f800000u  // 2^64
template <int MODE>
__device__ __forceinline__ unsigned int amax_bits(float v) {
  unsigned int b = __float_as_uint(v), u = b & 0x7fffffffu;
  if (MODE == AMAX_POS) return (b >> 31) ? (u >= AMAX_NEG_BIG ? AMAX_FULL_PASS : 0u) : u;
  return u;
}

// The maximum of amax_bits<MODE> over this thread's Pack8 vectors [first, n / 8) of x, stepping by
// step (MODE AMAX_GELU: of gelu8(x)).
template <int MODE>
__device__ __forceinline__ unsigned int fp8_thread_max(const CT* x, i64 n, i64 first, i64 step) {
  unsigned int m = 0u;
  const Pack8* xp = reinterpret_cast<const Pack8*>(x);
  i64 i = first, n8 = n / 8;
  // four loads in flight a thread where the grid leaves each thread that many (the launcher sizes
  // the grid to a few blocks an SM: one load a thread waits on memory latency, not bandwidth)
  for (; i + 3 * step < n8; i += 4 * step) {
    Pack8 p[4] = {xp[i], xp[i + step], xp[i + 2 * step], xp[i + 3 * step]};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (MODE == AMAX_GELU) p[k] = gelu8(p[k]);
#pragma unroll
      for (int j = 0; j < 8; ++j) m = umax(m, amax_bits<MODE>(to_f(p[k].v[j])));
    }
  }
  for (; i < n8; i += step) {
    Pack8 p = xp[i];
    if (MODE == AMAX_GELU) p = gelu8(p);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = umax(m, amax_bits<MODE>(to_f(p.v[j])));
  }
  return m;
}

// |act| of a negative pre above -2^64 is at most 0.16997 (gelu's minimum, at -0.7524; below about
// -9.7 gelu8's capped exponential gives |x| e^-80, under 4e-16 there), rounded to a 16-bit CT at
// most 0.16992: below this bound (0.17f).
#define GELU_NEG_BOUND 0x3e2e147bu

// meta[0] = max(meta[0], max |x|) over the block's share (GELU: max |gelu8(x)|). The maximum is
// taken on the float bits as unsigned integers, which order non-negative floats as their values
// and put NaN above infinity, so a NaN anywhere makes amax NaN. One atomicMax per block.
// GELU without a GELU per value, for a 16-bit CT: act = gelu(x) rounded to CT is non-decreasing
// in x >= 0 (gelu' >= 0.5 there, so neighbouring 16-bit inputs, at least 2^-11 apart relative, give
// values further apart than the sigmoid form's ~1e-6 error, and rounding is monotone), and |act|
// of a negative x above -2^64 is under GELU_NEG_BOUND. So a thread takes m = the maximum of
// max(x, 0) over its values, and where |gelu8(m)| >= GELU_NEG_BOUND that is its max |act|, the same
// bits gelu8 of every value gives (NaN and +inf included); otherwise (all its values below ~0.29,
// or one at or below -2^64) it makes the pass with gelu8 again.
template <bool GELU>
__device__ __forceinline__ void fp8_amax_block(float* meta, const CT* x, i64 n, i64 first, i64 step) {
  unsigned int m;
  if (!GELU) {
    m = fp8_thread_max<AMAX_ABS>(x, n, first, step);
  } else if (sizeof(CT) == 4) {  // float32: gelu8 of every value
    m = fp8_thread_max<AMAX_GELU>(x, n, first, step);
  } else {
    unsigned int mp = fp8_thread_max<AMAX_POS>(x, n, first, step);
    m = 0u;
    if (mp != AMAX_FULL_PASS) {
      float g, dg;
      gelu_sigmoid_and_slope(__uint_as_float(mp), g, dg);
      m = abs_bits(to_f(from_f<CT>(g)));  // as gelu8 rounds it
    }
    if (m < GELU_NEG_BOUND) m = fp8_thread_max<AMAX_GELU>(x, n, first, step);
  }
  block_amax_atomic(meta, m);  // common.cuh
}

// meta[0] = max(meta[0], max |x|) over x (n values, n % 8 == 0), a grid-stride pass.
extern "C" __global__ void k_fp8_amax(float* meta, const CT* x, i64 n) {
  pdl_wait();
  fp8_amax_block<false>(meta, x, n, blockIdx.x * (i64)blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x);
}

// out (n bytes) = fp8(x * scale), scale from meta[0]; meta[inv_at] = 1/scale (n % 8 == 0).
extern "C" __global__ void k_fp8_cast(unsigned char* out, float* meta, int inv_at, const CT* x, i64 n) {
  pdl_wait();
  float inv, s = fp8_scale(meta[0], &inv);
  if (blockIdx.x == 0 && threadIdx.x == 0) meta[inv_at] = inv;
  const Pack8* xp = reinterpret_cast<const Pack8*>(x);
  Bytes8* op = reinterpret_cast<Bytes8*>(out);
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n / 8; i += (i64)gridDim.x * blockDim.x)
    op[i] = fp8x8(xp[i], s);
}

// One TR x 64 tile at (r0, c0) of x (R, K) to out (R, K) and/or out_t (K, R) (a null pointer
// skips it) with scale s: 256 threads read 8 consecutive values each, TR / 32 times, all loads
// issued before the first conversion (the stores to out could alias x, so the compiler would not
// hoist them itself), write them to out and to a shared byte tile, from which
// fp8_tile_transpose_out writes out_t. R % 8 == K % 8 == 0. The caller syncs before reusing tile.
// GELU: the tile of gelu8(x) instead (k_fp8_gelu_cast_transpose). TR: 64 (the weights' *_many
// kernel) or FP8_TILE_ROWS (the single-tensor kernels: the launcher's Tuning.fp8_tile_rows).
// partial (non-null: k_fp8_cast_transpose_colsum): partial[r0 / TR][c0 + j] = the sum of x's column
// c0 + j over the tile's rows, in fp8_tile_colsum's order; acc is its shared scratch.
#define FP8_TILE 64
#ifndef FP8_TILE_ROWS
#define FP8_TILE_ROWS 64
#endif
// The column sums of a cast tile (k_fp8_cast_transpose_colsum), in this order (fp8_tile_colsum in
// ref/fp8.py): thread t of the 256 holds rows 32h + t / 8 (h = 0 .. H-1) of the 8 columns 8 (t % 8)..;
// it adds them in h order (a = x_0 + x_1 + ...); a warp w (rows 4w + l + 32h, l = lane / 8) adds its
// four row lanes as (a_0 + a_1) + (a_2 + a_3) (two butterfly shuffles: each pair's sum has the same
// bits in either order); then the 8 warps in order, w = 0 .. 7. Rows past R add nothing. 256 threads.
template <int H, bool FULL = false>
__device__ __forceinline__ void fp8_tile_colsum_warps(const Pack8 (&p)[H], int R, int K, int r0, int c0,
                                                      float (*acc)[FP8_TILE]) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, c8 = (lane & 7) * 8;
  float a[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = 0.f;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    int r = (threadIdx.x >> 3) + 32 * h;
    if (FULL || (r0 + r < R && c0 + c8 < K)) {
#pragma unroll
      for (int j = 0; j < 8; ++j) a[j] += to_f(p[h].v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    a[j] += __shfl_xor_sync(0xffffffffu, a[j], 8);
    a[j] += __shfl_xor_sync(0xffffffffu, a[j], 16);
  }
  if (lane < 8) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[w][c8 + j] = a[j];
  }
}

// After the barrier that follows fp8_tile_colsum_warps: partial[row][c0 + j] = the 8 warps' sums of
// column j in order, by threads j < 64.
__device__ __forceinline__ void fp8_tile_colsum_out(float* partial, int K, int row, int c0, float (*acc)[FP8_TILE]) {
  int j = threadIdx.x;
  if (j >= FP8_TILE || c0 + j >= K) return;
  float v = acc[0][j];
#pragma unroll
  for (int w = 1; w < 8; ++w) v += acc[w][j];
  partial[(i64)row * K + c0 + j] = v;
}

// The 4 x 4 bytes of w[0..3] turned around: byte k of out[i] = byte i of w[k] (six byte permutes
// and two more; k_fp8_transpose and fp8_tile_transpose_out).
__device__ __forceinline__ void bytes_transpose4(const unsigned int (&w)[4], unsigned int (&out)[4]) {
  unsigned int lo01 = __byte_perm(w[0], w[1], 0x5140), hi01 = __byte_perm(w[0], w[1], 0x7362);
  unsigned int lo23 = __byte_perm(w[2], w[3], 0x5140), hi23 = __byte_perm(w[2], w[3], 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

// out_t (K, R) rows c0.., bytes r0.. = the shared tile (TR x 64 bytes, rows FP8_TILE + 8 apart)
// turned around. R % 8 == K % 8 == 0; 256 threads, after the barrier that made the tile.
// 2 * TR units of 8 rows x 4 columns; unit u reads its 8 rows as one 32-bit word each (rows
// 8 * (u % 4 + 4 * (u / 64)).., columns 4 * ((u / 4) % 16)..), turns the two 4 x 4 byte blocks
// around in registers and writes four 8-byte runs, one a column. A warp's word loads fall in 16
// banks (two rows 8 apart share one: 2 ways) and each of its four stores is 8 columns x 32
// contiguous bytes. (Eight 1-byte loads a run, 4-way bank conflicts, took act's cast 41.1 us a
// call against 37.2 at ANDREA-120M on an H200: docs/FP8.md.)
template <int TR, bool FULL = false>
__device__ __forceinline__ void fp8_tile_transpose_out(unsigned char* out_t, unsigned char (*tile)[FP8_TILE + 8],
                                                       int R, int K, int r0, int c0) {
#pragma unroll
  for (int k = 0; k < (2 * TR + 255) / 256; ++k) {
    int u = threadIdx.x + 256 * k, col = 4 * ((u >> 2) & 15), r8 = 8 * ((u & 3) + 4 * (u >> 6));
    if (u < 2 * TR && (FULL || (c0 + col < K && r0 + r8 < R))) {
      unsigned int top[4], low[4], lo[4], hi[4];  // rows r8.. and r8 + 4..; out_t's words
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        top[j] = *reinterpret_cast<const unsigned int*>(&tile[r8 + j][col]);
        low[j] = *reinterpret_cast<const unsigned int*>(&tile[r8 + 4 + j][col]);
      }
      bytes_transpose4(top, lo);
      bytes_transpose4(low, hi);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        *reinterpret_cast<Bytes8*>(out_t + (i64)(c0 + col + c) * R + r0 + r8) = Bytes8{lo[c], hi[c]};
    }
  }
}

// MODE: what the tile casts. TILE_CAST x itself; TILE_GELU act = gelu8(x); TILE_DGELU
// dact = dgelu8(x, pre), x the output gradient of act and pre the tile of the same place in pre.
// AMAX: amax_out (where non-null) = max(that, max |what is cast|) over the tile (block_amax_atomic).
// FULL: the tile lies wholly inside x, so no value is checked against R and K. Without the checks
// the compiler merges the loops below and unpacks each value once (the dGELU pass: 616 SASS
// instructions against 816; ANDREA-120M on an H200, 0.26 ms a step faster: docs/FP8.md).
enum { TILE_CAST = 0, TILE_GELU = 1, TILE_DGELU = 2 };
template <int MODE, int TR, bool COLSUM = false, bool AMAX = false, bool FULL = false>
__device__ __forceinline__ void fp8_cast_tile(unsigned char* out, unsigned char* out_t, const CT* x, int R,
                                              int K, int r0, int c0, float s,
                                              unsigned char (*tile)[FP8_TILE + 8], float* partial = nullptr,
                                              float (*acc)[FP8_TILE] = nullptr, const CT* pre = nullptr,
                                              float* amax_out = nullptr) {
  static_assert(TR % 32 == 0 && TR <= 256, "tile rows: a multiple of 32");
  constexpr int H = TR / 32;
  // the values are made before the conversions where the sums read them (and dGELU's always); the
  // amax is taken where they are made: in that loop, else in the conversion loop (a loop of its own
  // before the conversions measured 41.4 us a call against 37.1 for act's: docs/FP8.md)
  constexpr bool EARLY = MODE == TILE_DGELU || (MODE == TILE_GELU && COLSUM);
  constexpr bool AMAX_EARLY = AMAX && EARLY;
  Pack8 p[H];
  Pack8 g[MODE == TILE_DGELU ? H : 1];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    int c = threadIdx.x + h * blockDim.x, r = c >> 3, c8 = (c & 7) * 8;
    if (FULL || (r0 + r < R && c0 + c8 < K)) {
      p[h] = *reinterpret_cast<const Pack8*>(x + (i64)(r0 + r) * K + c0 + c8);
      if (MODE == TILE_DGELU) g[h] = *reinterpret_cast<const Pack8*>(pre + (i64)(r0 + r) * K + c0 + c8);
    }
  }
  unsigned int m = 0u;
  if (EARLY || AMAX_EARLY) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
      int c = threadIdx.x + h * blockDim.x, r = c >> 3, c8 = (c & 7) * 8;
      if (FULL || (r0 + r < R && c0 + c8 < K)) {
        if (MODE == TILE_GELU && EARLY) p[h] = gelu8(p[h]);
        if (MODE == TILE_DGELU) p[h] = dgelu8(p[h], g[MODE == TILE_DGELU ? h : 0]);
        if (AMAX_EARLY) {
#pragma unroll
          for (int j = 0; j < 8; ++j) m = umax(m, abs_bits(to_f(p[h].v[j])));
        }
      }
    }
  }
  if (COLSUM) fp8_tile_colsum_warps<H, FULL>(p, R, K, r0, c0, acc);
#pragma unroll
  for (int h = 0; h < H; ++h) {
    int c = threadIdx.x + h * blockDim.x, r = c >> 3, c8 = (c & 7) * 8;
    if (FULL || (r0 + r < R && c0 + c8 < K)) {
      Bytes8 q;
      if (AMAX && !AMAX_EARLY) {
        Pack8 v = MODE == TILE_GELU && !EARLY ? gelu8(p[h]) : p[h];
#pragma unroll
        for (int j = 0; j < 8; ++j) m = umax(m, abs_bits(to_f(v.v[j])));
        q = fp8x8(v, s);
      } else {
        q = MODE == TILE_GELU && !EARLY ? fp8x8(gelu8(p[h]), s) : fp8x8(p[h], s);
      }
      if (out) *reinterpret_cast<Bytes8*>(out + (i64)(r0 + r) * K + c0 + c8) = q;
      *reinterpret_cast<Bytes8*>(&tile[r][c8]) = q;
    }
  }
  __shared__ unsigned int warp_amax[AMAX ? 8 : 1];  // each warp's largest, read after the barrier below
  if (AMAX) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = umax(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = m;
  }
  if (!out_t && !COLSUM && !AMAX) return;
  __syncthreads();  // the tile's bytes (with COLSUM the warps' column sums, with AMAX their largest) are shared
  if (out_t) fp8_tile_transpose_out<TR, FULL>(out_t, tile, R, K, r0, c0);
  if (COLSUM) fp8_tile_colsum_out(partial, K, r0 / TR, c0, acc);
  if (AMAX && amax_out && threadIdx.x == 0) {  // one atomicMax a tile, as block_amax_atomic makes it
    unsigned int b = warp_amax[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) b = umax(b, warp_amax[w]);
    atomicMax(reinterpret_cast<unsigned int*>(amax_out), b);
  }
}

// The body of k_fp8_cast_transpose (GELU: k_fp8_gelu_cast_transpose): scale from meta[0], 1/scale
// into meta[inv_at], one block a FP8_TILE_ROWS x 64 tile.
template <int MODE, bool COLSUM = false, bool AMAX = false>
__device__ __forceinline__ void fp8_cast_transpose_tiles(unsigned char* out, unsigned char* out_t, float* meta,
                                                         int inv_at, const CT* x, int R, int K,
                                                         float* partial = nullptr, const CT* pre = nullptr,
                                                         float* amax_out = nullptr) {
  __shared__ unsigned char tile[FP8_TILE_ROWS][FP8_TILE + 8];
  __shared__ float acc[COLSUM ? 8 : 1][FP8_TILE];
  float inv, s = fp8_scale(meta[0], &inv);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) meta[inv_at] = inv;
  int r0 = blockIdx.y * FP8_TILE_ROWS, c0 = blockIdx.x * FP8_TILE;
  if (r0 + FP8_TILE_ROWS <= R && c0 + FP8_TILE <= K)  // a whole tile: no bounds checks, the loops merge
    fp8_cast_tile<MODE, FP8_TILE_ROWS, COLSUM, AMAX, true>(out, out_t, x, R, K, r0, c0, s, tile, partial, acc, pre,
                                                           amax_out);
  else
    fp8_cast_tile<MODE, FP8_TILE_ROWS, COLSUM, AMAX>(out, out_t, x, R, K, r0, c0, s, tile, partial, acc, pre,
                                                     amax_out);
}

// x (R, K) to out (R, K) and/or out_t (K, R) (a null pointer skips it), as k_fp8_cast.
extern "C" __global__ void k_fp8_cast_transpose(unsigned char* out, unsigned char* out_t, float* meta,
                                                int inv_at, const CT* x, int R, int K) {
  pdl_wait();
  fp8_cast_transpose_tiles<TILE_CAST>(out, out_t, meta, inv_at, x, R, K);
}

// k_fp8_cast_transpose, and the column sums of x (R, K) over each tile's FP8_TILE_ROWS rows:
// partial (ceil(R / FP8_TILE_ROWS), K) float32, in fp8_tile_colsum_warps' order. The backward
// pass's dY of a layer with a bias: its cast and its bias gradient's first pass in one read.
extern "C" __global__ void k_fp8_cast_transpose_colsum(unsigned char* out, unsigned char* out_t, float* meta,
                                                       int inv_at, const CT* x, int R, int K, float* partial) {
  pdl_wait();
  fp8_cast_transpose_tiles<TILE_CAST, true>(out, out_t, meta, inv_at, x, R, K, partial);
}

// ---- many tensors in one launch (the FP8 copies of the weights, made once per optimizer step)
// table: FP8_TABLE_COLS int64 per tensor: the address of x, of out, of out_t (0 skips it), R, K.
// Tensor t is blockIdx.y; its meta row is meta + t * meta_stride (amax at 0, 1/scale at inv_at).
// Each tensor's bytes and meta are exactly those of k_fp8_amax + k_fp8_cast_transpose on it alone.
#define FP8_TABLE_COLS 5

// meta[t * meta_stride] = max(that, max |x_t|) for every tensor t of the table (the launcher
// zeroes meta first). A tensor's blocks stride over it; the maximum does not depend on the split.
extern "C" __global__ void k_fp8_amax_many(float* meta, int meta_stride, const i64* table) {
  pdl_wait();
  const i64* e = table + (i64)blockIdx.y * FP8_TABLE_COLS;
  fp8_amax_block<false>(meta + (i64)blockIdx.y * meta_stride, reinterpret_cast<const CT*>(e[0]), e[3] * e[4],
                        blockIdx.x * (i64)blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x);
}

// Every tensor t of the table cast as k_fp8_cast_transpose casts it, scale from its meta row's
// amax, 1/scale into meta[t * meta_stride + inv_at]; a tensor's blocks take its tiles in turn.
extern "C" __global__ void k_fp8_cast_transpose_many(float* meta, int meta_stride, int inv_at, const i64* table) {
  pdl_wait();
  __shared__ unsigned char tile[FP8_TILE][FP8_TILE + 8];
  const i64* e = table + (i64)blockIdx.y * FP8_TABLE_COLS;
  const CT* x = reinterpret_cast<const CT*>(e[0]);
  unsigned char* out = reinterpret_cast<unsigned char*>(e[1]);
  unsigned char* out_t = reinterpret_cast<unsigned char*>(e[2]);
  int R = (int)e[3], K = (int)e[4];
  float* m = meta + (i64)blockIdx.y * meta_stride;
  float inv, s = fp8_scale(m[0], &inv);
  if (blockIdx.x == 0 && threadIdx.x == 0) m[inv_at] = inv;
  int tiles_k = (K + FP8_TILE - 1) / FP8_TILE, tiles = tiles_k * ((R + FP8_TILE - 1) / FP8_TILE);
  for (int i = blockIdx.x; i < tiles; i += gridDim.x) {
    __syncthreads();  // the previous tile's bytes are read out of the shared tile
    int r0 = (i / tiles_k) * FP8_TILE, c0 = (i % tiles_k) * FP8_TILE;
    if (r0 + FP8_TILE <= R && c0 + FP8_TILE <= K)
      fp8_cast_tile<TILE_CAST, FP8_TILE, false, false, true>(out, out_t, x, R, K, r0, c0, s, tile);
    else
      fp8_cast_tile<TILE_CAST, FP8_TILE>(out, out_t, x, R, K, r0, c0, s, tile);
  }
}

// ---- the FP8 MLP's passes over pre and dact (N, H), H = 4C (cuda/ops/mlp.py k_fp8_mlp_fwd / _bwd)

// meta[0] = max(meta[0], max |act|), act = gelu(pre) rounded to CT (gelu8; n values, n % 8 == 0),
// without writing act, and without a GELU per value (fp8_amax_block).
extern "C" __global__ void k_fp8_gelu_amax(float* meta, const CT* pre, i64 n) {
  pdl_wait();
  fp8_amax_block<true>(meta, pre, n, blockIdx.x * (i64)blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x);
}

// act = gelu(pre) (R, K) to out (R, K) and/or out_t (K, R), as k_fp8_cast_transpose casts act:
// scale from meta[0] (k_fp8_gelu_amax), 1/scale into meta[inv_at]; one block a FP8_TILE_ROWS x 64 tile.
extern "C" __global__ void k_fp8_gelu_cast_transpose(unsigned char* out, unsigned char* out_t, float* meta,
                                                     int inv_at, const CT* pre, int R, int K) {
  pdl_wait();
  fp8_cast_transpose_tiles<TILE_GELU>(out, out_t, meta, inv_at, pre, R, K);
}

// ---- delayed scaling (docs/FP8.md): the scale from earlier steps' amax, the cast in the pass that
// makes the tensor, which reduces the tensor's own amax for the steps after

// k_fp8_cast_transpose and k_fp8_cast_transpose_colsum, scale from meta[0] (a delayed scale's row),
// and amax_out[0] = max(that, max |x|) where amax_out is not null.
extern "C" __global__ void k_fp8_cast_transpose_amax(unsigned char* out, unsigned char* out_t, float* meta,
                                                     int inv_at, const CT* x, int R, int K, float* amax_out) {
  pdl_wait();
  fp8_cast_transpose_tiles<TILE_CAST, false, true>(out, out_t, meta, inv_at, x, R, K, nullptr, nullptr, amax_out);
}
extern "C" __global__ void k_fp8_cast_transpose_colsum_amax(unsigned char* out, unsigned char* out_t, float* meta,
                                                            int inv_at, const CT* x, int R, int K, float* partial,
                                                            float* amax_out) {
  pdl_wait();
  fp8_cast_transpose_tiles<TILE_CAST, true, true>(out, out_t, meta, inv_at, x, R, K, partial, nullptr, amax_out);
}

// k_fp8_gelu_cast_transpose, scale from meta[0] (a delayed scale's row, or k_fp8_gelu_amax), and
// amax_out[0] = max(that, max |act|) where amax_out is not null.
extern "C" __global__ void k_fp8_gelu_cast_transpose_amax(unsigned char* out, unsigned char* out_t, float* meta,
                                                          int inv_at, const CT* pre, int R, int K, float* amax_out) {
  pdl_wait();
  fp8_cast_transpose_tiles<TILE_GELU, false, true>(out, out_t, meta, inv_at, pre, R, K, nullptr, nullptr, amax_out);
}

// The FP8 MLP backward's pass over dact (R, K) and pre: d = dact * gelu'(pre) rounded to CT (the
// values k_fp8_dgelu_colsum_amax writes in place), cast as k_fp8_cast_transpose_colsum casts it
// (scale from meta[0], 1/scale into meta[inv_at], out and/or out_t, the column sums of d over each
// tile into partial, where partial is not null) and amax_out[0] = max(that, max |d|) where amax_out
// is not null. d itself is not stored: dact is read only.
extern "C" __global__ void k_fp8_dgelu_cast_transpose_colsum_amax(unsigned char* out, unsigned char* out_t,
                                                                  float* meta, int inv_at, const CT* dact,
                                                                  const CT* pre, int R, int K, float* partial,
                                                                  float* amax_out) {
  pdl_wait();
  fp8_cast_transpose_tiles<TILE_DGELU, true, true>(out, out_t, meta, inv_at, dact, R, K, partial, pre, amax_out);
}

// The delayed scales' rows (n of them, stride floats apart): [0] the amax the casts scale by, the
// largest of the history; [1] the amax of the step under way (the casts' atomicMax); [2, 2 +
// FP8_HIST) the amax of the last FP8_HIST steps taken, newest first (0: none yet). One thread a
// row, at the end of an optimizer step (in its CUDA graph): unless the step was skipped
// (state[skip_at] != 0) or [1] is not finite, the history moves one place and [1] enters it; then
// [1] = 0 and [0] = the history's largest. (After a load the host writes the rows whole.) Not
// finite in the history: never (a step with a non-finite amax has a non-finite loss or gradient,
// and is skipped).
#define FP8_HIST 16
extern "C" __global__ void k_fp8_delayed_roll(float* rows, int n, int stride, const double* state, int skip_at) {
  pdl_wait();
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n) return;
  float* r = rows + (i64)t * stride;
  float* h = r + 2;
  unsigned int cur = __float_as_uint(r[1]);
  if (state[skip_at] == 0.0 && (cur & 0x7fffffffu) < 0x7f800000u) {
    for (int i = FP8_HIST - 1; i > 0; --i) h[i] = h[i - 1];
    h[0] = r[1];
  }
  unsigned int m = 0u;
  for (int i = 0; i < FP8_HIST; ++i) m = umax(m, abs_bits(h[i]));
  r[0] = __uint_as_float(m);
  r[1] = 0.f;
}

// dact *= gelu'(pre) (N, H), in place (gelu.cuh's sigmoid form, as gelu8); partial[chunk][c] = the sum of the
// new dact[r][c] (as stored) over the chunk's rows, in k_colsum_partial's order (as
// k_mlp_bwd_gelu_colsum: row lane y takes rows r0 + y, r0 + y + 8, ...; then the 8 lanes in order);
// meta[0] = max(meta[0], max |new dact|) (block_amax_atomic; the launcher zeroes it). 256 threads,
// lane x = threadIdx.x % 32 owns one 16-byte vector (CT_VEC columns) of a strip of 32 vectors, row
// lane y = threadIdx.x / 32; grid (column strips, row chunks). H % CT_VEC == 0, rows 16-byte aligned.
extern "C" __global__ void k_fp8_dgelu_colsum_amax(float* __restrict__ partial, float* meta, CT* __restrict__ dact,
                                                   const CT* __restrict__ pre, i64 N, int H, int rows_per_chunk) {
  pdl_wait();
  __shared__ float acc[8][32 * CT_VEC + 1];
  int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  int hv = H / CT_VEC, v = blockIdx.x * 32 + tx;  // this lane's vector of the row
  i64 r0 = (i64)blockIdx.y * rows_per_chunk;
  i64 r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float a[CT_VEC];
  unsigned int m = 0u;
#pragma unroll
  for (int i = 0; i < CT_VEC; ++i) a[i] = 0.f;
  if (v < hv) {
#pragma unroll 4
    for (i64 r = r0 + ty; r < r1; r += 8) {
      i64 q = r * hv + v;
      vec16 p = ((const vec16*)pre)[q], d = ((const vec16*)dact)[q];
#pragma unroll
      for (int i = 0; i < CT_VEC; ++i) {
        float g, dg;
        gelu_sigmoid_and_slope(vget(p, i), g, dg);
        vset(d, i, vget(d, i) * dg);
        float stored = vget(d, i);  // rounded to CT, as the column sums and the cast read it
        a[i] += stored;
        m = umax(m, abs_bits(stored));
      }
      ((vec16*)dact)[q] = d;
    }
  }
  block_amax_atomic(meta, m);  // every thread; its __syncthreads also orders nothing below
  colsum_block_partials(partial, acc, a, tx, ty, threadIdx.x, H);  // common.cuh
}

// ---- the FP8 classifier's dlogits (cuda/fp8/ classifier): already FP8 (loss.cu's row pass)

// out_t (K, R) = x^T, of bytes: x (R, K) is FP8 already, so nothing is converted. One block of
// 256 threads a 64 x 64 tile: thread t copies 16 bytes of row t / 4 into a shared tile of 32-bit
// words; then thread (a = t % 16, b = t / 16) turns the 4 x 4 bytes of rows 4a.., word b, around
// in registers (byte permutes) and writes them as four words, bytes 4a.. of rows 4b.. of out_t (a
// warp's stores are runs of 64 contiguous bytes). R % 16 == K % 16 == 0, x and out_t 16-byte aligned.
extern "C" __global__ void k_fp8_transpose(unsigned char* __restrict__ out_t, const unsigned char* __restrict__ x,
                                           int R, int K) {
  pdl_wait();
  __shared__ unsigned int tile[FP8_TILE][FP8_TILE / 4 + 1];
  int r0 = blockIdx.y * FP8_TILE, c0 = blockIdx.x * FP8_TILE, t = threadIdx.x;
  int lr = t >> 2, lc = (t & 3) * 4;  // the loaded row, its first word
  if (r0 + lr < R && c0 + lc * 4 < K) {
    vec16 v = *reinterpret_cast<const vec16*>(x + (i64)(r0 + lr) * K + c0 + lc * 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) tile[lr][lc + i] = v.w[i];
  }
  __syncthreads();
  int a = t & 15, b = t >> 4;
  if (r0 + 4 * a >= R || c0 + 4 * b >= K) return;
  unsigned int w[4] = {tile[4 * a][b], tile[4 * a + 1][b], tile[4 * a + 2][b], tile[4 * a + 3][b]}, out[4];
  bytes_transpose4(w, out);
#pragma unroll
  for (int c = 0; c < 4; ++c)
    *reinterpret_cast<unsigned int*>(out_t + (i64)(c0 + 4 * b + c) * R + r0 + 4 * a) = out[c];
}
