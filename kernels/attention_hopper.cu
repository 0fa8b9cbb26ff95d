// attention_hopper.cu: attention on Hopper's wgmma, the forward (version 8) and the backward (versions
// 10 and 7). Built for sm_90a (ops/attention.py launches it on compute capability 9.0 through the Runtime's
// arch="sm_90a" build, since CuPy's own build targets plain sm_90, where wgmma does not exist),
// k_attn_flash_fwd, k_attn_flash_bwd_dq and k_attn_flash_bwd_dkv take every product through
// wgmma.mma_async. The file includes attention.cu: there, version 4's three kernels are renamed out
// of the way, and everything else (k_attn_flash_D, which version 4's backward reads, version 1) is
// attention.cu's code. Built for any other target (nvcc's sm_80/sm_90 in the tests, the float
// build) it is attention.cu itself. Same outputs and semantics as version 4's kernels:
// the forward writes out (B,T,C) and lse (B*NH, T) from qkv (B,T,3C); the backward dqkv (B,T,3C)
// += [dQ | dK | dV] (accumulate = 0: written, not read), P recomputed from Q, K and the lse the
// forward saved, the softmax scale applied to dQ and dK once at the end; no atomics: the same
// inputs give the same bits. One difference in the arguments: version 4's backward reads D =
// rowsum(dO * O) from k_attn_flash_D; here k_attn_flash_bwd_dq takes out as well and computes D
// (and writes it), and k_attn_flash_bwd_dkv, launched after it, reads it: two launches, not three.
//
// Forward (version 8; section "forward" at the end of the file): one block of V8_WG = 2 warpgroups
// of 64 query rows (128 rows) per head and query tile, the longest rows launched first; keys in
// tiles of V8_BN = 64, K and V staged V8_STAGES = 3 deep by cp.async, tiles copied two steps ahead
// of the one computed (one barrier a step). Per warpgroup and key tile:
//     S (64 x 64) = Q K^T            ss, A = Q, B = K (K-major both)
//     online softmax on S's registers in fp32 (exp2, log2 e folded into the scale, as version 4)
//     O (64 x HS) += P V              rs, P from registers (S's accumulator layout rounded to 16
//                                     bits is the A layout), V MN-major (the transpose flag)
//   Only tiles that cross a warpgroup's diagonal or the end of the sequence are masked; a
//   warpgroup skips the tiles after its last row. 128 registers a thread: two blocks (16 warps)
//   a multiprocessor up to head size 64, which is what made it faster than version 4 (one block
//   of three warpgroups and 128-key tiles, 154 registers, was not: below).
//   ptxas (nvcc 13.0, sm_90a): k_attn_flash_fwd 127 registers at head size 64 (96-128 at the
//   others), no spills; 64 KB of shared memory at head size 64.
//
// Backward (dQ: version 10, dK/dV: version 7). Head sizes: every multiple of 16 up to 128
// (ops.FLASH_HEAD_SIZES); 128-byte swizzled tiles at head size 64, the core-matrix layout of
// wgmma.cuh elsewhere.
//   ptxas (nvcc 13.0, sm_90a, CT=f16, HS=64): k_attn_flash_bwd_dkv 167 registers, one warpgroup a
//   block and three blocks a multiprocessor (__launch_bounds__(128, 3)), 32 bytes spilled and its
//   wgmma serialised by ptxas (below: measured, the fastest setting anyway); k_attn_flash_bwd_dq
//   122 registers (__launch_bounds__(256, 2)), two blocks; elsewhere no spills and no wgmma
//   serialised (tests/test_hopper_compile.py checks both at every head size and holds the one
//   exception to its 32 bytes). nvcc -std=c++17 -arch=sm_90a --cubin -Xptxas -v -Ikernels
//   -DCT=f16 -DHS=64 kernels/attention_hopper.cu
//
// Design (every product is one of version 6's two forms, so wgmma_probe.py's ss and rs probes cover
// the layouts used here: A and B K-major from shared memory; A from registers, B MN-major):
//   k_attn_flash_bwd_dkv: one block per V7_BK = 64 * V7_KWG keys of one head, V7_KWG warpgroups of
//   64 keys (1 at head size 64, so that the three warpgroups of a multiprocessor wait at no common
//   barrier; 2 elsewhere).
//   K and V stay in shared memory; query tiles of V7_BQ rows (64 up to head size 64, else 32) and
//   their lse and D are streamed two deep with cp.async. Per warpgroup and query tile:
//     S^T  (64 x BQ) = K Q^T            ss, A = K, B = Q      (HS/16 k-steps)
//     dP^T (64 x BQ) = V dO^T           ss, A = V, B = dO     (same group as S^T: one wait)
//     P^T = exp2(S^T * scale * log2e - lse * log2e), 0 where query < key or query >= T
//     dS^T = P^T * (dP^T - D)           (the scale comes at the end, as version 4)
//     dV (64 x HS) += P^T dO            rs, P^T from registers, dO MN-major (transpose flag)
//     dK (64 x HS) += dS^T Q            rs, dS^T from registers, Q MN-major (same group as dV)
//   Inside a warpgroup (V7_OVERLAP, the default): S^T and dP^T are two commit groups, so P^T's
//   exponentials run while dP^T is still being computed; dV's product is issued as soon as P^T is
//   in registers and runs while dS^T is formed (wgmma.wait_group 1). Across warpgroups the other
//   warpgroup's products overlap this one's arithmetic.
//   A warpgroup skips a query tile entirely before its keys; only tiles that cross its diagonal or
//   the end of the sequence are masked. The first keys see the most queries: they launch first.
//   k_attn_flash_bwd_dq: one block per V7_QM = 128 query rows of one head, two warpgroups of 64
//   rows. Each thread first computes D for its two rows from dO and O (rows_D: the four lanes of a
//   row take 16-byte chunks in turn, then two shuffles add their sums) while the block's first
//   tiles are being copied, and writes it for k_attn_flash_bwd_dkv. Q and dO stay in shared
//   memory; key tiles of V7_BN = 64 (K and V) streamed two deep:
//     S (64 x BN) = Q K^T, dP (64 x BN) = dO V^T   ss, one group
//     dS = P * (dP - D)
//     dQ (64 x HS) += dS K              rs, dS from registers, K MN-major
//   P's exponentials run while dP is computed (V7_OVERLAP). The longest rows launch first.
//   Accumulator fragments are mma.sync's C layout per warp (wgmma.cuh): dK, dV and dQ are
//   added into (or written to) dqkv by version 4's store_rows.
// Deterministic: fixed order everywhere, each output element owned by one thread.
//
// Shared-memory tiles: at head size 64, 128-byte swizzled rows (load_tile7, V7_SWIZZLE = 1, the
// layout TMA and CUTLASS use); other head sizes, or -DV7_SWIZZLE=0, version 6's core-matrix layout
// (no swizzle). The swizzle alone took the backward from 2.75 to 2.30 ms (below).
// Not done: TMA loads and mbarrier producer/consumer warp specialisation (a producer warpgroup with
// setmaxnreg), keeping the NEXT tile's products in flight across the block barrier (each tile ends
// with every product waited for), swizzled tiles at head sizes other than 64 (64- or 32-byte
// swizzle, or two 128-byte atoms), one fused kernel for dQ and dK/dV (it needs atomics or an
// ordered reduction for dQ), and the 12M-shape tuning (T = 256 gives only 2 key blocks a head).
//
// Measured, the backward (H200, nvcc 13.0 / NVRTC, attention_bench.py: each call between CUDA events, times the
// model's layers, all variants and SDPA in one process; ms for 12 / 6 layers). This version:
//   120M (B=8, NH=12, T=1024)      fp16: bwd   D      dQ     dK/dV   fwd  | bf16: bwd   dQ     dK/dV
//     version 4                          2.938 0.144  1.101  1.659   0.840 |       2.925 1.104  1.652
//     version 7 (swizzled tiles)         2.301 0.117  0.758  1.396   0.850 |       2.314 0.764  1.410
//     SDPA cuDNN                         2.791                       0.608 |       2.949
//     SDPA flash                         3.440                       0.938 |       3.357
//   12M (B=32, NH=6, T=256)        fp16: version 4 0.395 (dQ 0.127, dK/dV 0.192); version 7 0.357
//     (0.109, 0.179); SDPA cuDNN 0.866, flash 1.170. bf16: 0.395 against 0.357.
//   harness.py attention main v7, one layer at 120M: k_attn_bwd 0.2398 -> 0.1888 ms (fp16, x1.27),
//   0.2378 -> 0.1891 (bf16); the forward (version 6's) 0.0697 -> 0.0707.
//   Settings tried (fp16, 120M backward; an earlier run, where cuDNN read 2.447 and version 4 2.937):
//     version 6's core-matrix tiles      2.754 (dQ 0.968, dK/dV 1.612): the swizzle gains 16 %
//     no overlap (V7_OVERLAP=0)          2.776 against 2.754 with it: about 1 %
//     32 queries a dK/dV tile            3.086 (dK/dV 1.951)
//     three warpgroups a dK/dV block, 32 queries a tile: 2.825; swizzled 2.435 (dK/dV 1.533)
//     128 keys a dQ tile                 3.036 (dQ 1.259)
//   and in the run above: 48 queries a dK/dV tile 2.536 (dK/dV 1.629); three warpgroups with 48 queries
//     2.314 (1.407): no gain over two warpgroups with 64.
//   ncu (--clock-control none, 120M, fp16): dQ 83 -> 65 us and dK/dV 135 -> 117 us per layer with
//   the swizzle; tensor pipe active 28 -> 36 % (dQ) and 22 -> 26 % (dK/dV) of the active cycles;
//   warps active 24 % (dQ, two blocks) and 12 % (dK/dV, one block); the largest stall went from
//   long scoreboard (2.7 / 2.2 per issued instruction) to about 1.2, wgmma waits ("wait") 1.2-1.4.
//   So dK/dV, one block of 8 warps a multiprocessor with every product waited for each tile, is
//   where the time is: the next step is keeping the next tile's products in flight across the
//   barrier (three buffers) or a producer warpgroup (TMA + mbarriers) so that fewer registers
//   per consumer allow a third consumer warpgroup.
//
// Version 10 (H200, 2026-11-30, attention_bench.py, ms for 12 layers at 120M, fp16; bf16 within 1 %):
//                                         fwd    bwd    dQ     dK/dV  (D)   | SDPA cuDNN fwd + bwd
//   versions 8 and 7 (before)             0.694  2.305  0.758  1.397  0.120 | 0.581 + 2.631
//   D computed in the dQ kernel           0.697  2.202  0.821  1.399  -     | (an earlier job)
//     and dK/dV one warpgroup a block, three blocks a multiprocessor
//                                         0.690  1.999  0.823  1.212  -
//     and the copies of load_tile7 at offsets known when compiling (V7_LOADS), forward too: the
//     defaults now
//                                         0.612  1.808  0.760  1.086  -     | total 2.420 against 3.212
//   other dK/dV settings with those copies: 48 queries a tile (153 registers, no spill, not
//   serialised) 1.177; 32 queries 1.240; two blocks of one warpgroup (192 registers) 1.348 without
//   the copies; the dQ kernel with one warpgroup a block and four blocks 0.759 (no gain).
//   12M (B=32, NH=6, T=256, 6 layers): backward 0.360 -> 0.277, forward 0.13-0.22 (noisy at this size).
//   The copies: version 7's loop over a tile's 16-byte chunks read blockDim.x at run time and
//   recomputed each chunk's row, swizzled column and 64-bit address, about 130 instructions a thread
//   a forward step (ncu: the forward issued an instruction on 52 % of the cycles, its ALU pipe 44 %
//   busy); with the thread count a template argument each thread's chunks share one column and
//   one address stepped by NT/8 rows, about 60.

