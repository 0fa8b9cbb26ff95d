// attention_v6.cu: kernels/attention.cu (version 4, included below) with a Hopper forward. On
// compute capability 9.0, k_attn_flash_fwd computes S = Q K^T and O += P V with wgmma.mma_async (built
// for sm_90a by attention_v6.py, the launch that goes with it); everywhere else, and for every other
// kernel (version 1, k_attn_flash_D, version 4's backward), this is the package's code itself.
// Design, and what is and is not done: "version 6" further down. Status: superseded by version 8
// (the forward of kernels/attention_hopper.cu, on the same building blocks of kernels/wgmma.cuh);
// measured on an H200 at 0.85 ms a step's forward at 120M (docs/BENCHMARKS.md).
// Kept because wgmma_probe.cu builds on its functions (the first check of those building blocks on
// a new GPU or toolkit) and attention_bench.py's v6 entry times it. Built by nvcc 13 for sm_90a,
// fp16 and bf16, every head size: 127-128 registers, no spills; 20-96 KB of dynamic shared memory.
// The steps below run it (the probes, the harness, the bench).
//
// How to run it (an H200; repository root, package importable; minutes in all):
//   1. python dev/cuda/wgmma_probe.py
//      Expect "all probes passed": build, layout, ss, rs and pipeline for fp16/bf16 x hs 64/80/128.
//      A FAIL names the block: layout -> load_tile6; ss or rs -> the descriptors (the line says
//      whether exchanging LBO and SBO fixes it) or the fragment order; pipeline -> the proxy fence
//      or the barriers. Fix there before step 2: the forward is built from the same functions.
//   2. python dev/cuda/harness.py attention main v6 --dtype fp16,bf16
//      Expect every row ok. The k_attn_fwd row at B3 T130 C128 NH2 is the wgmma path (hs 64: two
//      query blocks, a partial key tile; stderr says "compiled for sm_90a"); the other rows run
//      version 1/4 code from this file and must match main. Timing is one call (one layer) at the
//      120M shape: main's forward is about 0.07 ms (0.84-0.89 ms for 12 layers); cuDNN's is 0.56 / 12
//      = 0.047 ms. This first version (cp.async, no TMA, no warp specialisation) should land between.
//   3. python dev/cuda/attention_bench.py --variants v4,v6 --out $OUT
//      Checks T = 77 and 1000, hs 32/64/80/128, fp16/bf16, two runs bit-identical, then forward and
//      backward times x layers at the 12M and 120M shapes next to SDPA flash/cuDNN/efficient in the
//      same process (v6's backward is v4's: only fwd_ms should move).
//   All three in one go, logs under $OUT (no package install needed, only PYTHONPATH):
//      export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; python3 dev/cuda/wgmma_probe.py 2>&1 | tee $OUT/probe.log;
//      python3 dev/cuda/harness.py attention main v6 --dtype fp16,bf16 2>&1 | tee $OUT/harness.log;
//      python3 dev/cuda/attention_bench.py --variants v4,v6 --out $OUT 2>&1 | tee $OUT/bench.log
//   If the probes fail, steps 2 and 3 will too: stop there and fix the block they name.
//   ptxas figures: nvcc -std=c++17 -arch=sm_90a --cubin -Xptxas -v -Ikernels -DCT=f16
//      -DV6_SM90A -DHS=64 dev/cuda/attention_v6.cu -o /tmp/v6.cubin
//

// Where wgmma is compiled in, version 4's forward is renamed out of the way and version 6 takes its
// name (end of file); elsewhere the package's kernel is k_attn_flash_fwd, with version 4's launch.
#if defined(__CUDA_ARCH__) && (defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(V6_SM90A))
#define V6_WGMMA 1
#else
#define V6_WGMMA 0
#endif
#define V6_WG 2                                // warpgroups per block
#define V6_BM (64 * V6_WG)                     // query rows per block
#define V6_BN (HS <= 64 ? 128 : 64)            // keys per tile
#define V6_THREADS (128 * V6_WG)
#define V6_SMEM ((V6_BM + 4 * V6_BN) * HS * 2)  // Q, then K and V two deep (attention_v6.py asks the same)
#if V6_WGMMA
#define k_attn_flash_fwd k_attn_flash_fwd_v4
#endif
#include "attention.cu"
#if V6_WGMMA
#undef k_attn_flash_fwd
#endif

