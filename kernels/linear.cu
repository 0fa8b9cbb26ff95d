// linear.cu: the kernels of the linear layers besides cuBLAS's products (andrea/backends/cuda/ops/
// _linear_fwd / _linear_bwd, used by k_attn_qkv_fwd/_bwd, k_attn_out_fwd/_bwd and k_mlp_fwd/_bwd when
// cuBLASLt's epilogues do not apply): the bias add after the forward product, and the column sums of
// every bias gradient (and of the layer norms' weight gradients), in two fixed-order passes; the
// second pass per sum (k_colsum_final) or for all the sums of a backward pass (k_colsum_final_many).
#include "common.cuh"

// x (N, OC) += b (OC,), in place: the bias of a cuBLAS product. Blocks stride over rows and
// threads over columns, so no 64-bit division per element.
extern "C" __global__ void k_bias_add(CT* x, const CT* b, i64 N, int OC) {
  pdl_wait();
  for (i64 r = blockIdx.x; r < N; r += gridDim.x) {
    CT* row = x + r * OC;
    for (int c = threadIdx.x; c < OC; c += blockDim.x) row[c] = from_f<CT>(to_f(row[c]) + to_f(b[c]));
  }
}

// Column sums of x (N, C) in two passes with no atomics: pass 1 writes partial[chunk][c] (block
// (32, 8): 32 columns, 8 row lanes, a fixed row chunk per blockIdx.y); pass 2 adds the chunks in
// order into out[c]. Used for every bias gradient.
extern "C" __global__ void k_colsum_partial(float* partial, const CT* x, i64 N, int C, int rows_per_chunk) {
  pdl_wait();
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

// k_colsum_partial for rows in whole 16-byte vectors (C a multiple of CT_VEC, x 16-byte aligned):
// block (32, 8), each thread CT_VEC adjacent columns loaded as one vector (a warp reads 512
// contiguous bytes of a row instead of 64), the same rows per thread (r0 + threadIdx.y, + 8, ...)
// and the same order of additions as k_colsum_partial, so the same bits.
extern "C" __global__ void k_colsum_partial_vec(float* partial, const CT* x, i64 N, int C, int rows_per_chunk) {
  pdl_wait();
  __shared__ float acc[8][32 * CT_VEC];
  int c0 = (blockIdx.x * 32 + threadIdx.x) * CT_VEC;
  i64 r0 = (i64)blockIdx.y * rows_per_chunk;
  i64 r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float a[CT_VEC];
#pragma unroll
  for (int j = 0; j < CT_VEC; ++j) a[j] = 0.f;
  if (c0 < C) {
#pragma unroll 4
    for (i64 r = r0 + threadIdx.y; r < r1; r += 8) {
      vec16 v = *(const vec16*)(x + r * C + c0);
#pragma unroll
      for (int j = 0; j < CT_VEC; ++j) a[j] += vget(v, j);
    }
  }
#pragma unroll
  for (int j = 0; j < CT_VEC; ++j) acc[threadIdx.y][threadIdx.x * CT_VEC + j] = a[j];
  __syncthreads();
  int t = threadIdx.y * 32 + threadIdx.x, c = blockIdx.x * 32 * CT_VEC + t;
  for (; t < 32 * CT_VEC; t += 256, c += 256)
    if (c < C) {
      float s = 0.f;
      for (int k = 0; k < 8; ++k) s += acc[k][t];
      partial[(i64)blockIdx.y * C + c] = s;
    }
}

// out[c] += sum over chunks of partial[chunk][c] (write != 0: out[c] = the sum, out not read: the
// first contribution to a gradient in a pass that starts it), by one warp: lane j adds chunks j,
// j+32, ... in order, then the fixed shuffle tree. The one code of both final kernels below, so
// they give the same bits.
__device__ __forceinline__ void colsum_column(float* out, const float* partial, int n_chunks, int C, int c,
                                              int lane, int write) {
  float s = 0.f;
  for (int k = lane; k < n_chunks; k += 32) s += partial[(i64)k * C + c];
  s = warp_sum(s);
  if (lane == 0) out[c] = write ? s : out[c] + s;
}

// One warp per column (8 columns a block of 256). out is float32 (a grad).
extern "C" __global__ void k_colsum_final(float* out, const float* partial, int n_chunks, int C, int write) {
  pdl_wait();
  int c = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c < C) colsum_column(out, partial, n_chunks, C, c, threadIdx.x & 31, write);
}

// One column sum of k_colsum_final_many, and the first block of the launch that is its own.
struct ColsumSegment {
  float* out;
  const float* partial;
  int n_chunks, C, first_block, write;  // write: as colsum_column's
};

// colsum_column's sum by one thread: lane j's running sum (chunks j, j + 32, ... in order) is
// s[j], then the shuffle tree of warp_sum as lane 0 sees it (at step o, s[j] += s[j + o] for
// j < o; a + b == b + a exactly), so the bits are colsum_column's. The thread's loads are the
// column's chunks; a warp's 32 threads take 32 adjacent columns, so each load of the warp is 128
// contiguous bytes (colsum_column's lanes read 32 different rows).
__device__ __forceinline__ void colsum_column_thread(float* out, const float* partial, int n_chunks, int C,
                                                     int c, int write) {
  float s[32];
#pragma unroll
  for (int j = 0; j < 32; ++j) s[j] = 0.f;
  for (int k0 = 0; k0 < n_chunks; k0 += 32) {
#pragma unroll
    for (int j = 0; j < 32; ++j)
      if (k0 + j < n_chunks) s[j] += partial[(i64)(k0 + j) * C + c];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int j = 0; j < o; ++j) s[j] += s[j + o];
  out[c] = write ? s[0] : out[c] + s[0];
}

// Every column sum a backward pass deferred to its end (andrea/backends/cuda/colsum.py), in one
// launch: block b takes the segment with the last first_block <= b (segments in block order),
// and each of its threads one column (blockDim.x columns a block), summed in k_colsum_final's
// order (colsum_column_thread). Each segment adds into a gradient no other segment of the
// launch touches (the launcher flushes before a second sum into the same one). Version 1 (in
// git history) took a warp per column as k_colsum_final does: 89 us for the 120M pass's sums
// on an H200, its lanes' loads 32 rows apart.
extern "C" __global__ void k_colsum_final_many(const ColsumSegment* __restrict__ segs, int n_segs) {
  pdl_wait();
  int lo = 0, hi = n_segs - 1, b = blockIdx.x;
  while (lo < hi) {  // binary search: the last segment starting at or before this block
    int mid = (lo + hi + 1) >> 1;
    if (segs[mid].first_block <= b) lo = mid; else hi = mid - 1;
  }
  const ColsumSegment& s = segs[lo];
  int c = (b - s.first_block) * blockDim.x + threadIdx.x;
  if (c < s.C) colsum_column_thread(s.out, s.partial, s.n_chunks, s.C, c, s.write);
}
