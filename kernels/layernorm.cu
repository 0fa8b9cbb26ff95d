// layernorm.cu: layer norm over the last axis (C), forward and backward. One warp per row for
// the row-wise parts; the weight and bias gradients are column sums over all rows, done in fixed
// row chunks (k_layernorm_bwd_fused's blocks, or k_layernorm_bwd_partial) then added in chunk
// order (k_colsum_final, linear.cu), so no floating-point atomics. Statistics (mean, rstd) are
// float32 whatever CT is.
// The backward kernels add into dinp, or write it without reading it (the first writer of the
// buffer in model.backward): k_layernorm_bwd_dx with accumulate = 0, k_layernorm_bwd_fused built
// with LN_ACCUMULATE 0. The same expression on a zero in place of the old value: the bits of
// adding into zeros (but for the sign of a zero result).
// The forward kernels take an optional amax pointer (null in 16-bit training): with
// train.precision=fp8 they also reduce max |out| of the values they write into it, for the FP8
// cast of out that follows (fp8.cu, docs/FP8.md), so no separate pass reads out for it.
#include "common.cuh"
#include "fp8.cuh"

#define LN_EPS 1e-5f  // torch.nn.LayerNorm's default, as ref.LN_EPS

// The normalisation of one row x by one warp, given the lane's partial sum s of the row; returns
// the largest abs_bits (common.cuh) of the values the lane wrote.
__device__ __forceinline__ unsigned int ln_row(CT* o, float* mean, float* rstd, const CT* x, const CT* weight,
                                               const CT* bias, int C, int lane, float s) {
  float mu = warp_sum(s) / C;
  float v = 0.f;
  for (int c = lane; c < C; c += 32) { float d = to_f(x[c]) - mu; v += d * d; }
  float rs = 1.0f / sqrtf(warp_sum(v) / C + LN_EPS);
  unsigned int m = 0u;
  for (int c = lane; c < C; c += 32) {
    CT y = from_f<CT>((to_f(x[c]) - mu) * rs * to_f(weight[c]) + to_f(bias[c]));
    o[c] = y;
    m = umax(m, abs_bits(to_f(y)));
  }
  if (lane == 0) { *mean = mu; *rstd = rs; }
  return m;
}

// out = (inp - mean) * rstd * weight + bias; block of 8 warps = 8 rows. amax: null, or max |out|
// into *amax (common.cuh block_amax_atomic).
extern "C" __global__ void k_layernorm_fwd(CT* out, float* mean, float* rstd, const CT* inp,
                                           const CT* weight, const CT* bias, i64 N, int C, float* amax) {
  pdl_wait();
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  unsigned int m = 0u;
  if (row < N) {
    const CT* x = inp + row * C;
    float s = 0.f;
    for (int c = lane; c < C; c += 32) s += to_f(x[c]);
    m = ln_row(out + row * C, mean + row, rstd + row, x, weight, bias, C, lane, s);
  }
  if (amax) block_amax_atomic(amax, m);
}

// The residual add fused into the layer norm that follows it: res = a + b (rounded to CT, as
// k_residual_add writes it), then out = layer norm of res, as k_layernorm_fwd; one pass over a
// and b instead of a write and a read of res in between. Block of 8 warps = 8 rows. amax: as
// k_layernorm_fwd's (of out, not of res).
extern "C" __global__ void k_residual_layernorm_fwd(CT* res, CT* out, float* mean, float* rstd,
                                                    const CT* a, const CT* b, const CT* weight,
                                                    const CT* bias, i64 N, int C, float* amax) {
  pdl_wait();
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  unsigned int m = 0u;
  if (row < N) {
    CT* x = res + row * C;
    const CT* ar = a + row * C;
    const CT* br = b + row * C;
    float s = 0.f;
    for (int c = lane; c < C; c += 32) {
      CT r = from_f<CT>(to_f(ar[c]) + to_f(br[c]));
      x[c] = r;
      s += to_f(r);
    }
    m = ln_row(out + row * C, mean + row, rstd + row, x, weight, bias, C, lane, s);
  }
  if (amax) block_amax_atomic(amax, m);
}