#ifndef HS
#define HS 64
#endif
#if defined(__CUDA_ARCH__) && (defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(V6_SM90A)) && HS % 16 == 0 && HS <= 128
#define V7_WGMMA 1
#else
#define V7_WGMMA 0
#endif
#ifndef V7_WG
#define V7_WG 2  // warpgroups per dQ block (64 query rows each)
#endif
#define V7_DQ_THREADS (128 * V7_WG)
#define V7_QM (64 * V7_WG)             // query rows per dQ block
// Tunable with -D (dev/cuda/attention_bench.py times other settings; the launcher in ops.py
// reads hopper_geometry, which must agree): warpgroups per dK/dV block
// (64 keys each), queries per streamed tile in dK/dV, keys per streamed tile in dQ, and the blocks
// per multiprocessor each kernel asks the compiler to fit (the second argument of
// __launch_bounds__: 2 caps registers at 128 for 256 threads).
#ifndef V7_KWG
#define V7_KWG (HS == 64 ? 1 : 2)
#endif
#define V7_DKV_THREADS (128 * V7_KWG)
#define V7_BK (64 * V7_KWG)            // keys per dK/dV block
#ifndef V7_BQ
#define V7_BQ (HS <= 64 ? 64 : 32)
#endif
#ifndef V7_BN
#define V7_BN 64
#endif
#ifndef V7_DKV_BLOCKS
#define V7_DKV_BLOCKS (HS == 64 ? 3 : 1)  // 3: 168 registers, see "dK/dV at head size 64" above
#endif
#ifndef V7_OVERLAP
#define V7_OVERLAP 1  // 0: each product group waited for at once (no overlap inside a warpgroup)
#endif
#ifndef V7_LOADS
#define V7_LOADS 1  // tile copies at offsets known when compiling (load_tile7); 0: version 7's loop
#endif
#ifndef V7_SWIZZLE
#define V7_SWIZZLE 1  // 128-byte swizzled tiles (head size 64 only, elsewhere ignored); 0: core matrices
#endif
#define V7_SW (V7_SWIZZLE && HS == 64)
#ifndef V7_DQ_BLOCKS
#define V7_DQ_BLOCKS (HS <= 64 ? 2 : 1)  // fits 128 registers without spilling up to head size 64
#endif
// Dynamic shared memory (hopper_geometry in ops.py asks the same): K, V, then Q and dO two deep, lse and D two deep
#define V7_DKV_SMEM (2 * V7_BK * HS * 2 + 4 * V7_BQ * HS * 2 + 4 * V7_BQ * 4)
// Q and dO, then K and V two deep
#define V7_DQ_SMEM (2 * V7_QM * HS * 2 + 4 * V7_BN * HS * 2)

