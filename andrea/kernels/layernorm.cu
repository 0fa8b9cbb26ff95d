// layernorm.cu: layer norm over the last axis (C), forward and backward. One warp per row for
// the row-wise parts; the weight and bias gradients are column sums over all rows, done in fixed
// row chunks (k_layernorm_bwd_fused's blocks, or k_layernorm_bwd_partial) then added in chunk
// order (k_colsum_final, linear.cu), so no floating-point atomics. Statistics (mean, rstd) are
// float32 whatever CT is.
// The backward kernels add into dinp, or write it without reading it (the first writer of the
// buffer in model.backward): k_layernorm_bwd_dx with accumulate = 0, k_layernorm_bwd_fused built
// with LN_ACCUMULATE 0. The same expression on a zero in place of the old value: the bits of
// adding into zeros (but for the sign of a zero result).
#include "common.cuh"

#define LN_EPS 1e-5f  // torch.nn.LayerNorm's default, as numpy_ref.LN_EPS

// The normalisation of one row x by one warp, given the lane's partial sum s of the row.
__device__ __forceinline__ void ln_row(CT* o, float* mean, float* rstd, const CT* x, const CT* weight,
                                       const CT* bias, int C, int lane, float s) {
  float mu = warp_sum(s) / C;
  float v = 0.f;
  for (int c = lane; c < C; c += 32) { float d = to_f(x[c]) - mu; v += d * d; }
  float rs = 1.0f / sqrtf(warp_sum(v) / C + LN_EPS);
  for (int c = lane; c < C; c += 32)
    o[c] = from_f<CT>((to_f(x[c]) - mu) * rs * to_f(weight[c]) + to_f(bias[c]));
  if (lane == 0) { *mean = mu; *rstd = rs; }
}

// out = (inp - mean) * rstd * weight + bias; block of 8 warps = 8 rows.
extern "C" __global__ void k_layernorm_fwd(CT* out, float* mean, float* rstd, const CT* inp,
                                           const CT* weight, const CT* bias, i64 N, int C) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  const CT* x = inp + row * C;
  float s = 0.f;
  for (int c = lane; c < C; c += 32) s += to_f(x[c]);
  ln_row(out + row * C, mean + row, rstd + row, x, weight, bias, C, lane, s);
}

// The residual add fused into the layer norm that follows it: res = a + b (rounded to CT, as
// k_residual_add writes it), then out = layer norm of res, as k_layernorm_fwd; one pass over a
// and b instead of a write and a read of res in between. Block of 8 warps = 8 rows.
extern "C" __global__ void k_residual_layernorm_fwd(CT* res, CT* out, float* mean, float* rstd,
                                                    const CT* a, const CT* b, const CT* weight,
                                                    const CT* bias, i64 N, int C) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  CT* x = res + row * C;
  const CT* ar = a + row * C;
  const CT* br = b + row * C;
  float s = 0.f;
  for (int c = lane; c < C; c += 32) {
    CT r = from_f<CT>(to_f(ar[c]) + to_f(br[c]));
    x[c] = r;
    s += to_f(r);
  }
  ln_row(out + row * C, mean + row, rstd + row, x, weight, bias, C, lane, s);
}