// Compiled for sm_90a (the launcher in attention_v6.py asks NVRTC for it, with -DV6_SM90A in case
// the compiler does not define __CUDA_ARCH_FEAT_SM90_ALL), k_attn_flash_fwd takes
// S = Q K^T and O += P V through wgmma.mma_async; built for any other target (sm_80, plain sm_90,
// the float build) it is version 4's forward above, with version 4's launch.
//
// Block: V6_WG = 2 warpgroups of 128 threads, 64 query rows each (V6_BM = 128 rows a block);
// keys in tiles of V6_BN (128 when HS <= 64, else 64). All 256 threads stage Q once and K/V two
// deep with cp.async (16 bytes a copy, rows past T zero-filled), then each warpgroup, alone:
//   S (64 x BN, fp32)  = wgmma m64nBNk16, HS/16 steps, A = Q and B = K from shared memory;
//   online softmax in fp32 on S's registers (exp2, log2(e) folded into the scale, as version 4);
//   O (64 x HS, fp32) += wgmma m64nHSk16, BN/16 steps, A = P from registers (S's accumulator
//   layout is the A-operand layout: rounded to 16 bits in place), B = V from shared memory read
//   MN-major (the transpose flag), so V needs no transposed copy.
//
// Shared-memory tiles, no swizzle: a tile of R rows x HS columns is stored as 8 x 8 "core
// matrices" (8 rows x 16 bytes, 128 contiguous bytes). Element (r, c) sits at 16-bit offset
//   (r / 8) * 8 * HS + (c / 8) * 64 + (r % 8) * 8 + c % 8
// i.e. core matrices 128 bytes apart along the columns and 8 * HS * 2 bytes apart along the rows.
// One layout serves every operand: the K-major A (Q) and B (K) of Q K^T take LBO = 128 (along
// HS, the K dimension) and SBO = 16 * HS (along rows); the MN-major B (V) of P V takes
// LBO = 16 * HS (along keys, its K dimension) and SBO = 128 (along HS, its N dimension). Each
// k16 step moves the start address: 256 bytes in Q K^T, 2 row groups in P V. Each core matrix is
// 128 contiguous bytes (the 32 banks once), so wgmma's reads should not conflict (to be confirmed
// with ncu); the swizzled layouts serve writers of whole rows such as TMA, not used here. The
// cp.async stores of a warp are 512 contiguous bytes (thread i stores the i-th 16 bytes of the tile).
//
// Matrix descriptor (PTX ISA, "matrix descriptor format" of wgmma): bits 0-13 start address >> 4,
// 16-29 LBO >> 4, 32-45 SBO >> 4, 49-51 base offset (0), 62-63 swizzle (0: none).
// Accumulator fragment of m64nN (fp32), thread = 128 * wg + 32 * warp + 4 * g + t4: d[4 * j + e]
// holds row 16 * warp + g + 8 * (e >> 1), column 8 * j + 2 * t4 + (e & 1) -- version 4's
// mma.sync C layout, one m16 slab per warp. The A-from-registers fragment of m64k16 (16-bit):
// a[0..3] = rows g / g+8, columns 2t4 / 8+2t4, as mma.sync's A.
// Ordering: after its copies land, every thread runs fence.proxy.async (wgmma reads shared memory
// through the async proxy), then the block barrier; wgmma.fence before each batch of products,
// commit + wait_group 0 after it, and an empty asm over the accumulators so that the compiler
// reads them only after the wait.
//
// Done: fp16 and bf16, every head size of FLASH_HEAD_SIZES (multiples of 16 up to 128), causal,
// any T (rows and keys past T masked or zero-filled), lse as version 4 writes it (the backward
// here, version 4's, reads it), deterministic (fixed order everywhere, no atomics).
// Not done: TMA (cp.async.bulk.tensor) loads, mbarrier producer/consumer warp specialisation and
// setmaxnreg, overlapping the softmax of one warpgroup with the other's products (FlashAttention-3's
// "ping-pong"), swizzled layouts, an intra-warpgroup pipeline of S(j+1) against softmax(j), and
// any change to the backward. Each is a later step once this one is checked on the GPU.