// The forward (version 8), tunable with -D as the backward (dev/cuda/attention_v8.py; the launcher
// in ops.py reads hopper_geometry, which must agree): warpgroups of 64 query rows a block, keys a
// tile, the previous tile's P V left running while the softmax is computed (1) or not (0), blocks
// a multiprocessor the registers are fitted to, and K/V tiles staged at once.
#ifndef V8_WG
#define V8_WG 2
#endif
#define V8_BM (64 * V8_WG)  // query rows a forward block
#define V8_THREADS (128 * V8_WG)
#ifndef V8_BN
#define V8_BN 64
#endif
#ifndef V8_OVERLAP
#define V8_OVERLAP 0
#endif
#ifndef V8_BLOCKS
#define V8_BLOCKS 2  // 128 registers: no spills at any head size (tests/test_hopper_compile.py)
#endif
#ifndef V8_STAGES
#define V8_STAGES 3
#endif
// Key tiles being copied while a step computes: the stages not read by it (K_j and V_j, or with the
// overlap K_j and V_{j-1})
#define V8_AHEAD (V8_STAGES - 1 - (V8_OVERLAP ? 1 : 0))
#if V8_AHEAD < 1 || V8_AHEAD > 3
#error "V8_STAGES: 2 to 4 without V8_OVERLAP, 3 to 5 with it"
#endif
// Q, then K and V V8_STAGES deep (hopper_geometry in ops.py asks the same)
#define V8_SMEM (V8_BM * HS * 2 + 2 * V8_STAGES * V8_BN * HS * 2)

// Where the wgmma kernels are compiled in, version 4's are renamed out of the way.
#if V7_WGMMA
#define k_attn_flash_fwd k_attn_flash_fwd_v4
#define k_attn_flash_bwd_dq k_attn_flash_bwd_dq_v4
#define k_attn_flash_bwd_dkv k_attn_flash_bwd_dkv_v4
#endif
#include "attention.cu"
#include "wgmma.cuh"
#include "fp8.cuh"
#if V7_WGMMA
#undef k_attn_flash_fwd
#undef k_attn_flash_bwd_dq
#undef k_attn_flash_bwd_dkv
#endif

#if V7_WGMMA
// ---------------------------------------------------------------- version 7 tiles
// Every tile of version 7 is ROWS x HS, staged by load_tile7. Default: version 6's core-matrix
// layout (load_tile6). With V7_SW (head size 64, so a row is 128 bytes): row-major rows of 128
// bytes, 16-byte chunk c of row r stored at chunk c ^ (r % 8) -- the 128-byte swizzle wgmma applies
// to shared-memory addresses (bits 4-6 XOR bits 7-9), so every tile starts 1024-byte aligned. The
// cp.async stores of a warp then cover 4 whole rows (512 contiguous bytes).
// NT: the block's threads (its blockDim.x, which every kernel here checks). With V7_LOADS (a -D
// setting, timed by dev/cuda/attention_bench.py), a thread's chunks are at offsets known when
// compiling: its chunk column c = tid % 8 and its rows tid / 8 + i NT / 8 (all with the same r % 8,
// so one swizzled column), one global address computed a call and stepped by NT / 8 rows; without
// it, a loop over the chunks with the block's size read at run time (version 7's loader).
template <int ROWS, int NT>
__device__ __forceinline__ void load_tile7(u16* dst, const HT* base, int r0, int T, int ld) {
#if V7_SW
#if V7_LOADS
  constexpr int STEP = NT / 8;  // rows one pass of the block's threads covers
  static_assert(NT % 64 == 0, "load_tile7: NT a multiple of 64, so a thread's rows share r % 8");
  int r = threadIdx.x >> 3, c = threadIdx.x & 7;
  u16* d = dst + r * 64 + ((c ^ (r & 7)) << 3);
  const HT* s = base + (i64)(r0 + r) * ld + c * 8;
#pragma unroll
  for (int i = 0; i < (ROWS + STEP - 1) / STEP; ++i) {
    if (ROWS % STEP == 0 || r + i * STEP < ROWS) {
      bool ok = r0 + r + i * STEP < T;
      cp_async16(d + i * STEP * 64, ok ? s + (i64)(i * STEP) * ld : base, ok);
    }
  }
#else
  for (int idx = threadIdx.x; idx < ROWS * 8; idx += blockDim.x) {
    int r = idx >> 3, c = idx & 7;
    bool ok = r0 + r < T;
    cp_async16(dst + r * 64 + ((c ^ (r & 7)) << 3), base + (ok ? (i64)(r0 + r) * ld + c * 8 : 0), ok);
  }
#endif
#else
  load_tile6<ROWS>(dst, base, r0, T, ld);
#endif
}
#if V7_WGMMA
// Descriptors of a load_tile7 tile. Swizzled (mode 1, bits 62-63): K-major, 8-row groups SBO = 1024
// bytes apart (LBO unused); MN-major (the K dimension along the rows), 8-row groups along K SBO =
// 1024 apart (LBO, between 64-column groups, unused at 64 columns).
__device__ __forceinline__ u64 desc7_k(const u16* tile) {
  return V7_SW ? make_desc(tile, 16, 1024) | (1ull << 62) : desc_kmajor(tile);
}
__device__ __forceinline__ u64 desc7_mn(const u16* tile) {
  return V7_SW ? make_desc(tile, 16, 1024) | (1ull << 62) : desc_mnmajor(tile);
}
// Descriptor steps (16-byte units): a k16 step of a K-major operand (two chunks of a swizzled row:
// 32 bytes; two core matrices: 256 bytes), and 16 rows of an MN-major one (2048 bytes both ways at
// HS = 64).
#define V7_KSTEP (V7_SW ? 2 : 16)
#define V7_MNSTEP (V7_SW ? 128 : 2 * CM_ROW_BYTES / 16)
#endif

// ---------------------------------------------------------------- version 7 products (sm_90a)
// acc (64 x N, fp32, accumulator layout) = A B^T over HS: da describes this warpgroup's 64 rows of
// A, db the N rows of B, both K-major tiles of load_tile6. Issues only: the caller fences, commits
// and waits (several products in one group).
template <int N>
__device__ __forceinline__ void ss7_issue(float* acc, u64 da, u64 db) {
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk)  // 16 columns of HS a step
    Wg<N, is_bf16<HT>::v, 0>::ss(acc, da + (u64)(kk * V7_KSTEP), db + (u64)(kk * V7_KSTEP), kk);
}

// acc (64 x HS) += A B: A (64 x NK) as NK/16 register fragments (frags7), db an NK x HS tile of
// load_tile6 read MN-major (its K dimension, NK, along the rows), as version 6's P V. Issues only.
template <int NK>
__device__ __forceinline__ void rs7_issue(float* acc, const unsigned (*a)[4], u64 db) {
#pragma unroll
  for (int kc = 0; kc < NK / 16; ++kc)  // two row groups (16 rows) a step
    Wg<HS, is_bf16<HT>::v, 1>::rs(acc, a[kc], db + (u64)(kc * V7_MNSTEP), 1);
}

// A fragments (16-bit, rounded here) of a 64 x N accumulator: k16 block kc is entries 8kc..8kc+7.
template <int N>
__device__ __forceinline__ void frags7(unsigned (*f)[4], const float* s) {
#pragma unroll
  for (int kc = 0; kc < N / 16; ++kc) {
    f[kc][0] = pack2(s[8 * kc + 0], s[8 * kc + 1]);
    f[kc][1] = pack2(s[8 * kc + 2], s[8 * kc + 3]);
    f[kc][2] = pack2(s[8 * kc + 4], s[8 * kc + 5]);
    f[kc][3] = pack2(s[8 * kc + 6], s[8 * kc + 7]);
  }
}

