// layernorm.cu: layer norm over the last axis (C), forward and backward. One warp per row for
// the row-wise parts; the weight and bias gradients are column sums over all rows, done in fixed
// row chunks (k_layernorm_bwd_partial) then added in chunk order (k_colsum_final, common.cuh),
// so no floating-point atomics. Statistics (mean, rstd) are float32 whatever CT is.
#include "common.cuh"

#define LN_EPS 1e-5f  // torch.nn.LayerNorm's default, as numpy_ref.LN_EPS

// out = (inp - mean) * rstd * weight + bias; block of 8 warps = 8 rows.
extern "C" __global__ void k_layernorm_fwd(CT* out, float* mean, float* rstd, const CT* inp,
                                           const CT* weight, const CT* bias, i64 N, int C) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  const CT* x = inp + row * C;
  float s = 0.f;
  for (int c = lane; c < C; c += 32) s += to_f(x[c]);
  float mu = warp_sum(s) / C;
  float v = 0.f;
  for (int c = lane; c < C; c += 32) { float d = to_f(x[c]) - mu; v += d * d; }
  float rs = 1.0f / sqrtf(warp_sum(v) / C + LN_EPS);
  CT* o = out + row * C;
  for (int c = lane; c < C; c += 32)
    o[c] = from_f<CT>((to_f(x[c]) - mu) * rs * to_f(weight[c]) + to_f(bias[c]));
  if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
}

// dinp += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dout * weight.
extern "C" __global__ void k_layernorm_bwd_dx(CT* dinp, const CT* dout, const CT* inp, const CT* weight,
                                              const float* mean, const float* rstd, i64 N, int C) {
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
    g[c] = from_f<CT>(to_f(g[c]) + rs * (dxh - a - xh * b));
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