// dinp += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dout * weight
// (accumulate = 0: dinp =).
extern "C" __global__ void k_layernorm_bwd_dx(CT* dinp, const CT* dout, const CT* inp, const CT* weight,
                                              const float* mean, const float* rstd, i64 N, int C,
                                              int accumulate) {
  pdl_wait();
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  const CT* x = inp + row * C;
  const CT* d = dout + row * C;
  float mu = mean[row], rs = rstd[row];
  float a = 0.f, b = 0.f;
  for (int c = lane; c < C; c += 32) {
    float xh = (to_f(x[c]) - mu) * rs;
    float dxh = to_f(d[c]) * to_f(weight[c]);
    a += dxh;
    b += dxh * xh;
  }
  a = warp_sum(a) / C;
  b = warp_sum(b) / C;
  CT* g = dinp + row * C;
  for (int c = lane; c < C; c += 32) {
    float xh = (to_f(x[c]) - mu) * rs;
    float dxh = to_f(d[c]) * to_f(weight[c]);
    g[c] = from_f<CT>((accumulate ? to_f(g[c]) : 0.f) + rs * (dxh - a - xh * b));
  }
}

// Partial column sums of dout * xhat (-> pdw) and dout (-> pdb) over one chunk of rows per
// blockIdx.y; block (32, 8) as k_colsum_partial.
extern "C" __global__ void k_layernorm_bwd_partial(float* pdw, float* pdb, const CT* dout, const CT* inp,
                                                   const float* mean, const float* rstd, i64 N, int C,
                                                   int rows_per_chunk) {
  pdl_wait();
  __shared__ float sw[8][33], sb[8][33];
  int c = blockIdx.x * 32 + threadIdx.x;
  i64 r0 = (i64)blockIdx.y * rows_per_chunk;
  i64 r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float aw = 0.f, ab = 0.f;
  if (c < C)
    for (i64 r = r0 + threadIdx.y; r < r1; r += 8) {
      float d = to_f(dout[r * C + c]);
      aw += d * (to_f(inp[r * C + c]) - mean[r]) * rstd[r];
      ab += d;
    }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float w = 0.f, b = 0.f;
    for (int k = 0; k < 8; ++k) { w += sw[k][threadIdx.x]; b += sb[k][threadIdx.x]; }
    pdw[(i64)blockIdx.y * C + c] = w;
    pdb[(i64)blockIdx.y * C + c] = b;
  }
}

// Version 5 of the backward pass, for C <= LN_MAXC with rows in whole 16-byte vectors (C a
// multiple of 16 / sizeof(CT)); the launcher compiles it with LN_MAXC = C rounded up to 32 vectors.
// A block owns a contiguous chunk of rows and does two phases over them (LN5_ROWS rows at a time):
//  1. rows: warp w takes rows r0 + w, r0 + w + 8, ...; its lanes (16-byte loads, vectors lane,
//     lane + 32, ...) reduce a = mean(dy * w) and b = mean(dy * w * xhat) and put the row's
//     (mean, rstd, a, b) in shared memory;
//  2. columns: thread t owns the 16-byte vector q = t % nq of every row of its row group t / nq
//     (G = blockDim / nq groups; rows r0 + g, r0 + g + G, ...): it writes dinp's vector and adds
//     dy * xhat and dy into 2 x LN_VEC registers. The groups' sums go through shared memory and are
//     added in group order into the block's partial rows pdw/pdb[blockIdx.x]; k_colsum_final adds
//     the blocks in order.
// Phase 2 reads x and dy again, from L1/L2 (the block read those rows moments before). Version 3
// (in git history) did both in one pass, each lane keeping its columns' xhat, dy and running sums
// in registers: 128 registers a thread, two blocks an SM, and an ordered warp-by-warp end phase
// at the block barrier (ncu on an H200: 30.9 us at 8192 x 768, an issue slot used one cycle in
// four). Version 5 uses 64 registers and was 1.2-1.3x faster on an H200 (docs/BENCHMARKS.md).
// Version 4, a grid sized to the SMs with its own reduction tree, was slower than version 3.
#ifndef LN_MAXC
#define LN_MAXC 1024
#endif
#define LN_VEC CT_VEC  // elements per 16-byte vector (common.cuh)
#define LN_CHUNKS ((LN_MAXC + 32 * LN_VEC - 1) / (32 * LN_VEC))  // vectors per lane in phase 1
#ifndef LN_ACCUMULATE
#define LN_ACCUMULATE 1  // 0 (accumulate=False): dinp written, never loaded
#endif
#define LN5_ROWS 256  // rows of one pass of the two phases (a block with more rows loops)

