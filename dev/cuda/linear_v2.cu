// linear_v2.cu: andrea/kernels/linear.cu (included) plus k_colsum, the bias gradients' column sums in
// one launch with 16-byte loads (launched by linear_v2.py instead of k_colsum_partial +
// k_colsum_final). Compiled and reviewed but not yet run on a GPU: check and time it with
// `python dev/cuda/harness.py linear main v2 --dtype fp16,bf16,fp32` before it replaces them.
#include "linear.cu"

// out[c] += column sums of x (N, C) in one launch with no floating-point atomics: every bias
// gradient. Block (32, 8) = one group of columns x one chunk of rows (blockIdx.y). Thread
// (tx, ty) adds rows r0 + ty, r0 + ty + 8, ... of its W columns (W = CT_VEC where rows are whole
// aligned 16-byte vectors, vec != 0, else 1); the 8 row lanes are added in order through shared
// memory and the block writes partial[chunk][c]. The last block of a column group to finish (an
// integer counter per group elects it; it does not decide any order) adds the group's chunks in
// chunk order into out and resets the counter for the next launch. The package
// takes two launches (k_colsum_partial, then k_colsum_final) and one 2-byte load per thread and row.
#define COLSUM_MAXW 8
extern "C" __global__ void __launch_bounds__(256) k_colsum(float* out, float* partial, unsigned int* counters,
                                                           const CT* x, i64 N, int C, int rows_per_chunk, int vec) {
  __shared__ float acc[8][32 * COLSUM_MAXW + 1];
  __shared__ int last;
  int W = vec ? CT_VEC : 1, tx = threadIdx.x, ty = threadIdx.y, t = ty * 32 + tx;
  int c0 = (blockIdx.x * 32 + tx) * W, gw = 32 * W, cg = blockIdx.x * gw;
  i64 r0 = (i64)blockIdx.y * rows_per_chunk;
  i64 r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float a[COLSUM_MAXW];
#pragma unroll
  for (int i = 0; i < COLSUM_MAXW; ++i) a[i] = 0.f;
  if (c0 < C) {
    if (vec) {
#pragma unroll 4
      for (i64 r = r0 + ty; r < r1; r += 8) {
        vec16 v = *(const vec16*)(x + r * C + c0);
#pragma unroll
        for (int i = 0; i < CT_VEC; ++i) a[i] += vget(v, i);
      }
    } else {
      for (i64 r = r0 + ty; r < r1; r += 8) a[0] += to_f(x[r * C + c0]);
    }
  }
#pragma unroll
  for (int i = 0; i < COLSUM_MAXW; ++i)
    if (i < W) acc[ty][tx * W + i] = a[i];  // (unrolled: a stays in registers)
  __syncthreads();
  for (int j = t; j < gw; j += blockDim.x * blockDim.y) {
    int c = cg + j;
    if (c < C) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) s += acc[k][j];
      partial[(i64)blockIdx.y * C + c] = s;
    }
  }
  __threadfence();  // this block's partial row is visible before it is counted
  __syncthreads();
  if (t == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const volatile float* p = partial;  // written by other blocks: read past L1
  for (int j = t; j < gw; j += blockDim.x * blockDim.y) {
    int c = cg + j;
    if (c < C) {
      float s = 0.f;
      for (int k = 0; k < (int)gridDim.y; ++k) s += p[(i64)k * C + c];
      out[c] += s;
    }
  }
  if (t == 0) counters[blockIdx.x] = 0u;
}

