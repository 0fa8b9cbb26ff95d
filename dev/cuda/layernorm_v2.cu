// layernorm_v2.cu: version 3 of the layer-norm backward, as andrea/kernels/layernorm.cu had it
// before version 4; kept to time against it. One block of 8 warps per chunk of rows, one row per
// warp at a time (lane l holding vectors l, l + 32, ... of the row), the block's dweight/dbias
// partial row written to pdw/pdb and added by two k_colsum_final launches (layernorm_v2.py).
// The package file is included and its k_layernorm_bwd_fused renamed out of the way.
#define k_layernorm_bwd_fused k_layernorm_bwd_fused_current  // the package's version, out of the way
#include "layernorm.cu"
#undef k_layernorm_bwd_fused

#define LN_CHUNKS_V2 ((LN_MAXC + 32 * LN_VEC - 1) / (32 * LN_VEC))  // vectors per lane
extern "C" __global__ void __launch_bounds__(256, LN_MAXC <= 768 ? 2 : 1) k_layernorm_bwd_fused(
    CT* dinp, float* pdw, float* pdb, const CT* dout, const CT* inp, const CT* weight,
    const float* mean, const float* rstd, i64 N, int C, int rows_per_block) {
  __shared__ float sw[LN_CHUNKS_V2 * 32 * LN_VEC], sb[LN_CHUNKS_V2 * 32 * LN_VEC];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, nq = C / LN_VEC;
  float aw[LN_CHUNKS_V2][LN_VEC], ab[LN_CHUNKS_V2][LN_VEC];
#pragma unroll
  for (int k = 0; k < LN_CHUNKS_V2; ++k)
#pragma unroll
    for (int j = 0; j < LN_VEC; ++j) aw[k][j] = ab[k][j] = 0.f;
  i64 r0 = (i64)blockIdx.x * rows_per_block;
  i64 r1 = r0 + rows_per_block < N ? r0 + rows_per_block : N;
  for (i64 r = r0 + warp; r < r1; r += nw) {
    const CT* x = inp + r * C;
    const CT* d = dout + r * C;
    CT* g = dinp + r * C;
    float mu = mean[r], rs = rstd[r], xh[LN_CHUNKS_V2][LN_VEC], dy[LN_CHUNKS_V2][LN_VEC], a = 0.f, b = 0.f;
    vec16 rg[LN_CHUNKS_V2];  // dinp's row, loaded with the others: one memory round trip per row, not two
#pragma unroll
    for (int k = 0; k < LN_CHUNKS_V2; ++k) {
      int q = lane + 32 * k;
      vec16 rx = {{0u, 0u, 0u, 0u}}, rd = rx, rw = rx;
      rg[k] = rx;
      if (q < nq) {
        rx = *(const vec16*)(x + q * LN_VEC);
        rd = *(const vec16*)(d + q * LN_VEC);
        rw = *(const vec16*)(weight + q * LN_VEC);
#if LN_ACCUMULATE  // 0: dinp written, not loaded (as the package's version)
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
    for (int k = 0; k < LN_CHUNKS_V2; ++k) {
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
      for (int k = 0; k < LN_CHUNKS_V2; ++k) {
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
