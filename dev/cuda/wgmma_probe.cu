// wgmma_probe.cu: the smallest kernels that exercise each Hopper building block attention_v6.cu's
// forward relies on, through the very functions it uses (this file includes it). Run by
// wgmma_probe.py (`python dev/cuda/wgmma_probe.py` on an sm_90 GPU), which checks each against
// NumPy. Every probe is one block of one warpgroup (128 threads); compile for sm_90a (the
// wgmma probes trap elsewhere; probe_layout runs on sm_80 and later).
//   probe_layout   (c) load_tile6: cp.async of 64 rows x HS from a strided slice (rows past T
//                  zero-filled) into the core-matrix layout; the tile is dumped as stored.
//   probe_ss       (a) scores_wgmma: S (64 x V6_BN) = A B^T, A and B K-major from shared memory
//                  through desc_kmajor, fp32 accumulators written out in their fragment layout.
//   probe_rs       (b) p_frags + pv_wgmma: O (64 x HS) = P V, P from registers (built from an
//                  accumulator-layout array, as the forward builds it), V MN-major through
//                  desc_mnmajor.
//   probe_pipeline (c) version 6's two-deep cp.async pipeline (pipeline_wait_async, proxy fence,
//                  barrier): the sum over key tiles of A B_t^T, T not a multiple of the tile.
// swap = 1 builds the descriptors with LBO and SBO exchanged: wgmma_probe.py tries it when a
// product fails, so a wrong convention is named at once.
#include "attention_v6.cu"

// d[row * ld + col] = acc, acc in the accumulator layout of an m64nN product of this warpgroup.
template <int N>
__device__ __forceinline__ void store_acc(float* d, const float* acc, int ld) {
  int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) d[(16 * warp + g + 8 * (e >> 1)) * ld + 8 * j + 2 * t4 + (e & 1)] = acc[4 * j + e];
}

// dump (64 * HS 16-bit words, the tile as stored) <- rows [r0, r0 + 64) of src (row stride ld).
// Dynamic shared memory: 64 * HS * 2 bytes.
extern "C" __global__ void probe_layout(u16* dump, const HT* src, int r0, int T, int ld) {
  extern __shared__ __align__(16) u16 smem[];
  load_tile6<64>(smem, src, r0, T, ld);
  cp_commit();
  cp_wait_all();
  __syncthreads();
  for (int i = threadIdx.x; i < 64 * HS; i += blockDim.x) dump[i] = smem[i];
}

// d (64 x V6_BN fp32) = a (64 x HS) @ b (V6_BN x HS)^T, both row-major 16-bit.
// Dynamic shared memory: (64 + V6_BN) * HS * 2 bytes.
extern "C" __global__ void probe_ss(float* d, const HT* a, const HT* b, int swap) {
#if V6_WGMMA
  extern __shared__ __align__(16) u16 smem[];
  u16* sa = smem;
  u16* sb = smem + 64 * HS;
  load_tile6<64>(sa, a, 0, 64, HS);
  load_tile6<V6_BN>(sb, b, 0, V6_BN, HS);
  cp_commit();
  cp_wait_all();
  fence_proxy_async();
  __syncthreads();
  u64 da = swap ? make_desc(sa, CM_ROW_BYTES, CM_COL_BYTES) : desc_kmajor(sa);
  u64 db = swap ? make_desc(sb, CM_ROW_BYTES, CM_COL_BYTES) : desc_kmajor(sb);
  float s[V6_BN / 2];
  scores_wgmma(s, da, db);
  store_acc<V6_BN>(d, s, V6_BN);
#else
  __trap();
#endif
}

// d (64 x HS fp32) = round16(p) (64 x V6_BN, fp32 values) @ v (V6_BN x HS, row-major 16-bit).
// Dynamic shared memory: V6_BN * HS * 2 bytes.
extern "C" __global__ void probe_rs(float* d, const float* p, const HT* v, int swap) {
#if V6_WGMMA
  extern __shared__ __align__(16) u16 smem[];
  int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  load_tile6<V6_BN>(smem, v, 0, V6_BN, HS);
  cp_commit();
  float s[V6_BN / 2], o[HS / 2];
#pragma unroll
  for (int j = 0; j < V6_BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * j + e] = p[(16 * warp + g + 8 * (e >> 1)) * V6_BN + 8 * j + 2 * t4 + (e & 1)];
#pragma unroll
  for (int i = 0; i < HS / 2; ++i) o[i] = 0.f;
  unsigned pf[V6_BN / 16][4];
  p_frags(pf, s);
  cp_wait_all();
  fence_proxy_async();
  __syncthreads();
  pv_wgmma(o, pf, swap ? make_desc(smem, CM_COL_BYTES, CM_ROW_BYTES) : desc_mnmajor(smem));
  store_acc<HS>(d, o, HS);
#else
  __trap();
#endif
}

// d (64 x V6_BN fp32) = sum over key tiles t of a (64 x HS) @ b_t^T, b_t = rows [t V6_BN, (t+1) V6_BN)
// of b (T x HS, row-major; rows past T count as zero), streamed two deep as the forward streams K.
// Dynamic shared memory: (64 + 2 * V6_BN) * HS * 2 bytes.
extern "C" __global__ void probe_pipeline(float* d, const HT* a, const HT* b, int T) {
#if V6_WGMMA
  extern __shared__ __align__(16) u16 smem[];
  u16* sa = smem;
  u16* tiles = smem + 64 * HS;
  int n_tiles = (T - 1) / V6_BN + 1;
  load_tile6<64>(sa, a, 0, 64, HS);
  load_tile6<V6_BN>(tiles, b, 0, T, HS);
  cp_commit();
  float s[V6_BN / 2], tot[V6_BN / 2];
#pragma unroll
  for (int i = 0; i < V6_BN / 2; ++i) tot[i] = 0.f;
  for (int kt = 0; kt < n_tiles; ++kt) {
    int nb = (kt + 1) & 1;
    pipeline_wait_async(kt + 1 < n_tiles, [&] { load_tile6<V6_BN>(tiles + nb * V6_BN * HS, b, (kt + 1) * V6_BN, T, HS); });
    scores_wgmma(s, desc_kmajor(sa), desc_kmajor(tiles + (kt & 1) * V6_BN * HS));
#pragma unroll
    for (int i = 0; i < V6_BN / 2; ++i) tot[i] += s[i];
    __syncthreads();
  }
  store_acc<V6_BN>(d, tot, V6_BN);
#else
  __trap();
#endif
}

// flag[0] = 1 where this build has version 6's wgmma code (V6_WGMMA), else 0.
extern "C" __global__ void probe_has_wgmma(int* flag) { flag[0] = V6_WGMMA; }
