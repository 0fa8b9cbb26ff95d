// attention_v9.cu: version 9 of the backward, one pass (the package's attention_hopper.cu, included,
// plus k_attn_flash_bwd9 at the end). Version 7 computes S and dP twice, once in its dQ kernel and
// once in its dK/dV kernel (7 products per tile pair); here one kernel per (head, 128 keys)
// computes dK and dV as version 7's dK/dV kernel does AND each query tile's dQ contribution
// dS K (5 products per tile pair), and adds the contributions of the key blocks of one query tile
// in a fixed order, without floating-point atomics: the same inputs give the same bits.
// A dev variant, not promoted: measured slower than version 7 (below).
//
// Built for sm_90a (attention_v9.py: NVRTC, -DV6_SM90A), head size 64 only (the 128-byte
// swizzled tiles of version 7); elsewhere the file is attention_hopper.cu.
//   nvcc -std=c++17 -arch=sm_90a --cubin -Xptxas -v -Ikernels -DCT=f16 -DHS=64 dev/cuda/attention_v9.cu
//   ptxas (nvcc 13.0): 168 registers at launch (384 threads), no spills, no wgmma serialised;
//   setmaxnreg then gives the dQ warpgroup V9_REG_DQ = 64 and the consumers 216
//   (tests/test_hopper_compile.py checks every setting attention_bench.py times).
//
// k_attn_flash_bwd9: grid (B*NH, ceil(T/128)), V9_THREADS = 384 threads: two consumer warpgroups
// (64 keys each; K and V in shared memory for the whole block) and one dQ warpgroup, of which
// V9_BUFS warps work.
//   Query tiles of V9_BQ = 64 rows (Q, dO, lse, D streamed two deep by cp.async) are visited from
//   the LAST tile down to the block's diagonal. Per consumer warpgroup and tile, as version 7:
//     S^T, dP^T (ss), P^T, dV += P^T dO (rs), dS^T = P^T (dP^T - D), dK += dS^T Q (rs)
//   and then:
//     dS^T (16-bit, as the A fragments of dK's product) stored to a 128-byte swizzled tile
//     (rows = keys), a warpgroup barrier, dQ_w (64 x HS, fp32) = dS_w K_w  (ss, A = dS^T read
//     MN-major: the transpose flag of A; B = K MN-major), over the warpgroup's own 64 keys;
//     dQ_w written to shared-memory buffer t % V9_BUFS (the fragment order of the accumulator:
//     float4 j*128 + thread), a named-barrier arrive ("full" of that buffer).
//   dQ warp w takes the tiles t = w, w + V9_BUFS, ...: waits for "full", then, unless this block
//   is the tile's first contributor (key block 0), lane 0 spins on counters[bh][tile]
//   (ld.acquire.gpu) until it equals this block's key index j; then acc = dq_acc[bh][tile]
//   (float32, through L2) + dQ_0 + dQ_1, in that order; stores it back (if a later key block
//   contributes), then __syncwarp and lane 0's st.release counters = j + 1; or, as the tile's
//   last contributor (j = (q0 + 63) / 128), writes scale * acc into dqkv's Q slot (added to it
//   with accumulate) and resets the counter to 0. Then "free" for the buffer. So dq_acc needs no
//   zeroing (the first contributor writes it) and the counters are 0 after every launch (they
//   must be 0 before the first: the launcher allocates them zeroed), no second kernel.
//   The order of additions for query tile i is j = 0, 1, ..., (64 i + 63) / 128: fixed.
// Why it cannot hang: a block only ever waits on the block of the same head one key block
// lower, whose linear block index (blockIdx.y * gridDim.x + blockIdx.x) is smaller by gridDim.x;
// blocks are dispatched in increasing linear index, so when block (h, j) waits, (h, j - 1) is
// resident or finished; (h, 0) never waits, and inside a block the consumers wait only on the dQ
// warps ("free") and the dQ warps on the consumers ("full") and on the lower block: by induction
// on j every wait ends. (One more way to hang, found on the device: setmaxnreg.inc asking for
// more registers than the block holds; a static_assert below.) The tiles are walked last to
// first so that the key blocks of a head all start on the same tile and the lower block is ahead
// by about one tile; the consumers run up to V9_BUFS tiles ahead of the dQ warps.
//
// Measured (H200, attention_bench.py --variants v7,v8,v9,..., one process, ms for 12 / 6 layers;
// the FIRST build of this file, git 5adbee8: one dQ warpgroup of 128 threads took every tile in
// turn, each thread fenced (__threadfence) before the release, V9_BUFS = 2, 224 / 56 registers):
//   checks: every v9 setting against the float64 NumPy reference at T = 77, 130, 1000, fp16 and
//   bf16 (errors as version 7's: 3.7e-4 fp16, 3e-3 bf16), bit-identical reruns; attention_v9.py:
//   three runs bit-identical at the 12M, 120M and (B=3, NH=5, T=1000) shapes, 6e-6 to 9e-5 from
//   version 7 (relative, each of dQ, dK, dV).
//   120M (B=8, NH=12, T=1024) fp16 backward: version 7 2.298 (D 0.156, dQ 0.755, dK/dV 1.397);
//     version 9 3.642 (D 0.182, one-pass 3.464); three buffers 3.645; 40 registers for the dQ
//     warpgroup 3.709. bf16: version 7 2.287, version 9 3.626 (one-pass 3.446).
//   12M (B=32, NH=6, T=256): fp16 version 7 0.363 (dQ 0.110, dK/dV 0.179), version 9 0.415
//     (one-pass 0.363); bf16 0.358 against 0.415.
//   SDPA in the same run read cuDNN 0.627 + 3.126 ms and flash 0.924 + 4.823 at 120M fp16, well
//   above the 2.15 ms cuDNN backward of earlier runs on this GPU, while version 7 read as before:
//   not used for any ratio here.
// What stands in the way: the one-pass kernel took 3.46 ms where version 7's dK/dV kernel alone
// takes 1.40 and the extra dQ product is a quarter of its products; three buffers instead of two did
// not help, which points at the dQ warpgroup's throughput rather than at waiting for the lower
// block (not measured apart: the diagnostics settings, V9_DIAG, never ran): one tile's ordered
// addition (a 16 KB read of dq_acc through L2, 16 KB written back, every thread's membar.gl,
// the release) by one group of 128 threads, tile after tile, against the tile's products. The second build (this file:
// four dQ warps taking the tiles in turn, four buffers, one release per warp after __syncwarp)
// attacks that; on the device it hung at setmaxnreg.inc (224 + 64 registers asked, more than the
// 168 x 384 the block holds), fixed by the V9_REG_MMA formula and its static_assert, and was not
// run again (no device time left): its speed and correctness are not measured. Next, as
// FlashAttention-3 does: the addition done in L2 by one bulk reduction per tile
// (cp.reduce.async.bulk .add.f32 from the shared-memory partial, ordered by the same counters),
// which takes the 16 KB read and the per-thread stores off the dQ warps.
#include "attention_hopper.cu"