// tiles, descriptors, wgmma and the pipeline step (kernels/wgmma.cuh)
#include "wgmma.cuh"

#if V6_WGMMA
// ---------------------------------------------------------------- version 6 products (sm_90a)

// s (this warpgroup's 64 x V6_BN scores, accumulator layout) = A B^T over HS: dq describes the
// warpgroup's 64 rows of Q, dk a K tile (both K-major). Returns once the products are done.
__device__ __forceinline__ void scores_wgmma(float* s, u64 dq, u64 dk) {
  fence_regs<V6_BN / 2>(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk)  // 256 bytes (two core matrices along HS) a step
    Wg<V6_BN, is_bf16<HT>::v, 0>::ss(s, dq + (u64)(kk * 16), dk + (u64)(kk * 16), kk);
  wgmma_commit();
  wgmma_wait_all();
  fence_regs<V6_BN / 2>(s);
}

// P's A fragments (16-bit, rounded here) from the accumulator layout of s: k16 block kc holds
// columns 16 kc .. 16 kc + 15, i.e. accumulator entries 8 kc .. 8 kc + 7.
__device__ __forceinline__ void p_frags(unsigned (*p)[4], const float* s) {
#pragma unroll
  for (int kc = 0; kc < V6_BN / 16; ++kc) {
    p[kc][0] = pack2(s[8 * kc + 0], s[8 * kc + 1]);
    p[kc][1] = pack2(s[8 * kc + 2], s[8 * kc + 3]);
    p[kc][2] = pack2(s[8 * kc + 4], s[8 * kc + 5]);
    p[kc][3] = pack2(s[8 * kc + 6], s[8 * kc + 7]);
  }
}

// o (64 x HS, accumulator layout) += P V: p from p_frags, dv describes a V tile (MN-major).
__device__ __forceinline__ void pv_wgmma(float* o, const unsigned (*p)[4], u64 dv) {
  fence_regs<HS / 2>(o);
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < V6_BN / 16; ++kc)  // two row groups of V (16 keys) a step
    Wg<HS, is_bf16<HT>::v, 1>::rs(o, p[kc], dv + (u64)(kc * 2 * CM_ROW_BYTES / 16), 1);
  wgmma_commit();
  wgmma_wait_all();
  fence_regs<HS / 2>(o);
}

// One forward tile of one warpgroup: scores of its 64 rows (this thread: rows row0 + g and
// row0 + g + 8) against keys [k0, k0 + V6_BN), online softmax, O += P V.
template <bool MASK>
__device__ __forceinline__ void fwd6_tile(float* o, float* m, float* l, u64 dq, const u16* K, const u16* V,
                                          int row0, int k0, int T, float sl2) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float s[V6_BN / 2];
  scores_wgmma(s, dq, desc_kmajor(K));
  float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
  for (int j = 0; j < V6_BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (MASK) {
        int key = k0 + j * 8 + 2 * t4 + (e & 1), row = row0 + g + 8 * (e >> 1);
        if (key > row || key >= T) s[4 * j + e] = NEG_INF;
      }
      tmax[e >> 1] = fmaxf(tmax[e >> 1], s[4 * j + e]);
    }
  float alpha[2], ms[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // the 4 lanes of a group hold one row between them
    tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
    tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
    float mn = fmaxf(m[r], tmax[r]);
    ms[r] = mn == NEG_INF ? 0.f : mn * sl2;  // a row with no key yet keeps exp2(-inf) = 0
    alpha[r] = fast_exp2(m[r] * sl2 - ms[r]);
    m[r] = mn;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int j = 0; j < V6_BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = fast_exp2(fmaf(s[4 * j + e], sl2, -ms[e >> 1]));
      s[4 * j + e] = p;
      l[e >> 1] += p;
    }
