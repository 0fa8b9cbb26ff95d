// mlp.cu: the elementwise parts of k_mlp_fwd / k_mlp_bwd (andrea/backends/cuda/ops/), around the
// two products, named by the operation they belong to: k_mlp_fwd_bias_gelu (the first bias fused
// with GELU, tanh form as GPT-2; only when cuBLASLt's bias + GELU epilogue does not apply),
// k_mlp_bwd_gelu (GELU recomputed from the saved pre-activation, and the GELU derivative applied
// to the gradient of the second product's input, in one pass; k_mlp_bwd_gelu_colsum does the same and
// also the column partials of the first bias's gradient, so that dpre is not read again for them).
// The second bias and the other bias gradients are linear.cu's k_bias_add and k_colsum_*.
#include "common.cuh"
#include "gelu.cuh"

// pre (N, H) += b1 (rounded to CT, as saved); act = gelu(pre).
// Blocks stride over rows, threads over columns (no 64-bit division per element).
extern "C" __global__ void k_mlp_fwd_bias_gelu(CT* pre, CT* act, const CT* b1, i64 N, int H) {
  pdl_wait();
  for (i64 r = blockIdx.x; r < N; r += gridDim.x)
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
      i64 i = r * H + c;
      CT v = from_f<CT>(to_f(pre[i]) + to_f(b1[c]));
      pre[i] = v;
      act[i] = from_f<CT>(gelu(to_f(v)));
    }
}

// act = gelu(pre) where act is not null (the backward pass recomputes what the forward pass did
// not keep), and dact *= gelu'(pre) where dact is not null: one pass over pre for both, 16 bytes
// per load where every buffer allows it (version 1, in git history, loaded one element per
// thread, with a separate kernel for the derivative). gelu and gelu_and_slope: gelu.cuh.
extern "C" __global__ void k_mlp_bwd_gelu(CT* act, CT* dact, const CT* pre, i64 total) {
  pdl_wait();
  i64 i0 = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  float g, dg;
  if (total % CT_VEC == 0 && aligned16(pre) && aligned16(act) && aligned16(dact)) {
    for (i64 q = i0; q < total / CT_VEC; q += stride) {
      vec16 p = ((const vec16*)pre)[q], a, d;
      if (dact) d = ((const vec16*)dact)[q];
#pragma unroll
      for (int i = 0; i < CT_VEC; ++i) {
        gelu_and_slope(vget(p, i), g, dg);
        vset(a, i, g);
        if (dact) vset(d, i, vget(d, i) * dg);
      }
      if (act) ((vec16*)act)[q] = a;
      if (dact) ((vec16*)dact)[q] = d;
    }
    return;
  }
  for (i64 i = i0; i < total; i += stride) {
    gelu_and_slope(to_f(pre[i]), g, dg);
    if (act) act[i] = from_f<CT>(g);
    if (dact) dact[i] = from_f<CT>(to_f(dact[i]) * dg);
  }
}

// k_mlp_bwd_gelu's pass (act = gelu(pre), dact *= gelu'(pre)) fused with k_colsum_partial of the
// result: partial[chunk][c] = sum of the new dact[r][c] (as stored, rounded to CT) over the chunk's
// rows, in k_colsum_partial's order (row lane y takes rows r0 + y, r0 + y + 8, ...; then the 8 lanes
// in order), so k_colsum_final gives the bits of the unfused pair. Block (32, 8): lane x owns one
// 16-byte vector (CT_VEC columns) of a strip of 32 vectors; grid (column strips, row chunks).
// Needs H % CT_VEC == 0 and 16-byte aligned rows (the launcher falls back to the pair otherwise).
extern "C" __global__ void k_mlp_bwd_gelu_colsum(float* __restrict__ partial, CT* __restrict__ act,
                                                 CT* __restrict__ dact, const CT* __restrict__ pre, i64 N,
                                                 int H, int rows_per_chunk) {
  pdl_wait();
  __shared__ float acc[8][32 * CT_VEC + 1];
  int hv = H / CT_VEC, v = blockIdx.x * 32 + threadIdx.x;  // this lane's vector of the row
  i64 r0 = (i64)blockIdx.y * rows_per_chunk;
  i64 r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float a[CT_VEC];
#pragma unroll
  for (int i = 0; i < CT_VEC; ++i) a[i] = 0.f;
  if (v < hv) {
#pragma unroll 4
    for (i64 r = r0 + threadIdx.y; r < r1; r += 8) {
      i64 q = r * hv + v;
      vec16 p = ((const vec16*)pre)[q], d = ((const vec16*)dact)[q], g16;
#pragma unroll
      for (int i = 0; i < CT_VEC; ++i) {
        float g, dg;
        gelu_and_slope(vget(p, i), g, dg);
        vset(g16, i, g);
        vset(d, i, vget(d, i) * dg);
        a[i] += vget(d, i);  // the stored (rounded) value, as k_colsum_partial reads it
      }
      ((vec16*)act)[q] = g16;
      ((vec16*)dact)[q] = d;
    }
  }
  colsum_block_partials(partial, acc, a, threadIdx.x, threadIdx.y, threadIdx.y * 32 + threadIdx.x, H);  // common.cuh
}
