// common.cuh: what every kernel file shares. Storage types and their conversions to float, the
// fixed-order warp and block reductions, and three small utilities of the linear layers (bias add,
// column sums in two fixed-order passes). Every file is compiled once per compute dtype, chosen
// by the launcher with -DCT=float|f16|bf16 (andrea/backends/cuda.py); arithmetic is in float.
//
// No CUDA headers are included on purpose: NVRTC finds none of them by default, so the 16-bit
// conversions are written as the PTX instructions that cuda_fp16.h itself uses.
#pragma once

#ifndef CT
#define CT float  // compute dtype of activations (what nvcc --ptx checks when no -D is given)
#endif

struct f16 { unsigned short x; };   // IEEE half, bit pattern only
struct bf16 { unsigned short x; };  // bfloat16, bit pattern only

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
  return f;
}
__device__ __forceinline__ float to_f(bf16 v) { return __uint_as_float(((unsigned int)v.x) << 16); }

template <typename T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ float from_f<float>(float f) { return f; }
template <> __device__ __forceinline__ f16 from_f<f16>(float f) {
  f16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
  return h;
}
template <> __device__ __forceinline__ bf16 from_f<bf16>(float f) {
  bf16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
  return h;
}

typedef long long i64;  // element indices: B*T*V passes 2^31 at B=32, T=1024, V=50304
#define NEG_INF __int_as_float(0xff800000)  // -inf without math.h: NVRTC compiles with no system headers

// ---------------------------------------------------------------- fixed-order reductions
// xor-shuffle trees: every lane ends with the same value, combined in the same order every run.
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Online softmax state (max m, sum s of exp(x - m)): merging two states is what lets one pass
// over a row find both; the merge order is the fixed shuffle tree, so results are reproducible.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2) {
  float mn = fmaxf(m, m2);
  if (mn == NEG_INF) { s = 0.f; m = mn; return; }  // both empty: keep (-inf, 0)
  s = s * expf(m - mn) + s2 * expf(m2 - mn);
  m = mn;
}
__device__ __forceinline__ void warp_softmax_state(float& m, float& s) {
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    softmax_merge(m, s, m2, s2);
  }
}
// Sum over a block of up to 1024 threads (blockDim.x a multiple of 32); scratch holds 32 floats.
// Returns the total to every thread.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nw ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// ---------------------------------------------------------------- linear-layer utilities
// x (N, OC) += b (OC,), in place: the bias of a cuBLAS product. Blocks stride over rows and
// threads over columns, so no 64-bit division per element.
extern "C" __global__ void k_bias_add(CT* x, const CT* b, i64 N, int OC) {
  for (i64 r = blockIdx.x; r < N; r += gridDim.x) {
    CT* row = x + r * OC;
    for (int c = threadIdx.x; c < OC; c += blockDim.x) row[c] = from_f<CT>(to_f(row[c]) + to_f(b[c]));
  }
}

// Column sums of x (N, C) in two passes with no atomics: pass 1 writes partial[chunk][c] (block
// (32, 8): 32 columns, 8 row lanes, a fixed row chunk per blockIdx.y); pass 2 adds the chunks in
// order into out[c]. Used for every bias gradient.
extern "C" __global__ void k_colsum_partial(float* partial, const CT* x, i64 N, int C, int rows_per_chunk) {
  __shared__ float acc[8][33];
  int c = blockIdx.x * 32 + threadIdx.x;
  i64 r0 = (i64)blockIdx.y * rows_per_chunk;
  i64 r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float a = 0.f;
  if (c < C)
    for (i64 r = r0 + threadIdx.y; r < r1; r += 8) a += to_f(x[r * C + c]);
  acc[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float s = 0.f;
    for (int k = 0; k < 8; ++k) s += acc[k][threadIdx.x];
    partial[(i64)blockIdx.y * C + c] = s;
  }
}

// out[c] += sum over chunks of partial[chunk][c]: one warp per column, lane j adding chunks
// j, j+32, ... in order, then the fixed shuffle tree. out is float32 (a grad).
extern "C" __global__ void k_colsum_final(float* out, const float* partial, int n_chunks, int C) {
  int c = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (c >= C) return;
  float s = 0.f;
  for (int k = lane; k < n_chunks; k += 32) s += partial[(i64)k * C + c];
  s = warp_sum(s);
  if (lane == 0) out[c] += s;
}