extern "C" __global__ void __launch_bounds__(256) k_layernorm_bwd_fused(
    CT* dinp, float* pdw, float* pdb, const CT* dout, const CT* inp, const CT* weight,
    const float* mean, const float* rstd, i64 N, int C, int rows_per_block) {
  pdl_wait();
  __shared__ float s_mu[LN5_ROWS], s_rs[LN5_ROWS], s_a[LN5_ROWS], s_b[LN5_ROWS];
  __shared__ float s_w[256 * LN_VEC], s_b2[256 * LN_VEC];  // G groups' sums, G * nq <= 256 vectors
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, nq = C / LN_VEC;
  int G = blockDim.x / nq, grp = threadIdx.x / nq, q = threadIdx.x % nq;
  bool owner = grp < G;  // threads beyond G * nq only help in the row phase
  float aw[LN_VEC], ab[LN_VEC];
#pragma unroll
  for (int j = 0; j < LN_VEC; ++j) aw[j] = ab[j] = 0.f;
  vec16 rw = {{0u, 0u, 0u, 0u}};
  if (owner) rw = ((const vec16*)weight)[q];
  i64 b0 = (i64)blockIdx.x * rows_per_block;
  i64 b1 = b0 + rows_per_block < N ? b0 + rows_per_block : N;
  for (i64 r0 = b0; r0 < b1; r0 += LN5_ROWS) {
    int nr = (int)(b1 - r0 < LN5_ROWS ? b1 - r0 : LN5_ROWS);
    // phase 1: the row reductions, as version 3
    for (int i = warp; i < nr; i += nw) {
      i64 r = r0 + i;
      const CT* x = inp + r * C;
      const CT* d = dout + r * C;
      float mu = mean[r], rs = rstd[r], a = 0.f, b = 0.f;
#pragma unroll
      for (int k = 0; k < LN_CHUNKS; ++k) {
        int qq = lane + 32 * k;
        vec16 rx = {{0u, 0u, 0u, 0u}}, rd = rx, rv = rx;
        if (qq < nq) {
          rx = *(const vec16*)(x + qq * LN_VEC);
          rd = *(const vec16*)(d + qq * LN_VEC);
          rv = *(const vec16*)(weight + qq * LN_VEC);
        }
#pragma unroll
        for (int j = 0; j < LN_VEC; ++j) {
          float xh = qq < nq ? (vget(rx, j) - mu) * rs : 0.f;
          float dxh = vget(rd, j) * vget(rv, j);
          a += dxh;
          b += dxh * xh;
        }
      }
      a = warp_sum(a) / C;
      b = warp_sum(b) / C;
      if (lane == 0) { s_mu[i] = mu; s_rs[i] = rs; s_a[i] = a; s_b[i] = b; }
    }
    __syncthreads();
    // phase 2: dinp and the column sums, one vector of every G-th row per thread
    if (owner) {
#pragma unroll 4
      for (int i = grp; i < nr; i += G) {
        i64 r = r0 + i;
        float mu = s_mu[i], rs = s_rs[i], a = s_a[i], b = s_b[i];
        vec16 rx = ((const vec16*)(inp + r * C))[q];
        vec16 rd = ((const vec16*)(dout + r * C))[q];
        vec16* gp = (vec16*)(dinp + r * C) + q;
#if LN_ACCUMULATE
        vec16 rg = *gp;
#else
        vec16 rg = {{0u, 0u, 0u, 0u}};
#endif
#pragma unroll
        for (int j = 0; j < LN_VEC; ++j) {
          float xh = (vget(rx, j) - mu) * rs;
          float dy = vget(rd, j);
          vset(rg, j, vget(rg, j) + rs * (dy * vget(rw, j) - a - xh * b));
          aw[j] += dy * xh;
          ab[j] += dy;
        }
        *gp = rg;
      }
    }
    __syncthreads();  // s_* are rewritten by the next pass's phase 1
  }
  if (owner)
#pragma unroll
    for (int j = 0; j < LN_VEC; ++j) {
      s_w[grp * nq * LN_VEC + q * LN_VEC + j] = aw[j];
      s_b2[grp * nq * LN_VEC + q * LN_VEC + j] = ab[j];
    }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float w = s_w[c], bb = s_b2[c];
    for (int g = 1; g < G; ++g) { w += s_w[g * C + c]; bb += s_b2[g * C + c]; }
    pdw[(i64)blockIdx.x * C + c] = w;
    pdb[(i64)blockIdx.x * C + c] = bb;
  }
}


