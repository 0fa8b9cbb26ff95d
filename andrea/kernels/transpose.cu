// transpose.cu: k_transpose_many, the transposed copies of many matrices in one launch:
// out (K, R) = x (R, K)^T for every row (x address, out address, R, K) of an int64 table. The
// engine keeps such copies of the weights whose input-gradient products read W^T
// (CudaOps.transposed_min) and rewrites them once per optimizer step. Reference:
// numpy_ref.k_transpose, one matrix.
//
// 64 x 64 tiles through shared memory; blockIdx.y is the matrix, its gridDim.x blocks take its
// tiles in turn. Where R and K are multiples of 8 and both addresses 16-byte aligned (every
// weight of the models), a thread moves 8 elements at a time: 16-byte loads along x's rows, and
// along out's rows 8 values gathered from a tile column into one 16-byte store (two for float).
// Elsewhere (odd sizes) one element at a time. In the vector path the 8-element chunks of tile row
// i sit at chunk position (chunk ^ (i / 8 % 8)), so the 8 rows a warp gathers a column from at
// once fall in 8 different banks (fp16/bf16; a tile row is 32 banks wide). Any R, K >= 1.
#include "common.cuh"

#define TR_TILE 64
#define TR_VEC 8

struct alignas(16) TrPack { CT v[TR_VEC]; };

extern "C" __global__ void k_transpose_many(const i64* table) {
  __shared__ __align__(16) CT tile[TR_TILE][TR_TILE];
  const i64* e = table + (i64)blockIdx.y * 4;
  const CT* x = reinterpret_cast<const CT*>(e[0]);
  CT* out = reinterpret_cast<CT*>(e[1]);
  const i64 R = e[2], K = e[3];
  const bool vec = R % TR_VEC == 0 && K % TR_VEC == 0 && e[0] % 16 == 0 && e[1] % 16 == 0;
  const i64 tiles_k = (K + TR_TILE - 1) / TR_TILE, tiles = tiles_k * ((R + TR_TILE - 1) / TR_TILE);
  const int tid = threadIdx.x;
  for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
    const i64 r0 = (t / tiles_k) * TR_TILE, k0 = (t % tiles_k) * TR_TILE;
    __syncthreads();  // the previous tile is written out
    if (vec) {
      // load: tile row i, columns 8c..8c+7 = x[r0 + i, k0 + 8c ..]
      for (int p = tid; p < TR_TILE * (TR_TILE / TR_VEC); p += blockDim.x) {
        const int i = p / (TR_TILE / TR_VEC), c = p % (TR_TILE / TR_VEC);
        const i64 r = r0 + i, k = k0 + c * TR_VEC;
        if (r < R && k < K)
          *reinterpret_cast<TrPack*>(&tile[i][(c ^ ((i >> 3) & 7)) * TR_VEC]) =
              *reinterpret_cast<const TrPack*>(x + r * K + k);
      }
      __syncthreads();
      // store: out[k0 + j, r0 + 8c ..] = tile[8c .. 8c+7][j]
      for (int p = tid; p < TR_TILE * (TR_TILE / TR_VEC); p += blockDim.x) {
        const int j = p / (TR_TILE / TR_VEC), c = p % (TR_TILE / TR_VEC);
        const i64 k = k0 + j, r = r0 + c * TR_VEC;
        if (k < K && r < R) {
          TrPack v;
#pragma unroll
          for (int q = 0; q < TR_VEC; ++q) v.v[q] = tile[c * TR_VEC + q][(((j >> 3) ^ c) << 3) | (j & 7)];
          *reinterpret_cast<TrPack*>(out + k * R + r) = v;
        }
      }
    } else {
      for (int p = tid; p < TR_TILE * TR_TILE; p += blockDim.x) {
        const int i = p / TR_TILE, c = p % TR_TILE;
        const i64 r = r0 + i, k = k0 + c;
        if (r < R && k < K) tile[i][c] = x[r * K + k];
      }
      __syncthreads();
      for (int p = tid; p < TR_TILE * TR_TILE; p += blockDim.x) {
        const int j = p / TR_TILE, c = p % TR_TILE;
        const i64 k = k0 + j, r = r0 + c;
        if (k < K && r < R) out[k * R + r] = tile[c][j];
      }
    }
  }
}
