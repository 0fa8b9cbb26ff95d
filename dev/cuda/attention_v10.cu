// attention_v10.cu: version 10 of the backward's dQ kernel (the package's attention_hopper.cu,
// included, plus k_attn_flash_bwd_dq10 at the end). Version 7's backward is three launches:
// k_attn_flash_D (D = rowsum(dO * O) for every query row, a pass over dO and O of its own), then
// the dQ kernel, then the dK/dV kernel, both reading D. Here the dQ kernel computes D itself for
// its 128 query rows, while its first tiles are being copied, and writes it for the dK/dV kernel
// that follows on the same stream: one launch and one pass less, no new synchronisation.
//   Each thread owns two query rows of dQ (row0 + g and row0 + g + 8, as version 7); the four
//   lanes of a row each sum 16 of its HS = 64 columns of dO * O in fp32 (two 16-byte loads of dO
//   and two of O a row), then two butterfly shuffles add the four partial sums in a fixed order,
//   and lane 0 of the four writes D. Deterministic; a different order of additions than
//   k_attn_flash_D's, so D (and dQ, dK) may differ from version 7 in the last bits.
//   Arguments: version 7's, with out (B,T,C) after dout, and D written instead of read.
//
// Built for sm_90a (attention_v10.py: NVRTC, -DV6_SM90A); head size 64 (the load is written for
// 16 columns a lane); elsewhere the file is attention_hopper.cu.
//   nvcc -std=c++17 -arch=sm_90a --cubin -Xptxas -v -Iandrea/kernels -DCT=f16 -DHS=64 dev/cuda/attention_v10.cu

#include "attention_hopper.cu"

#if V7_WGMMA && HS == 64
// D of this thread's two rows (row0 + g + 8r, r = 0, 1) from dout and out (B,T,C) at batch b, head
// h; rows at or past T get 0. Lane t4 of a row sums columns [16 t4, 16 t4 + 16).
__device__ __forceinline__ void rows_D10(float* D, const HT* dout, const HT* out, i64 row_base, int row0, int T, int C) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int row = row0 + g + 8 * r;
    float d = 0.f;
    if (row < T) {
      const vec16* po = (const vec16*)(out + (row_base + row) * C + 16 * t4);
      const vec16* pd = (const vec16*)(dout + (row_base + row) * C + 16 * t4);
      vec16 o0 = po[0], o1 = po[1], d0 = pd[0], d1 = pd[1];
#pragma unroll
      for (int e = 0; e < 8; ++e) d += vget(d0, e) * vget(o0, e);
#pragma unroll
      for (int e = 0; e < 8; ++e) d += vget(d1, e) * vget(o1, e);
    }
    d += __shfl_xor_sync(0xffffffffu, d, 1);
    d += __shfl_xor_sync(0xffffffffu, d, 2);
    D[r] = d;
  }
}

// dQ part of dqkv += ... and D (B*NH, T): grid (B*NH, ceil(T/V7_QM)), block V7_DQ_THREADS, V7_DQ_SMEM
// bytes of dynamic shared memory (traps on anything else), as version 7's k_attn_flash_bwd_dq.
extern "C" __global__ void __launch_bounds__(V7_DQ_THREADS, V7_DQ_BLOCKS) k_attn_flash_bwd_dq10(HT* dqkv, const HT* qkv, const HT* dout,
                                                                              const HT* out, const float* lse, float* Dv,
                                                                              int B, int T, int NH, float scale,
                                                                              int accumulate) {
  extern __shared__ __align__(1024) u16 smem10[];
  u16* smem = smem10;
  require_smem(V7_DQ_SMEM);
  if (V7_SW && (smem_u32(smem) & 1023)) __trap();  // the swizzle is on address bits
  if (blockDim.x != V7_DQ_THREADS) __trap();
  u16* q_tile = smem;                       // [V7_QM x HS], stays for the whole block
  u16* do_tile = q_tile + V7_QM * HS;       // [V7_QM x HS], likewise
  u16* k_tiles = do_tile + V7_QM * HS;      // [2][V7_BN x HS]
  u16* v_tiles = k_tiles + 2 * V7_BN * HS;  // [2][V7_BN x HS]
  int C = NH * HS, ld = 3 * C, bh = blockIdx.x, b = bh / NH, h = bh % NH;
  int q0 = (gridDim.y - 1 - blockIdx.y) * V7_QM;  // the longest rows first
  int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  int wrow0 = q0 + 64 * wg;      // this warpgroup's first row
  int row0 = wrow0 + 16 * warp;  // this warp's first row
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  const HT* ob = dout + (i64)b * T * C + h * HS;
  int n_tiles = (min(q0 + V7_QM, T) - 1) / V7_BN + 1;  // causal: keys up to the block's last query
  load_tile7<V7_QM, V7_DQ_THREADS>(q_tile, qb, q0, T, ld);
  load_tile7<V7_QM, V7_DQ_THREADS>(do_tile, ob, q0, T, C);
  load_tile7<V7_BN, V7_DQ_THREADS>(k_tiles, kb, 0, T, ld);
  load_tile7<V7_BN, V7_DQ_THREADS>(v_tiles, vb, 0, T, ld);
  cp_commit();
  // D while the first tiles are copied
  float sl2 = scale * LOG2E, L2[2], D[2];
  rows_D10(D, dout + h * HS, out + h * HS, (i64)b * T, row0, T, C);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int row = row0 + g + 8 * r;
    L2[r] = row < T ? lse[(i64)bh * T + row] * LOG2E : 0.f;
    if (t4 == 0 && row < T) Dv[(i64)bh * T + row] = D[r];
  }
  u64 dqry = desc7_k(q_tile + 64 * wg * HS), ddo = desc7_k(do_tile + 64 * wg * HS);
  float dq[HS / 2];
#pragma unroll
  for (int i = 0; i < HS / 2; ++i) dq[i] = 0.f;
  for (int kt = 0; kt < n_tiles; ++kt) {
    int k0 = kt * V7_BN, nb = (kt + 1) & 1;
    pipeline_wait_async(kt + 1 < n_tiles, [&] {
      load_tile7<V7_BN, V7_DQ_THREADS>(k_tiles + nb * V7_BN * HS, kb, k0 + V7_BN, T, ld);
      load_tile7<V7_BN, V7_DQ_THREADS>(v_tiles + nb * V7_BN * HS, vb, k0 + V7_BN, T, ld);
    });
    const u16* K = k_tiles + (kt & 1) * V7_BN * HS;
    const u16* V = v_tiles + (kt & 1) * V7_BN * HS;
    // else every key of the tile is after the warpgroup's rows, or it has no row (uniform branch)
    if (k0 <= wrow0 + 63 && wrow0 < T) {
      if (k0 + V7_BN - 1 > wrow0 || k0 + V7_BN > T) dq7_tile<true>(dq, dqry, ddo, K, V, L2, D, row0, k0, T, sl2);
      else dq7_tile<false>(dq, dqry, ddo, K, V, L2, D, row0, k0, T, sl2);
    }
    __syncthreads();
  }
  store_rows(dqkv + (i64)b * T * ld + h * HS, ld, (const float(*)[4])dq, row0, T, scale, accumulate);
}
#endif
