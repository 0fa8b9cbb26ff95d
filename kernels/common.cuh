// common.cuh: what every kernel file shares. Storage types and their conversions to float, the
// fixed-order warp and block reductions. Every file is compiled once per compute dtype, chosen
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

// Programmatic dependent launch (docs/ARCHITECTURE.md "Launch"). Every kernel calls pdl_wait()
// first, before it touches memory. When the launcher sets the launch's programmatic attribute
// (Runtime.pdl, sm_90 and newer), the grid may start while the kernel before it in the stream
// still runs; griddepcontrol.wait then holds it until that grid has completed and its writes are
// visible, so what follows reads what it would have read without the attribute. The
// launch_dependents after it lets the next kernel's blocks be scheduled once every block of this
// one has started: its launch and its prologue overlap this kernel's last wave. Launched without
// the attribute, or built for an older architecture, both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

typedef long long i64;  // element indices: B*T*V passes 2^31 at B=32, T=1024, V=50304

// pdl_prefetch_wait: hints memory that no kernel before it in the stream writes (the weights while
// decoding, the key/value rows of earlier positions) into L2, a 128-byte line a thread at a time,
// then pdl_wait(). A hint returns no data, so the kernel still reads nothing before the wait: it
// only finds those lines in L2 when it does. Launched with the programmatic attribute, the hints
// go out while the kernel before it still runs (cuda/pdl.py accepts it as a first statement).
// Form 1: bytes from p. Form 2: rows of row_bytes at a stride of stride bytes, from p and from p2.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
__device__ __forceinline__ void pdl_prefetch_wait(const void* p, i64 bytes) {
  const char* c = static_cast<const char*>(p);
  for (i64 i = (i64)threadIdx.x * 128; i < bytes; i += (i64)blockDim.x * 128) prefetch_l2(c + i);
  pdl_wait();
}
__device__ __forceinline__ void pdl_prefetch_wait(const void* p, const void* p2, int rows, int row_bytes,
                                                  i64 stride) {
  const char* c = static_cast<const char*>(p);
  const char* c2 = static_cast<const char*>(p2);
  const int lines = (row_bytes + 127) >> 7;
  for (int i = threadIdx.x; i < rows * lines; i += blockDim.x) {
    const i64 off = (i / lines) * stride + (i64)(i % lines) * 128;
    prefetch_l2(c + off);
    prefetch_l2(c2 + off);
  }
  pdl_wait();
}
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

// The largest |x| of a block's values, taken on the float bits as unsigned integers (they order
// non-negative floats as their values and put NaN above infinity, so a NaN makes it NaN):
// abs_bits(x) per value, umax to combine, then block_amax_atomic: *amax = max(*amax, the block's
// largest m) by a warp tree and one atomicMax a block, which does not depend on the order the
// blocks come in. Every thread of the block calls it (no early return before it); the caller
// zeroes *amax before the launch. The FP8 scales' amax (fp8.cu, layernorm.cu).
__device__ __forceinline__ unsigned int umax(unsigned int a, unsigned int b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned int abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }
__device__ __forceinline__ void block_amax_atomic(float* amax, unsigned int m) {
  __shared__ unsigned int warp_max_bits[32];
  for (int o = 16; o > 0; o >>= 1) m = umax(m, __shfl_xor_sync(0xffffffffu, m, o));
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_max_bits[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < (int)(blockDim.x >> 5) ? warp_max_bits[lane] : 0u;
    for (int o = 16; o > 0; o >>= 1) m = umax(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), m);
  }
}

// ---------------------------------------------------------------- 16-byte vectors
// Elementwise kernels over long rows load 16 bytes per thread and instruction (CT_VEC elements);
// with 2-byte scalar loads they wait on memory latency, not bandwidth.
#define CT_VEC (16 / (int)sizeof(CT))  // elements of CT in one 16-byte vector
struct __align__(16) vec16 { unsigned int w[4]; };  // one 16-byte load (no CUDA headers here)
__device__ __forceinline__ float vget(const vec16& r, int i) { return to_f(((const CT*)&r)[i]); }
__device__ __forceinline__ void vset(vec16& r, int i, float f) { ((CT*)&r)[i] = from_f<CT>(f); }
__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

// The last step of the column-partial kernels (mlp.cu k_mlp_bwd_gelu_colsum, fp8.cu
// k_fp8_dgelu_colsum_amax): 256 threads as 8 row lanes of 32 lanes (tid = row_lane * 32 + lane),
// lane owning CT_VEC adjacent columns; a holds this thread's sums of them over its rows. They go
// into the shared acc (8 rows of STRIDE >= 32 * CT_VEC floats), then partial[blockIdx.y][c] = the
// sum of the 8 row lanes' in order, for the block's 32 * CT_VEC columns below C: k_colsum_partial's
// order, so every kernel that ends here gives the same bits as the two-pass column sums.
template <int STRIDE>
__device__ __forceinline__ void colsum_block_partials(float* partial, float (*acc)[STRIDE], const float* a,
                                                      int lane, int row_lane, int tid, int C) {
#pragma unroll
  for (int i = 0; i < CT_VEC; ++i) acc[row_lane][lane * CT_VEC + i] = a[i];
  __syncthreads();
  for (int j = tid; j < 32 * CT_VEC; j += 256) {
    int c = blockIdx.x * 32 * CT_VEC + j;
    if (c >= C) continue;
    float s = 0.f;
    for (int k = 0; k < 8; ++k) s += acc[k][j];
    partial[(i64)blockIdx.y * C + c] = s;
  }
}