// Waits until at most N of this warpgroup's committed product groups are still running (groups
// complete in order).
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Two score-shaped products, s = A1 B1^T then t = A2 B2^T (64 x N each), one commit group each.
// Returns once s is done; t is done on return only without V7_OVERLAP: else the caller waits
// (wgmma_wait) and fences t before reading it.
template <int N>
__device__ __forceinline__ void two_scores(float* s, float* t, u64 a1, u64 b1, u64 a2, u64 b2) {
  fence_regs<N / 2>(s);
  fence_regs<N / 2>(t);
  wgmma_fence();
  ss7_issue<N>(s, a1, b1);
  wgmma_commit();
  ss7_issue<N>(t, a2, b2);
  wgmma_commit();
  wgmma_wait<V7_OVERLAP ? 1 : 0>();
  fence_regs<N / 2>(s);
}

// ---------------------------------------------------------------- FP8 epilogues
// The _fp8 kernels (train.precision=fp8 with delayed scaling;
// docs/FP8.md) are the forward and the backward of this file with an output written as the FP8
// operand of the product that reads it, scaled by the delayed scale its row holds: the forward's
// out also as the attention projection's input (E4M3, row-major and transposed), the backward's
// dqkv only as the QKV product's output gradient (the gradient format, row-major and transposed,
// with the QKV bias's column partials; the 16-bit dqkv is not written). After the last tile, when
// the tiles are read no more, each warpgroup's 64 rows of an output go through shared memory:
//   f8_stage  each thread puts its accumulator values, rounded to 16 bits exactly as the 16-bit
//             kernels store them, into its warpgroup's stage (64 x F8_LD values);
//   f8_rows   each thread casts 8 staged values at a time (fp8.cuh) into q and into the byte
//             stage, taking their largest abs_bits; with partials, threads < HS sum a column each
//             over the 64 rows in the order of fp8.cu's fp8_tile_colsum_warps;
//   f8_cols   each thread writes 8 bytes of a column of the byte stage to q_t.
// The bytes, the amax and the column partials are those fp8.cu's k_fp8_cast_transpose_amax and
// k_fp8_cast_transpose_colsum_amax (64-row tiles) make of the 16-bit tensor, bit for bit, but for
// float32 subnormal values (this file's sm_90a build flushes them to zero, fp8.cu's does not). The
// launcher asks T % 64 == 0, so that a warpgroup's rows are one 64-row tile of those casts.
#define F8_LD (HS + 8)  // a stage row: HS values (or bytes) and 8 more; 16-byte aligned rows

// Where an _fp8 kernel writes: q (B*T, ld) and q_t (ld, B*T) FP8 bytes, partial (B*T / 64, ld)
// column sums of each 64-row tile (or null), amax = max(amax, max |value|) (or null), s the scale.
struct F8Dst {
  unsigned char* q;
  unsigned char* q_t;
  float* partial;
  float* amax;
  float s;
};

// This warp's accumulator values (rows w16 + g + 8r of the warpgroup, columns 8j + 2t4 + e: acc[4j
// + 2r + e]) into the stage st, rounded to HT: ADD0 as store_rows writes them (0 + s_r * acc), else
// as the forward writes out (acc * s_r).
template <bool ADD0>
__device__ __forceinline__ void f8_stage(HT* st, const float* acc, int w16, float s0, float s1) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sc = r ? s1 : s0;
    unsigned* p = (unsigned*)(st + (w16 + g + 8 * r) * F8_LD + 2 * t4);
#pragma unroll
    for (int j = 0; j < HS / 8; ++j)
      p[j * 4] = ADD0 ? pack2(0.f + sc * acc[4 * j + 2 * r], 0.f + sc * acc[4 * j + 2 * r + 1])
                      : pack2(acc[4 * j + 2 * r] * sc, acc[4 * j + 2 * r + 1] * sc);
  }
}

// The staged 64 x HS tile as FP8 with scale s: row r, column c to q[r * ldq + c] and to the byte
// stage bt; with partial (not null), partial[c] = column c's sum over the 64 rows. tid: the
// thread's index in its warpgroup. Returns the largest abs_bits of its values.
__device__ __forceinline__ unsigned f8_rows(const HT* st, unsigned char* bt, float s, unsigned char* q, i64 ldq,
                                            float* partial, int tid) {
  unsigned m = 0u;
#pragma unroll
  for (int i = 0; i < HS / 16; ++i) {  // 64 * HS / 8 vectors of 8 values, 128 threads
    int v = tid + 128 * i, r = v / (HS / 8), c8 = (v % (HS / 8)) * 8;
    vec16 x = *reinterpret_cast<const vec16*>(st + r * F8_LD + c8);
    float f[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      f[e] = to_f(reinterpret_cast<const HT*>(&x)[e]);
      m = umax(m, abs_bits(f[e]));
    }
    Bytes8 b{fp8x2(f[0] * s, f[1] * s) | (fp8x2(f[2] * s, f[3] * s) << 16),
             fp8x2(f[4] * s, f[5] * s) | (fp8x2(f[6] * s, f[7] * s) << 16)};
    *reinterpret_cast<Bytes8*>(q + r * ldq + c8) = b;
    *reinterpret_cast<Bytes8*>(bt + r * F8_LD + c8) = b;
  }
  if (partial && tid < HS) {  // fp8_tile_colsum_warps' order: thread 8w + k of a cast tile's warp w
    const HT* c = st + tid;   // adds rows 4w + k and 4w + k + 32, the warp ((k0 + k1) + (k2 + k3)),
    float v = 0.f;            // then the warps in order
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      float a[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        a[k] = 0.f;
        a[k] += to_f(c[(4 * w + k) * F8_LD]);
        a[k] += to_f(c[(4 * w + k + 32) * F8_LD]);
      }
      float sw = (a[0] + a[1]) + (a[2] + a[3]);
      v = w == 0 ? sw : v + sw;
    }
    partial[tid] = v;
  }
  return m;
}

// The byte stage's columns to q_t: column c's 64 bytes at q_t[c * ldt], 8 a thread.
__device__ __forceinline__ void f8_cols(const unsigned char* bt, unsigned char* q_t, i64 ldt, int tid) {
#pragma unroll
  for (int i = 0; i < HS / 16; ++i) {  // HS columns x 8 groups of 8 rows, 128 threads
    int v = tid + 128 * i, col = v >> 3, r8 = (v & 7) * 8;
    unsigned lo = 0u, hi = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lo |= (unsigned)bt[(r8 + j) * F8_LD + col] << (8 * j);
      hi |= (unsigned)bt[(r8 + 4 + j) * F8_LD + col] << (8 * j);
    }
    *reinterpret_cast<Bytes8*>(q_t + col * ldt + r8) = Bytes8{lo, hi};
  }
}