#if V7_WGMMA && HS == 64 && V7_SW
#define V9_BK 128                       // keys per block (two warpgroups of 64)
#define V9_BQ 64                        // queries per tile
#define V9_MMA 256                      // consumer threads
#define V9_THREADS (V9_MMA + 128)       // + the dQ warpgroup
#ifndef V9_REG_DQ
#define V9_REG_DQ 64                    // registers a thread: the dQ warpgroup gives back (setmaxnreg)
#endif
// The block starts with 168 registers a thread (65536 / 384, rounded down to 8: 64512 in all);
// setmaxnreg.inc waits until the pool has the registers asked for, so the consumers may take only
// what the dQ warpgroup gave back: 256 * V9_REG_MMA + 128 * V9_REG_DQ <= 64512 (asking for more
// hangs the block: the first build of the four dQ warps did, with 224 and 64).
#define V9_POOL (168 * V9_THREADS)
#define V9_REG_MMA ((V9_POOL - 128 * V9_REG_DQ) / 256 / 8 * 8)  // the consumers take the rest
static_assert(256 * V9_REG_MMA + 128 * V9_REG_DQ <= V9_POOL, "setmaxnreg: more registers than the block holds");
#ifndef V9_BUFS
#define V9_BUFS 4                       // dQ partial buffers = working warps of the dQ warpgroup
#endif
#if V9_BUFS < 1 || V9_BUFS > 4
#error "V9_BUFS: 1 to 4 (one warp of the dQ warpgroup a buffer)"
#endif
#ifndef V9_UNROLL
#define V9_UNROLL 8                     // float4 of dq_acc a dQ warp's lane loads at once
#endif
#ifndef V9_DIAG
#define V9_DIAG 0  // timing diagnostics only (dQ then wrong): 1 the dQ warps skip the wait and dq_acc; 2 also no dQ product
#endif
constexpr int v9_unroll = V9_UNROLL;  // (#pragma unroll expands no macro)
#define V9_PART (V9_BQ * HS)            // floats of one warpgroup's dQ partial
// K, V [V9_BK x HS]; Q, dO two deep [V9_BQ x HS]; dS^T per warpgroup [64 x V9_BQ] (16-bit, every
// tile 1024-byte aligned); dQ partials [V9_BUFS][2][V9_PART] float; lse, D two deep [V9_BQ] float
#define V9_SMEM (2 * V9_BK * HS * 2 + 4 * V9_BQ * HS * 2 + 2 * 64 * V9_BQ * 2 + V9_BUFS * 2 * V9_PART * 4 + 4 * V9_BQ * 4)
// named barriers (0 is __syncthreads, unused here): 1 the consumers, 2-3 one consumer warpgroup
// each, 4.. "full" per buffer, 4 + V9_BUFS.. "free" per buffer
#define V9_BAR_MMA 1
#define V9_BAR_WG 2
#define V9_BAR_FULL 4
#define V9_BAR_FREE (4 + V9_BUFS)
#define V9_PAIR (V9_MMA + 32)           // threads at a full / free barrier: the consumers and one dQ warp
#if V9_BAR_FREE + V9_BUFS > 16
#error "V9_BUFS: too many named barriers"
#endif