// dinp += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dout * weight
// (accumulate = 0: dinp =).
extern "C" __global__ void k_layernorm_bwd_dx(CT* dinp, const CT* dout, const CT* inp, const CT* weight,
                                              const float* mean, const float* rstd, i64 N, int C,
                                              int accumulate) {
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

// Version 3 of the backward pass (version 2, in git history, loaded one element per lane; version
// 4, a grid sized to the SMs with its own reduction tree, was slower on an H200 and is in git
// history too, docs/BENCHMARKS.md):
// for C <= LN_MAXC with rows in whole 16-byte vectors (C a multiple of 16 / sizeof(CT)); the
// launcher compiles it with LN_MAXC = C rounded up to 32 vectors, so the per-lane arrays are no
// longer than the row. One kernel reads each row once, 16 bytes per load. A block of 8 warps owns
// a contiguous chunk of rows (one warp per row at a time); each lane keeps the row's values and its
// running dweight/dbias sums for its vectors (lane, lane+32, ...) in registers. The warps then add
// their sums into shared memory one warp after another (a fixed order) and the block writes its
// partial row pdw/pdb[blockIdx.x][C]; k_colsum_final adds the blocks in order. dinp's row is
// loaded with the row's other inputs (one memory round trip per row; an earlier form,
// in git history, loaded it after the reductions), with two blocks per SM up to C = 768.
#ifndef LN_MAXC
#define LN_MAXC 1024
#endif
#define LN_VEC CT_VEC  // elements per 16-byte vector (common.cuh)
#define LN_CHUNKS ((LN_MAXC + 32 * LN_VEC - 1) / (32 * LN_VEC))  // vectors per lane
#ifndef LN_ACCUMULATE
#define LN_ACCUMULATE 1  // 0 (accumulate=False): dinp written, never loaded
#endif
extern "C" __global__ void __launch_bounds__(256, LN_MAXC <= 768 ? 2 : 1) k_layernorm_bwd_fused(
    CT* dinp, float* pdw, float* pdb, const CT* dout, const CT* inp, const CT* weight,
    const float* mean, const float* rstd, i64 N, int C, int rows_per_block) {
  __shared__ float sw[LN_CHUNKS * 32 * LN_VEC], sb[LN_CHUNKS * 32 * LN_VEC];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, nq = C / LN_VEC;
  float aw[LN_CHUNKS][LN_VEC], ab[LN_CHUNKS][LN_VEC];
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k)
#pragma unroll
    for (int j = 0; j < LN_VEC; ++j) aw[k][j] = ab[k][j] = 0.f;
  i64 r0 = (i64)blockIdx.x * rows_per_block;
  i64 r1 = r0 + rows_per_block < N ? r0 + rows_per_block : N;
  for (i64 r = r0 + warp; r < r1; r += nw) {
    const CT* x = inp + r * C;
    const CT* d = dout + r * C;
    CT* g = dinp + r * C;
    float mu = mean[r], rs = rstd[r], xh[LN_CHUNKS][LN_VEC], dy[LN_CHUNKS][LN_VEC], a = 0.f, b = 0.f;
    vec16 rg[LN_CHUNKS];  // dinp's row, loaded with the others: one memory round trip per row, not two
#pragma unroll
    for (int k = 0; k < LN_CHUNKS; ++k) {
      int q = lane + 32 * k;
      vec16 rx = {{0u, 0u, 0u, 0u}}, rd = rx, rw = rx;
      rg[k] = rx;
      if (q < nq) {
        rx = *(const vec16*)(x + q * LN_VEC);
        rd = *(const vec16*)(d + q * LN_VEC);
        rw = *(const vec16*)(weight + q * LN_VEC);
#if LN_ACCUMULATE  // 0: dinp written, not loaded
        rg[k] = *(const vec16*)(g + q * LN_VEC);
#endif
      }
      const CT* ex = (const CT*)&rx;
      const CT* ed = (const CT*)&rd;
      const CT* ew = (const CT*)&rw;
#pragma unroll
      for (int j = 0; j < LN_VEC; ++j) {
        xh[k][j] = q < nq ? (to_f(ex[j]) - mu) * rs : 0.f;
        dy[k][j] = to_f(ed[j]);
        float dxh = dy[k][j] * to_f(ew[j]);
        a += dxh;
        b += dxh * xh[k][j];
        aw[k][j] += dy[k][j] * xh[k][j];
        ab[k][j] += dy[k][j];
      }
    }
    a = warp_sum(a) / C;
    b = warp_sum(b) / C;
#pragma unroll
    for (int k = 0; k < LN_CHUNKS; ++k) {
      int q = lane + 32 * k;
      if (q < nq) {
        vec16 rw = *(const vec16*)(weight + q * LN_VEC);
        CT* eg = (CT*)&rg[k];
        const CT* ew = (const CT*)&rw;
#pragma unroll
        for (int j = 0; j < LN_VEC; ++j)
          eg[j] = from_f<CT>(to_f(eg[j]) + rs * (dy[k][j] * to_f(ew[j]) - a - xh[k][j] * b));
        *(vec16*)(g + q * LN_VEC) = rg[k];
      }
    }
  }
  for (int w = 0; w < nw; ++w) {  // warps add into shared memory in order: reproducible sums
    if (warp == w)
#pragma unroll
      for (int k = 0; k < LN_CHUNKS; ++k) {
        int q = lane + 32 * k;
        if (q < nq)
#pragma unroll
          for (int j = 0; j < LN_VEC; ++j) {
            int c = q * LN_VEC + j;
            sw[c] = (w == 0 ? 0.f : sw[c]) + aw[k][j];
            sb[c] = (w == 0 ? 0.f : sb[c]) + ab[k][j];
          }
      }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    pdw[(i64)blockIdx.x * C + c] = sw[c];
    pdb[(i64)blockIdx.x * C + c] = sb[c];
  }
}


// Version 2 of the layer-norm forward, for rows in whole 16-byte vectors with C <= LN_MAXC
// (compiled per width as k_layernorm_bwd_fused): k_layernorm_fwd (b null: the row is a) and
// k_residual_layernorm_fwd (res = a + b, rounded to CT, written, then normalised) with 16-byte
// loads and stores and the row kept in registers between its three uses. Both launchers take it
// for such rows, so the fused kernel still gives the bits of k_residual_add + k_layernorm_fwd;
// k_layernorm_fwd / k_residual_layernorm_fwd above (one element per lane) serve other rows.
// One warp per row, lane l holding vectors l, l + 32, ...; block of 8 warps = 8 rows.
extern "C" __global__ void __launch_bounds__(256) k_layernorm_fwd_vec(
    CT* res, CT* out, float* mean, float* rstd, const CT* a, const CT* b, const CT* weight,
    const CT* bias, i64 N, int C) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31, nq = C / LN_VEC;
  if (row >= N) return;
  const vec16* av = (const vec16*)(a + row * C);
  const vec16* bv = (const vec16*)(b + row * C);
  vec16* rv = (vec16*)(res + row * C);
  vec16* ov = (vec16*)(out + row * C);
  float x[LN_CHUNKS][LN_VEC], s = 0.f;
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
  float mu = warp_sum(s) / C, v = 0.f;
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k)
    if (lane + 32 * k < nq)
#pragma unroll
      for (int i = 0; i < LN_VEC; ++i) { float d = x[k][i] - mu; v += d * d; }
  float rs = 1.0f / sqrtf(warp_sum(v) / C + LN_EPS);
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k) {
    int q = lane + 32 * k;
    if (q < nq) {
      vec16 rw = ((const vec16*)weight)[q], rb = ((const vec16*)bias)[q], ro;
#pragma unroll
      for (int i = 0; i < LN_VEC; ++i) vset(ro, i, (x[k][i] - mu) * rs * vget(rw, i) + vget(rb, i));
      ov[q] = ro;
    }
  }
  if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
}