// One warpgroup's output tile (acc: its accumulators, scaled by s0 / s1 as f8_stage says) to d at
// column col0 of rows grow .. grow + 63 (of B*T = n rows, row stride ld); returns the thread's
// largest abs_bits. Every thread of the block calls it (it has block barriers); valid false: the
// warpgroup has no rows (past T), it writes nothing. stage: the block's shared memory, the stages
// of its NWG warpgroups (3 * 64 * F8_LD bytes each).
template <bool ADD0, int NWG>
__device__ __forceinline__ unsigned f8_tile_out(u16* stage, const float* acc, float s0, float s1, const F8Dst& d,
                                                i64 grow, int col0, i64 ld, i64 n, bool valid) {
  int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  HT* st = reinterpret_cast<HT*>(stage) + wg * 64 * F8_LD;
  unsigned char* bt = reinterpret_cast<unsigned char*>(stage + NWG * 64 * F8_LD) + wg * 64 * F8_LD;
  unsigned m = 0u;
  __syncthreads();  // the stage is free: the tiles it overlays are read no more, or its last use is done
  if (valid) f8_stage<ADD0>(st, acc, 16 * ((threadIdx.x >> 5) & 3), s0, s1);
  __syncthreads();  // the stage is written
  float* part = d.partial ? d.partial + (grow / 64) * ld + col0 : nullptr;  // this tile's row of partials
  if (valid) m = f8_rows(st, bt, d.s, d.q + grow * ld + col0, ld, part, tid);
  __syncthreads();  // the byte stage is written
  if (valid) f8_cols(bt, d.q_t + (i64)col0 * n + grow, n, tid);
  return m;
}

// amax = max(amax, the warp's largest m): one atomicMax a warp (no shared memory, no barrier; the
// maximum does not depend on the order the atomics come in).
__device__ __forceinline__ void f8_amax(float* amax, unsigned m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = umax(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), m);
}

// The scale the _fp8 kernels cast with, from meta[0] (a delayed scale's row); block (0, 0)'s first
// thread writes 1/scale to meta[inv_at] where inv_at >= 0.
__device__ __forceinline__ float f8_scale(float* meta, int inv_at) {
  float inv, s = fp8_scale(meta[0], &inv);
  if (inv_at >= 0 && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) meta[inv_at] = inv;
  return s;
}

// ---------------------------------------------------------------- dK, dV
// One query tile of one warpgroup: its 64 keys (this thread: keys key0 + g and key0 + g + 8, key0
// the warp's first) against queries [q0, q0 + V7_BQ). dk, dv: 64 x HS accumulators. Issues dV's and
// dK's products and returns with them still running (the caller waits); sf: dS^T's A fragments,
// which the one-pass backwards (versions 9 and 11, measured losers, in git history) also multiplied
// by K for dQ.
template <bool MASK>
__device__ __forceinline__ void dkv7_issue(float* dk, float* dv, unsigned (*sf)[4], u64 dkey, u64 dval, const u16* Q,
                                           const u16* dO, const float* L, const float* Dt, int key0, int q0, int T,
                                           float sl2) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float s[V7_BQ / 2], dp[V7_BQ / 2];
  two_scores<V7_BQ>(s, dp, dkey, desc7_k(Q), dval, desc7_k(dO));
  // P^T while dP^T may still be running
#pragma unroll
  for (int j = 0; j < V7_BQ / 8; ++j) {
    float l2[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) l2[c] = L[8 * j + 2 * t4 + c] * LOG2E;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = fast_exp2(fmaf(s[4 * j + e], sl2, -l2[e & 1]));
      if (MASK) {
        int q = q0 + 8 * j + 2 * t4 + (e & 1);
        if (q < key0 + g + 8 * (e >> 1) || q >= T) p = 0.f;
      }
      s[4 * j + e] = p;
    }
  }
  unsigned pf[V7_BQ / 16][4];
  frags7<V7_BQ>(pf, s);
  // dV += P^T dO, left running (with V7_OVERLAP) while dS^T is formed
  fence_regs<HS / 2>(dv);
  wgmma_fence();
  rs7_issue<V7_BQ>(dv, pf, desc7_mn(dO));
  wgmma_commit();
  wgmma_wait<V7_OVERLAP ? 1 : 0>();  // dP^T done (it was committed before dV)
  fence_regs<V7_BQ / 2>(dp);
#pragma unroll
  for (int j = 0; j < V7_BQ / 8; ++j) {
    float d[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) d[c] = Dt[8 * j + 2 * t4 + c];
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - d[e & 1]);
  }
  frags7<V7_BQ>(sf, dp);
  fence_regs<HS / 2>(dk);
  wgmma_fence();
  rs7_issue<V7_BQ>(dk, sf, desc7_mn(Q));
  wgmma_commit();
}

// dkv7_issue, then every product waited for.
template <bool MASK>
__device__ __forceinline__ void dkv7_tile(float* dk, float* dv, u64 dkey, u64 dval, const u16* Q, const u16* dO,
                                          const float* L, const float* Dt, int key0, int q0, int T, float sl2) {
  unsigned sf[V7_BQ / 16][4];
  dkv7_issue<MASK>(dk, dv, sf, dkey, dval, Q, dO, L, Dt, key0, q0, T, sl2);
  wgmma_wait_all();
  fence_regs<HS / 2>(dv);
  fence_regs<HS / 2>(dk);
}

// dK and dV parts of dqkv += ...: version 7, grid (B*NH, ceil(T/V7_BK)), block V7_DKV_THREADS,
// V7_DKV_SMEM bytes of dynamic shared memory (traps on anything else).
template <bool FP8>
__device__ __forceinline__ void attn_bwd_dkv(HT* dqkv, const F8Dst& f8, const HT* qkv, const HT* dout, const float* lse,
                                             const float* Dv, int B, int T, int NH, float scale, int accumulate) {
  extern __shared__ __align__(1024) u16 smem7[];
  u16* smem = smem7;
  require_smem(V7_DKV_SMEM);
  if (V7_SW && (smem_u32(smem) & 1023)) __trap();  // the swizzle is on address bits
  if (blockDim.x != V7_DKV_THREADS) __trap();
  u16* k_tile = smem;                           // [V7_BK x HS]
  u16* v_tile = k_tile + V7_BK * HS;            // [V7_BK x HS]
  u16* q_tiles = v_tile + V7_BK * HS;           // [2][V7_BQ x HS]
  u16* do_tiles = q_tiles + 2 * V7_BQ * HS;     // [2][V7_BQ x HS]
  float* lse_tiles = (float*)(do_tiles + 2 * V7_BQ * HS);  // [2][V7_BQ]
  float* d_tiles = lse_tiles + 2 * V7_BQ;                  // [2][V7_BQ]
  int C = NH * HS, ld = 3 * C, bh = blockIdx.x, b = bh / NH, h = bh % NH;
  int k0 = blockIdx.y * V7_BK;  // the first keys see the most queries: they go first
  int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
  int wkey0 = k0 + 64 * wg;      // this warpgroup's first key
  int key0 = wkey0 + 16 * warp;  // this warp's first key
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  const HT* ob = dout + (i64)b * T * C + h * HS;
  const float* lb = lse + (i64)bh * T;
  const float* db = Dv + (i64)bh * T;
  float sl2 = scale * LOG2E;
  int first = k0 / V7_BQ, n_tiles = (T - 1) / V7_BQ + 1;
  load_tile7<V7_BK, V7_DKV_THREADS>(k_tile, kb, k0, T, ld);
  load_tile7<V7_BK, V7_DKV_THREADS>(v_tile, vb, k0, T, ld);
  load_tile7<V7_BQ, V7_DKV_THREADS>(q_tiles, qb, first * V7_BQ, T, ld);
  load_tile7<V7_BQ, V7_DKV_THREADS>(do_tiles, ob, first * V7_BQ, T, C);
  load_row_values<V7_BQ>(lse_tiles, lb, first * V7_BQ, T);
  load_row_values<V7_BQ>(d_tiles, db, first * V7_BQ, T);
  cp_commit();
  u64 dkey = desc7_k(k_tile + 64 * wg * HS), dval = desc7_k(v_tile + 64 * wg * HS);
  float dk[HS / 2], dv[HS / 2];
#pragma unroll
  for (int i = 0; i < HS / 2; ++i) dk[i] = dv[i] = 0.f;
  for (int qt = first; qt < n_tiles; ++qt) {
    int q0 = qt * V7_BQ, cur = (qt - first) & 1, nb = cur ^ 1;
    pipeline_wait_async(qt + 1 < n_tiles, [&] {
      load_tile7<V7_BQ, V7_DKV_THREADS>(q_tiles + nb * V7_BQ * HS, qb, q0 + V7_BQ, T, ld);
      load_tile7<V7_BQ, V7_DKV_THREADS>(do_tiles + nb * V7_BQ * HS, ob, q0 + V7_BQ, T, C);
      load_row_values<V7_BQ>(lse_tiles + nb * V7_BQ, lb, q0 + V7_BQ, T);
      load_row_values<V7_BQ>(d_tiles + nb * V7_BQ, db, q0 + V7_BQ, T);
    });
    const u16* Q = q_tiles + cur * V7_BQ * HS;
    const u16* dO = do_tiles + cur * V7_BQ * HS;
    const float* L = lse_tiles + cur * V7_BQ;
    const float* Dt = d_tiles + cur * V7_BQ;
    // else every query of the tile is before the warpgroup's keys, or it has no key (uniform branch)
    if (q0 + V7_BQ - 1 >= wkey0 && wkey0 < T) {
      if (q0 < wkey0 + 63 || q0 + V7_BQ > T) dkv7_tile<true>(dk, dv, dkey, dval, Q, dO, L, Dt, key0, q0, T, sl2);
      else dkv7_tile<false>(dk, dv, dkey, dval, Q, dO, L, Dt, key0, q0, T, sl2);
    }
    __syncthreads();
  }
  if (FP8) {  // dK's and dV's columns of dqkv as FP8 (the FP8 epilogues above)
    static_assert(3 * V7_KWG * 64 * F8_LD <= V7_DKV_SMEM, "the FP8 stage overlays the tiles");
    i64 grow = (i64)b * T + wkey0, n = (i64)B * T;
    unsigned m = f8_tile_out<true, V7_KWG>(smem, dk, scale, scale, f8, grow, C + h * HS, ld, n, wkey0 < T);
    m = umax(m, f8_tile_out<true, V7_KWG>(smem, dv, 1.f, 1.f, f8, grow, 2 * C + h * HS, ld, n, wkey0 < T));
    if (f8.amax) f8_amax(f8.amax, m);
    return;
  }
  HT* base = dqkv + (i64)b * T * ld + h * HS;
  store_rows(base + C, ld, (const float(*)[4])dk, key0, T, scale, accumulate);
  store_rows(base + 2 * C, ld, (const float(*)[4])dv, key0, T, 1.f, accumulate);
}