__device__ __forceinline__ void bar_sync9(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive9(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ int ld_acquire9(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release9(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// load_tile7 / load_row_values for the consumers only (V9_MMA threads; the dQ warp copies nothing)
template <int ROWS>
__device__ __forceinline__ void load9(u16* dst, const HT* base, int r0, int T, int ld) {
  for (int idx = threadIdx.x; idx < ROWS * 8; idx += V9_MMA) {
    int r = idx >> 3, c = idx & 7;
    bool ok = r0 + r < T;
    cp_async16(dst + r * 64 + ((c ^ (r & 7)) << 3), base + (ok ? (i64)(r0 + r) * ld + c * 8 : 0), ok);
  }
}
template <int ROWS>
__device__ __forceinline__ void load9_values(float* dst, const float* v, int r0, int T) {
  for (int i = threadIdx.x; i < ROWS; i += V9_MMA) cp_async4(dst + i, v + (r0 + i < T ? r0 + i : 0), r0 + i < T);
}

// acc (64 x 64) = A B over 16 rows of K a step, A and B both MN-major from shared memory (A read
// transposed: tnspA = 1), scale_d = 0 on the first step. Issues only.
__device__ __forceinline__ void ss9_tt(float* d, u64 da, u64 db, int scale_d) {
#define V9_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define V9_OUTS32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
  if (is_bf16<HT>::v)
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " V9_REGS32 ", %32, %33, p, 1, 1, 1, 1; }"
                 : V9_OUTS32
                 : "l"(da), "l"(db), "r"(scale_d));
  else
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " V9_REGS32 ", %32, %33, p, 1, 1, 1, 1; }"
                 : V9_OUTS32
                 : "l"(da), "l"(db), "r"(scale_d));
#undef V9_REGS32
#undef V9_OUTS32
}