// Version 2 of the layer-norm forward, for rows in whole 16-byte vectors with C <= LN_MAXC
// (compiled per width as k_layernorm_bwd_fused): k_layernorm_fwd (b null: the row is a) and
// k_residual_layernorm_fwd (res = a + b, rounded to CT, written, then normalised) with 16-byte
// loads and stores and the row kept in registers between its three uses. Both launchers take it
// for such rows, so the fused kernel still gives the bits of k_residual_add + k_layernorm_fwd;
// k_layernorm_fwd / k_residual_layernorm_fwd above (one element per lane) serve other rows.
// One warp per row, lane l holding vectors l, l + 32, ...; block of 8 warps = 8 rows. amax: as
// k_layernorm_fwd's. Its two halves (ln_vec_stats, ln_vec_out) are k_layernorm_fwd_fp8's too.

// The lane's vectors of row `row` of a (plus b, rounded to CT and written to res, where b is not
// null) into x; returns the row's mean in mu and 1 / its standard deviation in rs.
__device__ __forceinline__ void ln_vec_stats(float (&x)[LN_CHUNKS][LN_VEC], CT* res, const CT* a, const CT* b,
                                             i64 row, int C, int lane, float& mu, float& rs) {
  int nq = C / LN_VEC;
  const vec16* av = (const vec16*)(a + row * C);
  const vec16* bv = (const vec16*)(b + row * C);
  vec16* rv = (vec16*)(res + row * C);
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k) {
    int q = lane + 32 * k;
    if (q < nq) {
      vec16 rr = av[q];
      if (b) {
        vec16 rb = bv[q];
#pragma unroll
        for (int i = 0; i < LN_VEC; ++i) vset(rr, i, vget(rr, i) + vget(rb, i));  // as k_residual_add
        rv[q] = rr;
      }
#pragma unroll
      for (int i = 0; i < LN_VEC; ++i) { x[k][i] = vget(rr, i); s += x[k][i]; }
    }
  }
  mu = warp_sum(s) / C;
  float v = 0.f;
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k)
    if (lane + 32 * k < nq)
#pragma unroll
      for (int i = 0; i < LN_VEC; ++i) { float d = x[k][i] - mu; v += d * d; }
  rs = 1.0f / sqrtf(warp_sum(v) / C + LN_EPS);
}

// Vector q of the normalised row (xk: its values from ln_vec_stats), rounded to CT; m takes the
// largest abs_bits of its values.
__device__ __forceinline__ vec16 ln_vec_out(const float (&xk)[LN_VEC], float mu, float rs, const CT* weight,
                                            const CT* bias, int q, unsigned int& m) {
  vec16 rw = ((const vec16*)weight)[q], rb = ((const vec16*)bias)[q], ro;
#pragma unroll
  for (int i = 0; i < LN_VEC; ++i) {
    vset(ro, i, (xk[i] - mu) * rs * vget(rw, i) + vget(rb, i));
    m = umax(m, abs_bits(vget(ro, i)));  // the value as written, rounded to CT
  }
  return ro;
}

extern "C" __global__ void __launch_bounds__(256) k_layernorm_fwd_vec(
    CT* res, CT* out, float* mean, float* rstd, const CT* a, const CT* b, const CT* weight,
    const CT* bias, i64 N, int C, float* amax) {
  pdl_wait();
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31, nq = C / LN_VEC;
  unsigned int m = 0u;
  if (row < N) {
    float x[LN_CHUNKS][LN_VEC], mu, rs;
    ln_vec_stats(x, res, a, b, row, C, lane, mu, rs);
    vec16* ov = (vec16*)(out + row * C);
#pragma unroll
    for (int k = 0; k < LN_CHUNKS; ++k) {
      int q = lane + 32 * k;
      if (q < nq) ov[q] = ln_vec_out(x[k], mu, rs, weight, bias, q, m);
    }
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
  }
  if (amax) block_amax_atomic(amax, m);
}