extern "C" __global__ void __launch_bounds__(V7_DKV_THREADS, V7_DKV_BLOCKS) k_attn_flash_bwd_dkv(HT* dqkv, const HT* qkv, const HT* dout,
                                                                             const float* lse, const float* Dv,
                                                                             int B, int T, int NH, float scale,
                                                                             int accumulate) {
  pdl_wait();
  attn_bwd_dkv<false>(dqkv, F8Dst{}, qkv, dout, lse, Dv, B, T, NH, scale, accumulate);
}

// k_attn_flash_bwd_dkv writing dK and dV into q (B*T, 3C) and q_t (3C, B*T) as FP8 with the scale
// of meta[0], their column partials into partial (B*T / 64, 3C; null: none) and their amax into
// amax_out (null: none); dqkv is not written (the FP8 epilogues above). T % 64 == 0.
extern "C" __global__ void __launch_bounds__(V7_DKV_THREADS, V7_DKV_BLOCKS) k_attn_flash_bwd_dkv_fp8(
    unsigned char* q, unsigned char* q_t, float* partial, float* meta, float* amax_out, const HT* qkv, const HT* dout,
    const float* lse, const float* Dv, int B, int T, int NH, float scale) {
  pdl_wait();
  F8Dst f8{q, q_t, partial, amax_out, f8_scale(meta, -1)};
  attn_bwd_dkv<true>(nullptr, f8, qkv, dout, lse, Dv, B, T, NH, scale, 0);
}

// ---------------------------------------------------------------- dQ
// One key tile of one warpgroup: its 64 query rows (this thread: rows row0 + g and row0 + g + 8,
// row0 the warp's first) against keys [k0, k0 + V7_BN). dq: 64 x HS accumulator.
template <bool MASK>
__device__ __forceinline__ void dq7_tile(float* dq, u64 dqry, u64 ddo, const u16* K, const u16* V, const float* L2,
                                         const float* D, int row0, int k0, int T, float sl2) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float s[V7_BN / 2], dp[V7_BN / 2];
  two_scores<V7_BN>(s, dp, dqry, desc7_k(K), ddo, desc7_k(V));
  // P while dP may still be running
#pragma unroll
  for (int j = 0; j < V7_BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int r = e >> 1;
      float p = fast_exp2(fmaf(s[4 * j + e], sl2, -L2[r]));
      if (MASK) {
        int key = k0 + 8 * j + 2 * t4 + (e & 1);
        if (key > row0 + g + 8 * r || key >= T) p = 0.f;
      }
      s[4 * j + e] = p;
    }
  wgmma_wait<0>();
  fence_regs<V7_BN / 2>(dp);
#pragma unroll
  for (int j = 0; j < V7_BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * j + e] *= dp[4 * j + e] - D[e >> 1];
  unsigned sf[V7_BN / 16][4];
  frags7<V7_BN>(sf, s);
  fence_regs<HS / 2>(dq);
  wgmma_fence();
  rs7_issue<V7_BN>(dq, sf, desc7_mn(K));
  wgmma_commit();
  wgmma_wait_all();
  fence_regs<HS / 2>(dq);
}

// D = rowsum(dO * O) of this thread's two rows (row0 + g + 8r, r = 0, 1) from dout and out (B,T,C)
// offset to batch b's rows and the head's columns; rows at or past T get 0. The four lanes of a row
// take its 16-byte chunks in turn (lane t4: chunks t4, t4 + 4, ...), each summing its products in
// fp32 in order, then two butterfly shuffles add the four partial sums: a fixed order.
__device__ __forceinline__ void rows_D(float* D, const HT* dout, const HT* out, int row0, int T, int C) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int row = row0 + g + 8 * r;
    float d = 0.f;
    if (row < T) {
      const vec16* po = (const vec16*)(out + (i64)row * C);
      const vec16* pd = (const vec16*)(dout + (i64)row * C);
#pragma unroll
      for (int ch = t4; ch < HS / 8; ch += 4) {
        vec16 o = po[ch], dd = pd[ch];
#pragma unroll
        for (int e = 0; e < 8; ++e) d += vget(dd, e) * vget(o, e);
      }
    }
    d += __shfl_xor_sync(0xffffffffu, d, 1);
    d += __shfl_xor_sync(0xffffffffu, d, 2);
    D[r] = d;
  }
}