// One query tile of one consumer warpgroup: its 64 keys (this thread: keys key0 + g and key0 + g
// + 8) against queries [q0, q0 + V9_BQ): dk, dv += as version 7's dkv7_tile (its dkv7_issue), and
// dq (64 x HS, written) = dS_w K_w through the warpgroup's dS^T tile ds (dkw: its K rows, MN-major).
static_assert(V9_BQ == V7_BQ, "dkv9_tile issues version 7's products (dkv7_issue) for V7_BQ queries");
template <bool MASK>
__device__ __forceinline__ void dkv9_tile(float* dk, float* dv, float* dq, u64 dkey, u64 dval, u64 dkw, u16* ds,
                                          const u16* Q, const u16* dO, const float* L, const float* Dt, int key0,
                                          int q0, int T, float sl2) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, warp = (threadIdx.x >> 5) & 3;
  unsigned sf[V9_BQ / 16][4];
  dkv7_issue<MASK>(dk, dv, sf, dkey, dval, Q, dO, L, Dt, key0, q0, T, sl2);
  // dS^T into ds: row r = this warp's key (16 warp + g, + 8), 16-byte chunk j (queries 8j..8j+7)
  // at chunk j ^ (r % 8); sf[kc] = rows g / g + 8, chunks 2kc / 2kc + 1, queries 2 t4, 2 t4 + 1
  {
    unsigned* row_g = (unsigned*)(ds + (16 * warp + g) * 64 + 2 * t4);
    unsigned* row_g8 = (unsigned*)(ds + (16 * warp + g + 8) * 64 + 2 * t4);
#pragma unroll
    for (int kc = 0; kc < V9_BQ / 16; ++kc) {
      row_g[(((2 * kc) ^ g) << 2)] = sf[kc][0];
      row_g8[(((2 * kc) ^ g) << 2)] = sf[kc][1];
      row_g[(((2 * kc + 1) ^ g) << 2)] = sf[kc][2];
      row_g8[(((2 * kc + 1) ^ g) << 2)] = sf[kc][3];
    }
  }
  fence_proxy_async();
  bar_sync9(V9_BAR_WG + (threadIdx.x >> 7), 128);
  u64 dds = desc7_mn(ds);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 64 / 16; ++kk) ss9_tt(dq, dds + (u64)(kk * V7_MNSTEP), dkw + (u64)(kk * V7_MNSTEP), kk);
  wgmma_commit();
  wgmma_wait_all();
  fence_regs<HS / 2>(dv);
  fence_regs<HS / 2>(dk);
  fence_regs<HS / 2>(dq);
}

// float4 f of a query tile's dQ so far: the workspace's (acc, unless this block is the tile's first
// contributor) + warpgroup 0's partial p0 + warpgroup 1's p1 (when it took part: a1), in that order.
__device__ __forceinline__ float4 dq_sum9(const float4* p0, const float4* p1, const float4* acc, int f, bool is_first,
                                          bool a1) {
  float4 v = p0[f];
  if (!is_first) {
    float4 a = __ldcg(acc + f);
    v = make_float4(a.x + v.x, a.y + v.y, a.z + v.z, a.w + v.w);
  }
  if (a1) {
    float4 w = p1[f];
    v = make_float4(v.x + w.x, v.y + w.y, v.z + w.z, v.w + w.w);
  }
  return v;
}

// Does warpgroup w of the block with keys from k0 take part in query tile q0 (uniform)?
__device__ __forceinline__ bool active9(int k0, int w, int q0, int T) {
  int wkey0 = k0 + 64 * w;
  return q0 + V9_BQ - 1 >= wkey0 && wkey0 < T;
}

