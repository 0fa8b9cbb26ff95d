// attention.cu: causal multi-head attention, the kernels around cuBLAS's batched products.
//
// Version 1 (this file) materialises the scores of one layer: S = Q K^T / sqrt(hs) is a strided
// batched GEMM into a float32 (B*NH, T, T) workspace, k_attn_softmax turns it into P (compute
// dtype) and saves lse, and Y = P V is a second GEMM. The workspace is shared by all layers (the
// backward pass recomputes P from S and lse), so memory grows as B*NH*T*T once, not per layer.
// Backward: S again, P again, dV = P^T dY, dP = dY V^T (into the S workspace), k_attn_dscores
// turns P into dS = P * (dP - D) / sqrt(hs) in place (D = rowsum(dY * Y), as flash attention),
// then dQ = dS K and dK = dS^T Q. The head split (B,T,3C) -> (B,NH,T,hs) and the merges are the
// small permute kernels below. Scores above the diagonal are computed by the GEMM and ignored.
#include "common.cuh"

// The four permutes below run one block per (b, t) row (blocks stride over rows) and threads over
// its channels, so the index arithmetic is 32-bit; head h, channel d of a row sit at h*hs + d.
#define HEAD_IDX(b, h, t, d) ((((i64)(b) * NH + (h)) * T + (t)) * hs + (d))

// q, k, v (B*NH, T, hs) <- qkv (B, T, 3C), C = NH * hs.
extern "C" __global__ void k_attn_split_heads(CT* q, CT* k, CT* v, const CT* qkv, int B, int T, int NH, int hs) {
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    const CT* src = qkv + (i64)bt * 3 * C;
    for (int col = threadIdx.x; col < 3 * C; col += blockDim.x) {
      int which = col / C, h = (col % C) / hs, d = col % hs;
      CT* dst = which == 0 ? q : (which == 1 ? k : v);
      dst[HEAD_IDX(b, h, t, d)] = src[col];
    }
  }
}

// out (B, T, C) <- y (B*NH, T, hs).
extern "C" __global__ void k_attn_merge_heads(CT* out, const CT* y, int B, int T, int NH, int hs) {
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    for (int col = threadIdx.x; col < C; col += blockDim.x)
      out[(i64)bt * C + col] = y[HEAD_IDX(b, col / hs, t, col % hs)];
  }
}

// dy (B*NH, T, hs) <- dout (B, T, C).
extern "C" __global__ void k_attn_split_dout(CT* dy, const CT* dout, int B, int T, int NH, int hs) {
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    for (int col = threadIdx.x; col < C; col += blockDim.x)
      dy[HEAD_IDX(b, col / hs, t, col % hs)] = dout[(i64)bt * C + col];
  }
}

// dqkv (B, T, 3C) += [dq | dk | dv], each float32 (B*NH, T, hs).
extern "C" __global__ void k_attn_merge_grads(CT* dqkv, const float* dq, const float* dk, const float* dv,
                                              int B, int T, int NH, int hs) {
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    CT* dst = dqkv + (i64)bt * 3 * C;
    for (int col = threadIdx.x; col < 3 * C; col += blockDim.x) {
      int which = col / C, h = (col % C) / hs, d = col % hs;
      const float* src = which == 0 ? dq : (which == 1 ? dk : dv);
      dst[col] = from_f<CT>(to_f(dst[col]) + src[HEAD_IDX(b, h, t, d)]);
    }
  }
}

// One warp per score row (rows = B*NH*T, query i = row % T). S already holds the scaled scores.
// write_lse = 1 (forward): finds lse over j <= i in one online pass and saves it; 0 (backward):
// reads the saved lse. Then P[j] = exp(S[j] - lse) for j <= i and 0 above the diagonal.
extern "C" __global__ void k_attn_softmax(CT* P, float* lse, const float* S, i64 rows, int T, int write_lse) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  int i = (int)(row % T);
  const float* s = S + row * T;
  float L;
  if (write_lse) {
    float m = NEG_INF, z = 0.f;
    for (int j = lane; j <= i; j += 32) {
      float v = s[j];
      if (v > m) { z = z * expf(m - v) + 1.f; m = v; } else { z += expf(v - m); }
    }
    warp_softmax_state(m, z);
    L = m + logf(z);
    if (lane == 0) lse[row] = L;
  } else {
    L = lse[row];
  }
  CT* p = P + row * T;
  for (int j = lane; j < T; j += 32) p[j] = from_f<CT>(j <= i ? expf(s[j] - L) : 0.f);
}

// P (holding probabilities) becomes dS = P * (dP - D) * scale in place, for j <= i (entries above
// the diagonal are already 0). D = sum over the head's hs channels of dout * out at (b, i).
extern "C" __global__ void k_attn_dscores(CT* P, const float* dP, const CT* dout, const CT* out,
                                          i64 rows, int T, int NH, int hs, float scale) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  int i = (int)(row % T);
  i64 bh = row / T;
  int h = (int)(bh % NH);
  i64 b = bh / NH;
  i64 o = (b * T + i) * (i64)(NH * hs) + (i64)h * hs;
  float D = 0.f;
  for (int d = lane; d < hs; d += 32) D += to_f(dout[o + d]) * to_f(out[o + d]);
  D = warp_sum(D);
  CT* p = P + row * T;
  const float* dp = dP + row * T;
  for (int j = lane; j <= i; j += 32) p[j] = from_f<CT>(to_f(p[j]) * (dp[j] - D) * scale);
}