// dQ part of dqkv += ..., and D (B*NH, T) for k_attn_flash_bwd_dkv, which runs after it: version 10,
// grid (B*NH, ceil(T/V7_QM)), block V7_DQ_THREADS, V7_DQ_SMEM bytes of dynamic shared memory (traps
// on anything else). Version 7's dQ kernel, which read D from k_attn_flash_D; here each thread
// computes D for its two rows (rows_D) while the first tiles are being copied, and writes it.
template <bool FP8>
__device__ __forceinline__ void attn_bwd_dq(HT* dqkv, const F8Dst& f8, const HT* qkv, const HT* dout, const HT* out,
                                            const float* lse, float* Dv, int B, int T, int NH, float scale,
                                            int accumulate) {
  extern __shared__ __align__(1024) u16 smem7[];
  u16* smem = smem7;
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
  float sl2 = scale * LOG2E, L2[2], D[2];
  rows_D(D, ob, out + (i64)b * T * C + h * HS, row0, T, C);  // while the first tiles are copied
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
  if (FP8) {  // dQ's columns of dqkv as FP8 (the FP8 epilogues above)
    static_assert(3 * V7_WG * 64 * F8_LD <= V7_DQ_SMEM, "the FP8 stage overlays the tiles");
    unsigned m = f8_tile_out<true, V7_WG>(smem, dq, scale, scale, f8, (i64)b * T + wrow0, h * HS, ld, (i64)B * T,
                                          wrow0 < T);
    if (f8.amax) f8_amax(f8.amax, m);
    return;
  }
  store_rows(dqkv + (i64)b * T * ld + h * HS, ld, (const float(*)[4])dq, row0, T, scale, accumulate);
}

extern "C" __global__ void __launch_bounds__(V7_DQ_THREADS, V7_DQ_BLOCKS) k_attn_flash_bwd_dq(HT* dqkv, const HT* qkv, const HT* dout,
                                                                            const HT* out, const float* lse, float* Dv,
                                                                            int B, int T, int NH, float scale,
                                                                            int accumulate) {
  pdl_wait();
  attn_bwd_dq<false>(dqkv, F8Dst{}, qkv, dout, out, lse, Dv, B, T, NH, scale, accumulate);
}

// k_attn_flash_bwd_dq writing dQ into q (B*T, 3C) and q_t (3C, B*T) as FP8 with the scale of
// meta[0] (1/scale to meta[inv_at]), its column partials into partial (B*T / 64, 3C; null: none)
// and its amax into amax_out (null: none); D as k_attn_flash_bwd_dq writes it; dqkv is not
// written. Launched before k_attn_flash_bwd_dkv_fp8 (which reads D). T % 64 == 0.
extern "C" __global__ void __launch_bounds__(V7_DQ_THREADS, V7_DQ_BLOCKS) k_attn_flash_bwd_dq_fp8(
    unsigned char* q, unsigned char* q_t, float* partial, float* meta, int inv_at, float* amax_out, const HT* qkv,
    const HT* dout, const HT* out, const float* lse, float* Dv, int B, int T, int NH, float scale) {
  pdl_wait();
  F8Dst f8{q, q_t, partial, amax_out, f8_scale(meta, inv_at)};
  attn_bwd_dq<true>(nullptr, f8, qkv, dout, out, lse, Dv, B, T, NH, scale, 0);
}

// ---------------------------------------------------------------- forward (version 8)
// Settings measured (H200, attention_bench.py, one process: the forward of 12 layers at 120M, ms,
// fp16; bf16 within 1 %; version 4 0.839, SDPA cuDNN 0.589, SDPA flash 0.930):
//   2 warpgroups, 64-key tiles, 2 blocks a multiprocessor, no overlap (the defaults)   0.690
//     the same with the overlap of the previous P V 0.719, and with 4 stages 0.701
//   3 warpgroups (192 rows), 128-key tiles, one block (154-167 registers): overlap 0.868,
//     no overlap 0.816, overlap with 4 stages 0.855, 64-key tiles 0.906; core-matrix tiles
//     instead of swizzled ones 1.087 (an earlier run)
//   2 warpgroups, 128-key tiles, one block 0.958; 1 warpgroup, 128 keys, 2 blocks 0.953;
//   1 warpgroup, 64 keys, 4 blocks 0.796, without the overlap 0.755
// 12M (6 layers, B=32, T=256): 0.094 against version 4's 0.118, cuDNN 0.135, flash 0.120.
// Occupancy decides: a block's first tiles (Q, K and V copied, nothing to overlap them with) are
// hidden only by another block on the multiprocessor; ncu on the 3-warpgroup setting: 18.75 %
// theoretical occupancy, an instruction issued on 45 % of the cycles. The overlap inside a
// warpgroup (FlashAttention-3's) costs registers and, at one tile of 64 keys, gains nothing here.
template <int N>
__device__ __forceinline__ void cp_wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// The softmax of one tile of scores s (this warpgroup's 64 rows x V8_BN keys, accumulator layout;
// this thread: rows row0 + g, row0 + g + 8): masks keys after the row or at or past T (MASK),
// updates the row maxima m and sums l, leaves P = exp2(s * sl2 - m * sl2) in s and the factor
// the output accumulated so far is to be rescaled by in alpha.
template <bool MASK>
__device__ __forceinline__ void fwd8_softmax(float* s, float* m, float* l, float* alpha, int row0, int k0, int T,
                                             float sl2) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
  for (int j = 0; j < V8_BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (MASK) {
        int key = k0 + 8 * j + 2 * t4 + (e & 1), row = row0 + g + 8 * (e >> 1);
        if (key > row || key >= T) s[4 * j + e] = NEG_INF;
      }
      tmax[e >> 1] = fmaxf(tmax[e >> 1], s[4 * j + e]);
    }
  float ms[2];
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
  for (int j = 0; j < V8_BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = fast_exp2(fmaf(s[4 * j + e], sl2, -ms[e >> 1]));
      s[4 * j + e] = p;
      l[e >> 1] += p;
    }
}

// One step of one warpgroup: with DO_S, S = Q K^T for key tile k0 and its softmax (MASK: the
// tile crosses the diagonal or the end of the sequence); with DO_PV, O += P V for the previous
// tile (P in pf, dvp its V), running while the softmax is computed. Without V8_OVERLAP, DO_PV is
// never set and this tile's own P V follows its softmax. On return o holds every product issued,
// rescaled to the new maxima, and pf this tile's P (with DO_S). The flags are template arguments:
// a wgmma issued and waited for in different run-time branches makes ptxas serialise them all.
template <bool DO_S, bool DO_PV, bool MASK>
__device__ __forceinline__ void fwd8_step(float* o, float* s, unsigned (*pf)[4], float* m, float* l, u64 dq, u64 dk,
                                          u64 dv, int row0, int k0, int T, float sl2) {
  float alpha[2] = {1.f, 1.f};
  fence_regs<V8_BN / 2>(s);
  fence_regs<HS / 2>(o);
  wgmma_fence();
  if (DO_S) {
    ss7_issue<V8_BN>(s, dq, dk);
    wgmma_commit();
  }
  if (DO_PV) {
    rs7_issue<V8_BN>(o, pf, dv);
    wgmma_commit();
  }
  if (DO_S) {
    if (DO_PV) wgmma_wait<1>();
    else wgmma_wait<0>();
    fence_regs<V8_BN / 2>(s);
    fwd8_softmax<MASK>(s, m, l, alpha, row0, k0, T, sl2);
  }
  if (DO_PV) {
    wgmma_wait<0>();
    fence_regs<HS / 2>(o);
  }
  if (DO_S) {
#pragma unroll
    for (int j = 0; j < HS / 8; ++j) {
      o[4 * j] *= alpha[0]; o[4 * j + 1] *= alpha[0]; o[4 * j + 2] *= alpha[1]; o[4 * j + 3] *= alpha[1];
    }
    frags7<V8_BN>(pf, s);
    if (!V8_OVERLAP) {  // this tile's P V now
      fence_regs<HS / 2>(o);
      wgmma_fence();
      rs7_issue<V8_BN>(o, pf, dv);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs<HS / 2>(o);
    }
  }
}