// dqkv (B,T,3C) += [dQ | dK | dV] (accumulate = 0: written, not read): version 9, grid (B*NH,
// ceil(T/V9_BK)), block V9_THREADS, V9_SMEM bytes of dynamic shared memory (traps on anything
// else). dq_acc: float32 workspace of B*NH*ceil(T/V9_BQ)*V9_BQ*HS; counters: int32 of
// B*NH*ceil(T/V9_BQ), all 0 before the launch (and left 0 by it). D from k_attn_flash_D.
extern "C" __global__ void __launch_bounds__(V9_THREADS, 1) k_attn_flash_bwd9(HT* dqkv, float* dq_acc, int* counters,
                                                                            const HT* qkv, const HT* dout,
                                                                            const float* lse, const float* Dv,
                                                                            int B, int T, int NH, float scale,
                                                                            int accumulate) {
  extern __shared__ __align__(1024) u16 smem9[];
  u16* smem = smem9;
  require_smem(V9_SMEM);
  if (smem_u32(smem) & 1023) __trap();  // the swizzle is on address bits
  if (blockDim.x != V9_THREADS) __trap();
  u16* k_tile = smem;                             // [V9_BK x HS]
  u16* v_tile = k_tile + V9_BK * HS;              // [V9_BK x HS]
  u16* q_tiles = v_tile + V9_BK * HS;             // [2][V9_BQ x HS]
  u16* do_tiles = q_tiles + 2 * V9_BQ * HS;       // [2][V9_BQ x HS]
  u16* ds_tiles = do_tiles + 2 * V9_BQ * HS;      // [2 warpgroups][64 x V9_BQ]
  float* parts = (float*)(ds_tiles + 2 * 64 * V9_BQ);  // [V9_BUFS][2][V9_PART]
  float* lse_tiles = parts + V9_BUFS * 2 * V9_PART;    // [2][V9_BQ]
  float* d_tiles = lse_tiles + 2 * V9_BQ;              // [2][V9_BQ]
  int C = NH * HS, ld = 3 * C, bh = blockIdx.x, b = bh / NH, h = bh % NH;
  int j = blockIdx.y, k0 = j * V9_BK;
  int nq = (T - 1) / V9_BQ + 1, first = k0 / V9_BQ, n = nq - first;  // tiles nq - 1 down to first
  if (threadIdx.x >= V9_MMA) {
    // ------------------------------------------------ the dQ warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(V9_REG_DQ));
    int lane = threadIdx.x & 31, buf = (threadIdx.x - V9_MMA) >> 5;  // warp buf: tiles t = buf mod V9_BUFS
    if (buf >= V9_BUFS) return;
    for (int t = buf; t < n; t += V9_BUFS) {
      int qt = nq - 1 - t, q0 = qt * V9_BQ;
      bool is_first = j == 0, is_last = j == (q0 + V9_BQ - 1) / V9_BK;
      bool a1 = active9(k0, 1, q0, T);  // warpgroup 0 always takes part
      int* cnt = counters + (i64)bh * nq + qt;
      float4* acc = (float4*)(dq_acc + ((i64)bh * nq + qt) * V9_PART);
      const float4* p0 = (const float4*)(parts + buf * 2 * V9_PART);
      const float4* p1 = p0 + V9_PART / 4;
      bar_sync9(V9_BAR_FULL + buf, V9_PAIR);
      if (V9_DIAG) {
        if (t + V9_BUFS < n) bar_arrive9(V9_BAR_FREE + buf, V9_PAIR);
        continue;
      }
      if (!is_first) {
        if (lane == 0)
          while (ld_acquire9(cnt) != j) __nanosleep(32);
        __syncwarp();
      }
      if (!is_last) {
#pragma unroll v9_unroll
        for (int f = lane; f < V9_PART / 4; f += 32) {
          float4 v = dq_sum9(p0, p1, acc, f, is_first, a1);
          __stcg(acc + f, v);
        }
        __syncwarp();  // the warp's stores before lane 0's release (cumulative)
        if (lane == 0) st_release9(cnt, j + 1);
      } else {
        HT* base = dqkv + (i64)b * T * ld + h * HS;
#pragma unroll 4
        for (int f = lane; f < V9_PART / 4; f += 32) {
          float4 v = dq_sum9(p0, p1, acc, f, is_first, a1);
          // float4 f: accumulator entries 4 jj .. 4 jj + 3 of consumer thread tw (of warpgroup 0's
          // numbering): rows 16 warp + g and + 8, columns 8 jj + 2 t4, + 1
          int jj = f >> 7, tw = f & 127, g = (tw & 31) >> 2, t4 = tw & 3;
          int row = q0 + 16 * (tw >> 5) + g, col = 8 * jj + 2 * t4;
          float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (row + 8 * r >= T) continue;
            unsigned* p = (unsigned*)(base + (i64)(row + 8 * r) * ld + col);
            unsigned old = accumulate ? *p : 0u;
            HT lo, hi;
            lo.x = (u16)(old & 0xffffu);
            hi.x = (u16)(old >> 16);
            *p = pack2(to_f(lo) + scale * vals[2 * r], to_f(hi) + scale * vals[2 * r + 1]);
          }
        }
        if (!is_first && lane == 0) *cnt = 0;  // the last contributor: 0 for the next launch
      }
      if (t + V9_BUFS < n) bar_arrive9(V9_BAR_FREE + buf, V9_PAIR);
    }
    return;
  }
  // ------------------------------------------------ the consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(V9_REG_MMA));
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
  load9<V9_BK>(k_tile, kb, k0, T, ld);
  load9<V9_BK>(v_tile, vb, k0, T, ld);
  load9<V9_BQ>(q_tiles, qb, (nq - 1) * V9_BQ, T, ld);
  load9<V9_BQ>(do_tiles, ob, (nq - 1) * V9_BQ, T, C);
  load9_values<V9_BQ>(lse_tiles, lb, (nq - 1) * V9_BQ, T);
  load9_values<V9_BQ>(d_tiles, db, (nq - 1) * V9_BQ, T);
  cp_commit();
  u64 dkey = desc7_k(k_tile + 64 * wg * HS), dval = desc7_k(v_tile + 64 * wg * HS);
  u64 dkw = desc7_mn(k_tile + 64 * wg * HS);
  u16* ds = ds_tiles + wg * 64 * V9_BQ;
  float dk[HS / 2], dv[HS / 2], dq[HS / 2];