#pragma unroll
  for (int j = 0; j < HS / 8; ++j) {
    o[4 * j] *= alpha[0]; o[4 * j + 1] *= alpha[0]; o[4 * j + 2] *= alpha[1]; o[4 * j + 3] *= alpha[1];
  }
  unsigned p[V6_BN / 16][4];
  p_frags(p, s);
  pv_wgmma(o, p, desc_mnmajor(V));
}

// Version 6's forward. grid (B*NH, ceil(T/V6_BM)), block V6_THREADS, V6_SMEM bytes of dynamic
// shared memory (traps on anything else).
__device__ __forceinline__ void fwd_v6(u16* smem, HT* out, float* lse, const HT* qkv, int B, int T, int NH,
                                       float scale) {
  require_smem(V6_SMEM);
  if (blockDim.x != V6_THREADS) __trap();
  u16* q_tile = smem;                       // [V6_BM x HS], stays for the whole block
  u16* k_tiles = q_tile + V6_BM * HS;       // [2][V6_BN x HS]
  u16* v_tiles = k_tiles + 2 * V6_BN * HS;  // [2][V6_BN x HS]
  int C = NH * HS, ld = 3 * C, bh = blockIdx.x, b = bh / NH, h = bh % NH;
  int q0 = (gridDim.y - 1 - blockIdx.y) * V6_BM;  // the longest rows first
  int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  int wrow0 = q0 + 64 * wg;     // this warpgroup's first row
  int row0 = wrow0 + 16 * warp;  // this warp's first row
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  float sl2 = scale * LOG2E;
  int n_tiles = (min(q0 + V6_BM, T) - 1) / V6_BN + 1;  // causal: keys up to the block's last query
  load_tile6<V6_BM>(q_tile, qb, q0, T, ld);
  load_tile6<V6_BN>(k_tiles, kb, 0, T, ld);
  load_tile6<V6_BN>(v_tiles, vb, 0, T, ld);
  cp_commit();
  u64 dq = desc_kmajor(q_tile + 64 * wg * HS);  // 64 rows = 8 row groups of 8 * HS elements
  float o[HS / 2], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < HS / 2; ++i) o[i] = 0.f;
  for (int kt = 0; kt < n_tiles; ++kt) {
    int k0 = kt * V6_BN, nb = (kt + 1) & 1;
    pipeline_wait_async(kt + 1 < n_tiles, [&] {
      load_tile6<V6_BN>(k_tiles + nb * V6_BN * HS, kb, k0 + V6_BN, T, ld);
      load_tile6<V6_BN>(v_tiles + nb * V6_BN * HS, vb, k0 + V6_BN, T, ld);
    });
    const u16* K = k_tiles + (kt & 1) * V6_BN * HS;
    const u16* V = v_tiles + (kt & 1) * V6_BN * HS;
    if (k0 <= wrow0 + 63) {  // else every key of the tile is after the warpgroup's rows (uniform branch)
      if (k0 + V6_BN - 1 > wrow0 || k0 + V6_BN > T) fwd6_tile<true>(o, m, l, dq, K, V, row0, k0, T, sl2);
      else fwd6_tile<false>(o, m, l, dq, K, V, row0, k0, T, sl2);
    }
    __syncthreads();
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = 1.f / l[r];
    int row = row0 + g + 8 * r;
    if (t4 == 0 && row < T) lse[(i64)bh * T + row] = m[r] * scale + logf(l[r]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int row = row0 + g + 8 * r;
    if (row >= T) continue;
    unsigned* p = (unsigned*)(out + ((i64)b * T + row) * C + h * HS + 2 * t4);
#pragma unroll
    for (int j = 0; j < HS / 8; ++j) p[j * 4] = pack2(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
  }
}
#endif  // V6_WGMMA

#if V6_WGMMA
// out (B,T,C) and lse (B*NH, T) from qkv (B,T,3C): version 6, grid (B*NH, ceil(T/V6_BM)), block
// V6_THREADS, V6_SMEM bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(V6_THREADS) k_attn_flash_fwd(HT* out, float* lse, const HT* qkv,
                                                                          int B, int T, int NH, float scale) {
  extern __shared__ __align__(16) u16 smem[];
  fwd_v6(smem, out, lse, qkv, B, T, NH, scale);
}
#endif