// out (B,T,C) and lse (B*NH, T) from qkv (B,T,3C): version 8, grid (B*NH, ceil(T/V8_BM)), block
// V8_THREADS, V8_SMEM bytes of dynamic shared memory (traps on anything else).
template <bool FP8>
__device__ __forceinline__ void attn_fwd(HT* out, float* lse, const F8Dst& f8, const HT* qkv, int B, int T, int NH,
                                         float scale) {
  extern __shared__ __align__(1024) u16 smem8[];
  u16* smem = smem8;
  require_smem(V8_SMEM);
  if (V7_SW && (smem_u32(smem) & 1023)) __trap();  // the swizzle is on address bits
  if (blockDim.x != V8_THREADS) __trap();
  u16* q_tile = smem;                   // [V8_BM x HS], stays for the whole block
  u16* k_tiles = q_tile + V8_BM * HS;                 // [V8_STAGES][V8_BN x HS]
  u16* v_tiles = k_tiles + V8_STAGES * V8_BN * HS;    // [V8_STAGES][V8_BN x HS]
  int C = NH * HS, ld = 3 * C, bh = blockIdx.x, b = bh / NH, h = bh % NH;
  int q0 = (gridDim.y - 1 - blockIdx.y) * V8_BM;  // the longest rows first
  int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  int wrow0 = q0 + 64 * wg;      // this warpgroup's first row
  int row0 = wrow0 + 16 * warp;  // this warp's first row
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  float sl2 = scale * LOG2E;
  int n_tiles = (min(q0 + V8_BM, T) - 1) / V8_BN + 1;  // causal: keys up to the block's last query
  // this warpgroup's key tiles: up to its last row (none when its rows start at or past T)
  int my_tiles = wrow0 < T ? (min(wrow0 + 63, T - 1)) / V8_BN + 1 : 0;
  // tile i in stage i % V8_STAGES, one commit group a tile (Q with tile 0), V8_AHEAD in flight
  load_tile7<V8_BM, V8_THREADS>(q_tile, qb, q0, T, ld);
#pragma unroll
  for (int i = 0; i < V8_AHEAD; ++i) {
    if (i < n_tiles) {
      load_tile7<V8_BN, V8_THREADS>(k_tiles + i * V8_BN * HS, kb, i * V8_BN, T, ld);
      load_tile7<V8_BN, V8_THREADS>(v_tiles + i * V8_BN * HS, vb, i * V8_BN, T, ld);
    }
    cp_commit();  // empty past the last tile: every step then waits for the same count
  }
  u64 dq = desc7_k(q_tile + 64 * wg * HS);
  float o[HS / 2], s[V8_BN / 2], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  unsigned pf[V8_BN / 16][4];
#pragma unroll
  for (int i = 0; i < HS / 2; ++i) o[i] = 0.f;
  // step kt reads K_kt and (overlap) V_{kt-1}; one step more than there are tiles for the last P V
  for (int kt = 0; kt <= n_tiles; ++kt) {
    int k0 = kt * V8_BN;
    if (kt < n_tiles) {
      cp_wait_group<V8_AHEAD - 1>();  // tile kt is in (the groups after it are tiles kt+1 ..)
      fence_proxy_async();
      __syncthreads();  // every tile up to kt is in; every warpgroup is done with step kt - 1
      if (kt + V8_AHEAD < n_tiles) {
        int nb = (kt + V8_AHEAD) % V8_STAGES;  // last read at step kt - 1 at the latest
        load_tile7<V8_BN, V8_THREADS>(k_tiles + nb * V8_BN * HS, kb, k0 + V8_AHEAD * V8_BN, T, ld);
        load_tile7<V8_BN, V8_THREADS>(v_tiles + nb * V8_BN * HS, vb, k0 + V8_AHEAD * V8_BN, T, ld);
      }
      cp_commit();
    }
    bool do_s = kt < my_tiles, mask = k0 + V8_BN - 1 > wrow0 || k0 + V8_BN > T;
    u64 dk = desc7_k(k_tiles + (kt % V8_STAGES) * V8_BN * HS);
    if (V8_OVERLAP) {
      bool do_pv = kt >= 1 && kt <= my_tiles;
      u64 dvp = desc7_mn(v_tiles + ((kt + V8_STAGES - 1) % V8_STAGES) * V8_BN * HS);  // V_{kt-1}
      if (do_s && do_pv) {
        if (mask) fwd8_step<true, true, true>(o, s, pf, m, l, dq, dk, dvp, row0, k0, T, sl2);
        else fwd8_step<true, true, false>(o, s, pf, m, l, dq, dk, dvp, row0, k0, T, sl2);
      } else if (do_s) {  // the first tile
        if (mask) fwd8_step<true, false, true>(o, s, pf, m, l, dq, dk, dvp, row0, k0, T, sl2);
        else fwd8_step<true, false, false>(o, s, pf, m, l, dq, dk, dvp, row0, k0, T, sl2);
      } else if (do_pv) {  // after the last tile: its P V
        fwd8_step<false, true, false>(o, s, pf, m, l, dq, dk, dvp, row0, k0, T, sl2);
      }
    } else if (do_s) {
      u64 dv = desc7_mn(v_tiles + (kt % V8_STAGES) * V8_BN * HS);
      if (mask) fwd8_step<true, false, true>(o, s, pf, m, l, dq, dk, dv, row0, k0, T, sl2);
      else fwd8_step<true, false, false>(o, s, pf, m, l, dq, dk, dv, row0, k0, T, sl2);
    }
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
  if (FP8) {  // out as FP8 too (the FP8 epilogues above)
    static_assert(3 * V8_WG * 64 * F8_LD <= V8_SMEM, "the FP8 stage overlays the tiles");
    unsigned m = f8_tile_out<false, V8_WG>(smem, o, inv[0], inv[1], f8, (i64)b * T + wrow0, h * HS, C, (i64)B * T,
                                           wrow0 < T);
    if (f8.amax) f8_amax(f8.amax, m);
  }
}

extern "C" __global__ void __launch_bounds__(V8_THREADS, V8_BLOCKS) k_attn_flash_fwd(HT* out, float* lse, const HT* qkv,
                                                                                   int B, int T, int NH, float scale) {
  pdl_wait();
  attn_fwd<false>(out, lse, F8Dst{}, qkv, B, T, NH, scale);
}

// k_attn_flash_fwd, and out also into q (B*T, C) and q_t (C, B*T) as E4M3 bytes with the scale of
// meta[0] (1/scale to meta[inv_at]) and its amax into amax_out (null: none). T % 64 == 0.
extern "C" __global__ void __launch_bounds__(V8_THREADS, V8_BLOCKS) k_attn_flash_fwd_fp8(
    HT* out, float* lse, unsigned char* q, unsigned char* q_t, float* meta, int inv_at, float* amax_out, const HT* qkv,
    int B, int T, int NH, float scale) {
  pdl_wait();
  F8Dst f8{q, q_t, nullptr, amax_out, f8_scale(meta, inv_at)};
  attn_fwd<true>(out, lse, f8, qkv, B, T, NH, scale);
}
#endif  // V7_WGMMA