#pragma unroll
  for (int i = 0; i < HS / 2; ++i) dk[i] = dv[i] = 0.f;
  for (int t = 0; t < n; ++t) {
    int qt = nq - 1 - t, q0 = qt * V9_BQ, cur = t & 1, nb = cur ^ 1, buf = t % V9_BUFS;
    pipeline_copies(t + 1 < n, [&] {
      load9<V9_BQ>(q_tiles + nb * V9_BQ * HS, qb, q0 - V9_BQ, T, ld);
      load9<V9_BQ>(do_tiles + nb * V9_BQ * HS, ob, q0 - V9_BQ, T, C);
      load9_values<V9_BQ>(lse_tiles + nb * V9_BQ, lb, q0 - V9_BQ, T);
      load9_values<V9_BQ>(d_tiles + nb * V9_BQ, db, q0 - V9_BQ, T);
    });
    fence_proxy_async();
    bar_sync9(V9_BAR_MMA, V9_MMA);
    const u16* Q = q_tiles + cur * V9_BQ * HS;
    const u16* dO = do_tiles + cur * V9_BQ * HS;
    const float* L = lse_tiles + cur * V9_BQ;
    const float* Dt = d_tiles + cur * V9_BQ;
    bool act = active9(k0, wg, q0, T) && V9_DIAG < 2;
    if (act) {
      if (q0 < wkey0 + 63 || q0 + V9_BQ > T) dkv9_tile<true>(dk, dv, dq, dkey, dval, dkw, ds, Q, dO, L, Dt, key0, q0, T, sl2);
      else dkv9_tile<false>(dk, dv, dq, dkey, dval, dkw, ds, Q, dO, L, Dt, key0, q0, T, sl2);
    }
    if (t >= V9_BUFS) bar_sync9(V9_BAR_FREE + buf, V9_PAIR);  // dQ warp buf is done with tile t - V9_BUFS
    if (act) {
      float4* part = (float4*)(parts + (buf * 2 + wg) * V9_PART) + (threadIdx.x & 127);
#pragma unroll
      for (int jj = 0; jj < HS / 8; ++jj) part[jj * 128] = make_float4(dq[4 * jj], dq[4 * jj + 1], dq[4 * jj + 2], dq[4 * jj + 3]);
    }
    bar_arrive9(V9_BAR_FULL + buf, V9_PAIR);
    bar_sync9(V9_BAR_MMA, V9_MMA);  // every consumer is done with this tile's Q, dO buffers
  }
  HT* base = dqkv + (i64)b * T * ld + h * HS;
  store_rows(base + C, ld, (const float(*)[4])dk, key0, T, scale, accumulate);
  store_rows(base + 2 * C, ld, (const float(*)[4])dv, key0, T, 1.f, accumulate);
}
#endif  // V7_WGMMA && HS == 64 && V7_SW