// The layer-norm forward that writes its output as the FP8 operand of the product that reads it
// (train.precision=fp8 with delayed scaling, docs/FP8.md): k_layernorm_fwd_vec's res, mean and rstd
// and its out values (rounded to CT, never stored in CT), each times the scale from meta[0]
// (fp8_scale: a delayed scale's row) as E4M3 bytes, to q (N, C) and its transpose q_t (C, N), the
// bytes k_fp8_cast_transpose_amax makes of out; meta[inv_at] = 1/scale, and amax_out[0] = max(that,
// max |out|) where amax_out is not null. One block of LN_FP8_WARPS warps (the launcher's
// Tuning.fp8_layernorm_warps: 4, 8, 16 or 32) a tile of LN_FP8_ROWS rows (fp8_layernorm_rows: 8,
// 16 or 32): warp w normalises rows w, w + LN_FP8_WARPS, ... of it, writing q's bytes and a shared
// copy of the tile; then each thread writes 8 bytes of a column of q_t at a time (LN_FP8_ROWS
// bytes a column a block: 32 fill a sector). N a multiple of 8.
#ifndef LN_FP8_ROWS
#define LN_FP8_ROWS 16
#endif
#ifndef LN_FP8_WARPS
#define LN_FP8_WARPS 8
#endif
extern "C" __global__ void __launch_bounds__(32 * LN_FP8_WARPS) k_layernorm_fwd_fp8(
    unsigned char* q, unsigned char* q_t, CT* res, float* mean, float* rstd, const CT* a, const CT* b,
    const CT* weight, const CT* bias, i64 N, int C, float* meta, int inv_at, float* amax_out) {
  pdl_wait();
  // the tile's bytes as words, LN_MAXC + 4 bytes a row: rows 8 apart fall in other banks
  __shared__ unsigned int tile[LN_FP8_ROWS][LN_MAXC / 4 + 1];
  __shared__ unsigned int warp_amax[LN_FP8_WARPS];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nq = C / LN_VEC;
  i64 r0 = (i64)blockIdx.x * LN_FP8_ROWS;
  float inv, s = fp8_scale(meta[0], &inv);
  if (blockIdx.x == 0 && threadIdx.x == 0) meta[inv_at] = inv;
  unsigned int m = 0u;
  for (int r = warp; r < LN_FP8_ROWS && r0 + r < N; r += LN_FP8_WARPS) {
    i64 row = r0 + r;
    float x[LN_CHUNKS][LN_VEC], mu, rs;
    ln_vec_stats(x, res, a, b, row, C, lane, mu, rs);
#pragma unroll
    for (int k = 0; k < LN_CHUNKS; ++k) {
      int v = lane + 32 * k;
      if (v < nq) {
        vec16 ro = ln_vec_out(x[k], mu, rs, weight, bias, v, m);
        unsigned int w[LN_VEC / 4];
#pragma unroll
        for (int j = 0; j < LN_VEC / 4; ++j)
          w[j] = fp8x2(vget(ro, 4 * j) * s, vget(ro, 4 * j + 1) * s) |
                 (fp8x2(vget(ro, 4 * j + 2) * s, vget(ro, 4 * j + 3) * s) << 16);
        // 16-bit CT: 8 bytes (w[LN_VEC / 4 - 1] is w[1]; written so, the float build indexes inside w)
        if (LN_VEC == 8) *reinterpret_cast<Bytes8*>(q + row * C + v * 8) = Bytes8{w[0], w[LN_VEC / 4 - 1]};
        else *reinterpret_cast<unsigned int*>(q + row * C + v * LN_VEC) = w[0];
#pragma unroll
        for (int j = 0; j < LN_VEC / 4; ++j) tile[r][v * (LN_VEC / 4) + j] = w[j];
      }
    }
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = umax(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) warp_amax[warp] = m;
  __syncthreads();  // the tile's bytes and the warps' largest are shared
  const unsigned char* tb = reinterpret_cast<const unsigned char*>(tile);
  constexpr int STRIDE = (LN_MAXC / 4 + 1) * 4, GROUPS = LN_FP8_ROWS / 8;
  for (int i = threadIdx.x; i < C * GROUPS; i += blockDim.x) {
    int col = i / GROUPS, r8 = (i % GROUPS) * 8;
    if (r0 + r8 < N) {
      unsigned int lo = 0u, hi = 0u;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo |= (unsigned int)tb[(r8 + j) * STRIDE + col] << (8 * j);
        hi |= (unsigned int)tb[(r8 + 4 + j) * STRIDE + col] << (8 * j);
      }
      *reinterpret_cast<Bytes8*>(q_t + (i64)col * N + r0 + r8) = Bytes8{lo, hi};
    }
  }
  if (amax_out && threadIdx.x == 0) {  // one atomicMax a tile
    unsigned int bmax = warp_amax[0];
#pragma unroll
    for (int w = 1; w < LN_FP8_WARPS; ++w) bmax = umax(bmax, warp_amax[w]);
    atomicMax(reinterpret_cast<unsigned int*>(amax_out), bmax);
  }
}
