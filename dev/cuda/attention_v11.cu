// attention_v11.cu: version 11 of the backward, one pass (the package's attention_hopper.cu,
// included, plus k_attn_flash_bwd11 at the end). Versions 7 and 10 compute S and dP twice, once in
// the dQ kernel and once in the dK/dV kernel (7 products per key block and query tile); here the
// dK/dV kernel of version 7 (one warpgroup of 64 keys a block, three blocks a multiprocessor) also
// computes each query tile's dQ contribution dS K (5 products per pair) and adds it to the tile's
// float32 accumulator in L2, the key blocks of a query tile in a fixed order: no floating-point
// atomics whose order varies, the same inputs give the same bits.
//
// What is new against version 9 (a one-pass backward that lost, 3.64 ms against 2.30; git
// history): the ORDER of the additions. Block j (keys 64 j .. 64 j + 63) walks its query tiles from
// its diagonal up, qt = j, j + 1, ..., and the contributions to tile qt come in the order
// j = qt, qt - 1, ..., 0. Block j reaches tile qt at its step qt - j + 1; block j + 1, the one
// before it in the order, reached it at its step qt - j, a step earlier. So blocks that start
// together never wait on each other; version 9's order (j = 0, 1, ..., tiles walked down) made every
// block wait one hand-off on the block below at every tile, a chain as long as the head. Blocks are
// dispatched highest key block first (blockIdx.y = 0 is the last key block), so a block waits only
// on blocks dispatched before it, which never wait on a later one: it cannot hang. There is no dQ
// warpgroup: the block's own warpgroup does the product and the addition.
//
// Per query tile (64 queries), after version 7's products (dkv7_issue: S^T, dP^T, P^T, dV += P^T dO,
// dS^T, dK += dS^T Q):
//   dS^T (16-bit, the A fragments of dK's product) stored to a 128-byte swizzled tile (rows =
//   keys), a block barrier, dq (64 x HS fp32) = dS K (ss, A = dS^T read MN-major, the transpose
//   flag of A; B = K MN-major); every product waited for;
//   the tile's turn t = qt - j: t = 0 (the diagonal block, the first) stores dq into the tile's
//   accumulator (fragment order: float4 jj * 128 + thread, whole 16-byte stores); 0 < t, j > 0:
//   thread 0 waits (ld.acquire.gpu) until the tile's counter reads t, then every thread adds its
//   float4s into the accumulator by red.global.add.v4.f32 (done in L2, in the counter's order);
//   then a fence, a barrier and thread 0's st.release of t + 1. j = 0 (the last): after the wait
//   it reads the accumulator, adds dq, and writes scale * sum into dqkv's Q columns (added to them
//   with accumulate), then puts the counter back to 0 for the next launch.
// So the accumulator needs no zeroing (the first contributor writes it) and the counters are 0
// after every launch (the launcher allocates them zeroed once). D comes from k_attn_flash_D, launched
// before (version 4's one-thread-a-row kernel).
//
// Measured (H200, 2026-12-03, attention_v11.py --time, ms for 12 layers at 120M, fp16): the
// package's dQ + dK/dV 1.80; this kernel 2.51 (red.global.add), 2.40 (V11_BULK 1), 2.43 (V11_BULK 2),
// plus 0.12 for k_attn_flash_D; without the additions (V11_DIAG 2) 1.21, with plain stores and no
// fences (V11_DIAG 1) 1.59; a quarter of the bytes 2.37, the waits without additions 2.35. So the
// cost is neither the bytes nor the waiting but the per-tile fence on the block's path (suspected,
// not measured apart). Correct and bit-reproducible (attention_v11.py; attention_bench.py checks) in
// every form but V11_BULK 2, whose checks did not run after its shared-memory fix. Not promoted.
// V11_MEMBAR 0 and V11_DEFER 1 were built after the last device run: not run.
//
// Built for sm_90a (attention_v11.py: NVRTC, -DV6_SM90A), head size 64 only (the 128-byte swizzled
// tiles); elsewhere the file is attention_hopper.cu.
//   nvcc -std=c++17 -arch=sm_90a --cubin -Xptxas -v -Ikernels -DCT=f16 -DHS=64 dev/cuda/attention_v11.cu
#include "attention_hopper.cu"

#if V7_WGMMA && HS == 64 && V7_SW
#define V11_BQ 64  // queries a tile = keys a block
static_assert(V7_BQ == V11_BQ && V7_KWG == 1, "version 11 runs version 7's dK/dV products for 64 keys and 64 queries");
#ifndef V11_BLOCKS
#define V11_BLOCKS 3  // blocks a multiprocessor the registers are fitted to (__launch_bounds__)
#endif
#ifndef V11_DIAG
#define V11_DIAG 0  // timing diagnostics only (dQ then wrong): 1 no waits, plain stores for the adds;
                    // 2 no dQ accumulation at all; 3 also no dS^T tile and no dQ product; with V11_BULK,
                    // 4 (5) the ordered bulk additions of half (a quarter) of each tile's bytes; 6 the
                    // bulk additions without the waits (unordered); 7 the waits and releases without
                    // the bulk operations. Builds 4-7 spill more than the default (ptxas -v), and
                    // their times carry that
#endif
#ifndef V11_BULK
#define V11_BULK 0  // 1: the additions as one bulk copy / bulk reduction a tile (cp.reduce.async.bulk,
                    // done by the copy engine of the multiprocessor from a shared-memory stage), the
                    // release of a tile's counter deferred to the next tile; 2: the same a warp (each
                    // warp's quarter of the tile its own bulk operation and counter: no block barrier)
#endif
#ifndef V11_DEFER
#define V11_DEFER 0  // 1 (with V11_BULK 1): a tile's wait and bulk operation issued under the next tile's
                     // first products (S^T, dP^T in flight), its completion and release at that tile's end
#endif
#if V11_DEFER && V11_BULK != 1
#error "V11_DEFER needs V11_BULK=1"
#endif
#define V11_PART (V11_BQ * HS)  // floats of one query tile's dQ
// Counters a query tile: one, or with V11_BULK = 2 one a warp (each warp orders its own quarter)
#define V11_CNT (V11_BULK == 2 ? 4 : 1)
// The accumulator tile's float4 jj of thread tid: [jj][thread], or with V11_BULK = 2 [warp][jj][lane]
// (each warp's quarter 4 KB of contiguous bytes, one bulk operation)
__device__ __forceinline__ int f4_at(int jj, int tid) {
  return V11_BULK == 2 ? ((tid >> 5) * (HS / 8) + jj) * 32 + (tid & 31) : jj * 128 + tid;
}
// K, V [64 x HS]; Q, dO two deep [V11_BQ x HS]; dS^T [64 x V11_BQ] (16-bit, every tile 1024-byte
// aligned); with V11_BULK the dQ stage [V11_PART] float; lse, D two deep [V11_BQ] float
#define V11_SMEM (2 * 64 * HS * 2 + 4 * V11_BQ * HS * 2 + 64 * V11_BQ * 2 + (V11_BULK ? 1 : 0) * V11_PART * 4 + 4 * V11_BQ * 4)

__device__ __forceinline__ int ld_acquire11(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release11(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// *p += v, element by element, performed in L2 (no value returned)
__device__ __forceinline__ void red_add4(float4* p, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

// Bulk copies of the shared-memory stage to global memory (16-byte aligned, size a multiple of 16),
// one bulk group each, issued by one thread
__device__ __forceinline__ void bulk_store11(float* g, const float* st, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(g), "r"(smem_u32(st)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_add11(float* g, const float* st, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(g),
               "r"(smem_u32(st)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Every bulk group of this thread complete (its writes performed), ordered before what follows;
// with V11_MEMBAR a membar.gl too (0: the st.release that follows is the only fence at gpu scope,
// and the ld.acquire of a wait the only one after it; the reductions of the default form keep theirs)
#ifndef V11_MEMBAR
#define V11_MEMBAR 1
#endif
__device__ __forceinline__ void bulk_done11() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  if (V11_MEMBAR) __threadfence();
}

// acc (64 x 64) = A B over 16 rows of K a step, A and B both MN-major from shared memory (A read
// transposed: tnspA = 1), scale_d = 0 on the first step. Issues only.
__device__ __forceinline__ void ss11_tt(float* d, u64 da, u64 db, int scale_d) {
#define V11_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define V11_OUTS32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
  if (is_bf16<HT>::v)
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " V11_REGS32 ", %32, %33, p, 1, 1, 1, 1; }"
                 : V11_OUTS32
                 : "l"(da), "l"(db), "r"(scale_d));
  else
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " V11_REGS32 ", %32, %33, p, 1, 1, 1, 1; }"
                 : V11_OUTS32
                 : "l"(da), "l"(db), "r"(scale_d));
#undef V11_REGS32
#undef V11_OUTS32
}

// One query tile: dk, dv += as version 7's dkv7_tile (its dkv7_issue), and dq (64 x HS, written) =
// dS K through the dS^T tile ds (dkw: the block's K rows read MN-major); hook: dkv7_issue's. Every
// product waited for.
template <bool MASK, class Hook>
__device__ __forceinline__ void dkv11_tile(float* dk, float* dv, float* dq, u64 dkey, u64 dval, u64 dkw, u16* ds,
                                           const u16* Q, const u16* dO, const float* L, const float* Dt, int key0,
                                           int q0, int T, float sl2, Hook hook) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, warp = (threadIdx.x >> 5) & 3;
  unsigned sf[V11_BQ / 16][4];
  dkv7_issue<MASK>(dk, dv, sf, dkey, dval, Q, dO, L, Dt, key0, q0, T, sl2, hook);
  if (V11_DIAG >= 3) {
    wgmma_wait_all();
    fence_regs<HS / 2>(dv);
    fence_regs<HS / 2>(dk);
    return;
  }
  // dS^T into ds: row r = this warp's key (16 warp + g, + 8), 16-byte chunk c (queries 8c..8c+7)
  // at chunk c ^ (r % 8); sf[kc] = rows g / g + 8, chunks 2kc / 2kc + 1, queries 2 t4, 2 t4 + 1
  {
    unsigned* row_g = (unsigned*)(ds + (16 * warp + g) * 64 + 2 * t4);
    unsigned* row_g8 = (unsigned*)(ds + (16 * warp + g + 8) * 64 + 2 * t4);
#pragma unroll
    for (int kc = 0; kc < V11_BQ / 16; ++kc) {
      row_g[((2 * kc) ^ g) << 2] = sf[kc][0];
      row_g8[((2 * kc) ^ g) << 2] = sf[kc][1];
      row_g[((2 * kc + 1) ^ g) << 2] = sf[kc][2];
      row_g8[((2 * kc + 1) ^ g) << 2] = sf[kc][3];
    }
  }
  fence_proxy_async();
  __syncthreads();  // the whole dS^T tile written (one warpgroup a block)
  u64 dds = desc7_mn(ds);
  fence_regs<HS / 2>(dq);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 64 / 16; ++kk) ss11_tt(dq, dds + (u64)(kk * V7_MNSTEP), dkw + (u64)(kk * V7_MNSTEP), kk);
  wgmma_commit();
  wgmma_wait_all();
  fence_regs<HS / 2>(dv);
  fence_regs<HS / 2>(dk);
  fence_regs<HS / 2>(dq);
}

// The issuing thread's turn on cnt: it waits until the counter reads turn (turn 0: the first, no
// wait), then adds nbytes of the stage at src into dst by one bulk reduction (turn 0: copies them);
// the counter is released later, once the operation is complete (release11)
__device__ __forceinline__ void bulk_turn11(float* dst, const float* src, int nbytes, int* cnt, int turn,
                                            int*& pend_cnt, int& pend_turn) {
  if (turn > 0) {
    if (V11_DIAG != 6)
      while (ld_acquire11(cnt) != turn) __nanosleep(20);
    asm volatile("fence.proxy.async.global;" ::: "memory");
    if (V11_DIAG != 7) bulk_add11(dst, src, nbytes);
  } else if (V11_DIAG != 7) {
    bulk_store11(dst, src, nbytes);
  }
  pend_cnt = cnt;
  pend_turn = turn;
}

// The issuing thread's pending bulk operation (if any) complete, and its counter released
__device__ __forceinline__ void release11(int*& pend_cnt, int pend_turn) {
  if (pend_cnt) {
    bulk_done11();
    st_release11(pend_cnt, pend_turn + 1);
    pend_cnt = nullptr;
  }
}

// Accumulator entries 4 jj .. 4 jj + 3 of this thread as one float4
__device__ __forceinline__ float4 dq4(const float* dq, int jj) {
  return make_float4(dq[4 * jj], dq[4 * jj + 1], dq[4 * jj + 2], dq[4 * jj + 3]);
}

// Query tile qt's dQ: this block's dq added in its turn (above). acc: the tile's V11_PART floats,
// cnt: its counter; turn = qt - j; last: j == 0.
__device__ __forceinline__ void dq11_add(float* dq, float4* acc, int* cnt, int turn, bool last, HT* qcols, int ld,
                                         int row0, int T, float scale, int accumulate, float4* stage,
                                         int*& pend_cnt, int& pend_turn) {
  int tid = threadIdx.x;
  constexpr int bytes = V11_PART * 4 >> (V11_DIAG == 4 || V11_DIAG == 5 ? V11_DIAG - 3 : 0);
  if (V11_BULK && !last && (V11_DIAG == 0 || V11_DIAG >= 4)) {
    // the previous tile's bulk operation done (it read the stage; its counter released), then this
    // one's: the block's tile by thread 0 (V11_BULK 1), or each warp's quarter by its lane 0, ordered
    // by the warp's own counter (2)
    constexpr bool WARP = V11_BULK == 2;
    bool issuer = WARP ? (tid & 31) == 0 : tid == 0;
    if (issuer) release11(pend_cnt, pend_turn);
    if (WARP) __syncwarp();
    else __syncthreads();
#pragma unroll
    for (int jj = 0; jj < HS / 8; ++jj) stage[f4_at(jj, tid)] = dq4(dq, jj);
    fence_proxy_async();  // the stage's writes visible to the bulk operation
    if (WARP) __syncwarp();
    else __syncthreads();
    if (issuer)
      bulk_turn11((float*)(acc + f4_at(0, tid)), (const float*)(stage + f4_at(0, tid)), WARP ? bytes / 4 : bytes,
                  cnt + (WARP ? tid >> 5 : 0), turn, pend_cnt, pend_turn);
    return;
  }
  if (V11_DIAG == 2 || V11_DIAG == 3) return;
  if (V11_DIAG == 1) {
#pragma unroll
    for (int jj = 0; jj < HS / 8; ++jj)
      __stcg(acc + jj * 128 + tid, dq4(dq, jj));
    return;
  }
  if (turn > 0 && V11_DIAG != 6) {  // wait for the contributions before this one
    if (V11_BULK == 2) {  // (the last contributor) each warp its quarter
      if ((tid & 31) == 0) {
        while (ld_acquire11(cnt + (tid >> 5)) != turn) __nanosleep(20);
        if (V11_MEMBAR) __threadfence();
      }
      __syncwarp();
    } else {
      if (tid == 0) {
        while (ld_acquire11(cnt) != turn) __nanosleep(20);
        if (V11_MEMBAR) __threadfence();  // (the acquire is the fence that is needed)
      }
      __syncthreads();
    }
  }
  if (last) {
    if (turn > 0) {
#pragma unroll
      for (int jj = 0; jj < HS / 8; ++jj) {
        float4 a = __ldcg(acc + f4_at(jj, tid));
        dq[4 * jj] = a.x + dq[4 * jj];
        dq[4 * jj + 1] = a.y + dq[4 * jj + 1];
        dq[4 * jj + 2] = a.z + dq[4 * jj + 2];
        dq[4 * jj + 3] = a.w + dq[4 * jj + 3];
      }
      if (V11_BULK == 2 && (tid & 31) == 0) cnt[tid >> 5] = 0;  // for the next launch
      if (V11_BULK != 2 && tid == 0) *cnt = 0;  // (every contributor is done with it)
    }
    store_rows(qcols, ld, (const float(*)[4])dq, row0, T, scale, accumulate);
    return;
  }
  if (turn == 0) {
#pragma unroll
    for (int jj = 0; jj < HS / 8; ++jj)
      __stcg(acc + jj * 128 + tid, dq4(dq, jj));
  } else {
#pragma unroll
    for (int jj = 0; jj < HS / 8; ++jj)
      red_add4(acc + jj * 128 + tid, dq4(dq, jj));
  }
  __threadfence();  // this thread's part of the tile performed before the release
  __syncthreads();
  if (tid == 0) st_release11(cnt, turn + 1);
}

// dqkv (B,T,3C) += [dQ | dK | dV] (accumulate = 0: written, not read): version 11, grid (B*NH,
// ceil(T/64)), block 128, V11_SMEM bytes of dynamic shared memory (traps on anything else).
// dq_acc: float32 workspace of B*NH*ceil(T/64)*V11_PART; counters: int32 of B*NH*ceil(T/64), all 0
// before the launch (and left 0 by it). D (B*NH, T) from k_attn_flash_D.
extern "C" __global__ void __launch_bounds__(128, V11_BLOCKS) k_attn_flash_bwd11(HT* dqkv, float* dq_acc, int* counters,
                                                                               const HT* qkv, const HT* dout,
                                                                               const float* lse, const float* Dv,
                                                                               int B, int T, int NH, float scale,
                                                                               int accumulate) {
  pdl_wait();
  extern __shared__ __align__(1024) u16 smem11[];
  u16* smem = smem11;
  require_smem(V11_SMEM);
  if (smem_u32(smem) & 1023) __trap();  // the swizzle is on address bits
  if (blockDim.x != 128) __trap();
  u16* k_tile = smem;                           // [64 x HS]
  u16* v_tile = k_tile + 64 * HS;               // [64 x HS]
  u16* q_tiles = v_tile + 64 * HS;              // [2][V11_BQ x HS]
  u16* do_tiles = q_tiles + 2 * V11_BQ * HS;    // [2][V11_BQ x HS]
  u16* ds = do_tiles + 2 * V11_BQ * HS;         // [64 x V11_BQ]
  float4* stage = (float4*)(ds + 64 * V11_BQ);    // [V11_PART / 4] with V11_BULK
  float* lse_tiles = (float*)(ds + 64 * V11_BQ) + (V11_BULK ? 1 : 0) * V11_PART;  // [2][V11_BQ]
  float* d_tiles = lse_tiles + 2 * V11_BQ;        // [2][V11_BQ]
  int C = NH * HS, ld = 3 * C, bh = blockIdx.x, b = bh / NH, h = bh % NH;
  int nq = (T - 1) / V11_BQ + 1;
  int j = nq - 1 - blockIdx.y, k0 = j * 64;  // the last key block first: a block waits only on earlier ones
  int warp = (threadIdx.x >> 5) & 3;
  int key0 = k0 + 16 * warp;  // this warp's first key
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  const HT* ob = dout + (i64)b * T * C + h * HS;
  const float* lb = lse + (i64)bh * T;
  const float* db = Dv + (i64)bh * T;
  float sl2 = scale * LOG2E;
  load_tile7<64, 128>(k_tile, kb, k0, T, ld);
  load_tile7<64, 128>(v_tile, vb, k0, T, ld);
  load_tile7<V11_BQ, 128>(q_tiles, qb, k0, T, ld);
  load_tile7<V11_BQ, 128>(do_tiles, ob, k0, T, C);
  load_row_values<V11_BQ>(lse_tiles, lb, k0, T);
  load_row_values<V11_BQ>(d_tiles, db, k0, T);
  cp_commit();
  u64 dkey = desc7_k(k_tile), dval = desc7_k(v_tile), dkw = desc7_mn(k_tile);
  HT* qcols = dqkv + (i64)b * T * ld + h * HS;
  float dk[HS / 2], dv[HS / 2], dq[HS / 2];
  int* pend_cnt = nullptr;  // V11_BULK: the counter thread 0 (2: each lane 0) has still to release
  int pend_turn = 0;
  // V11_DEFER: the stage holds the previous tile's dq (its turn, its tile index), not yet issued
  bool have_prev = false;
  int prev_turn = 0;
  i64 prev_tile = 0;
  // thread 0: the previous tile's wait and bulk operation; the hook of dkv7_issue (the warp leaves
  // it converged: the wgmma wait after it is warp-aligned)
  auto issue_prev = [&] {
    if (!V11_DEFER) return;
    if (have_prev && threadIdx.x == 0)
      bulk_turn11(dq_acc + prev_tile * V11_PART, (const float*)stage, V11_PART * 4, counters + prev_tile, prev_turn,
                  pend_cnt, pend_turn);
    __syncwarp();
  };
#pragma unroll
  for (int i = 0; i < HS / 2; ++i) dk[i] = dv[i] = 0.f;
  for (int qt = j; qt < nq; ++qt) {  // from the diagonal up
    int q0 = qt * V11_BQ, cur = (qt - j) & 1, nb = cur ^ 1;
    pipeline_wait_async(qt + 1 < nq, [&] {
      load_tile7<V11_BQ, 128>(q_tiles + nb * V11_BQ * HS, qb, q0 + V11_BQ, T, ld);
      load_tile7<V11_BQ, 128>(do_tiles + nb * V11_BQ * HS, ob, q0 + V11_BQ, T, C);
      load_row_values<V11_BQ>(lse_tiles + nb * V11_BQ, lb, q0 + V11_BQ, T);
      load_row_values<V11_BQ>(d_tiles + nb * V11_BQ, db, q0 + V11_BQ, T);
    });
    const u16* Q = q_tiles + cur * V11_BQ * HS;
    const u16* dO = do_tiles + cur * V11_BQ * HS;
    const float* L = lse_tiles + cur * V11_BQ;
    const float* Dt = d_tiles + cur * V11_BQ;
    if (qt == j || q0 + V11_BQ > T)
      dkv11_tile<true>(dk, dv, dq, dkey, dval, dkw, ds, Q, dO, L, Dt, key0, q0, T, sl2, issue_prev);
    else dkv11_tile<false>(dk, dv, dq, dkey, dval, dkw, ds, Q, dO, L, Dt, key0, q0, T, sl2, issue_prev);
    i64 tile = (i64)bh * nq + qt;
    if (V11_DEFER && j > 0) {
      // the bulk operation issued under this tile's products complete: its counter released; then
      // the stage takes this tile's dq, issued under the next tile's products (or after the loop)
      if (threadIdx.x == 0) release11(pend_cnt, pend_turn);
      __syncthreads();
#pragma unroll
      for (int jj = 0; jj < HS / 8; ++jj) stage[jj * 128 + threadIdx.x] = dq4(dq, jj);
      fence_proxy_async();  // visible to the bulk operation (after the barrier below)
      have_prev = true;
      prev_turn = qt - j;
      prev_tile = tile;
    } else {
      dq11_add(dq, (float4*)(dq_acc + tile * V11_PART), counters + tile * V11_CNT, qt - j, j == 0, qcols, ld,
               q0 + 16 * warp, T, scale, accumulate, stage, pend_cnt, pend_turn);
    }
    __syncthreads();  // every thread is done with this tile's Q, dO, dS^T buffers
  }
  issue_prev();  // V11_DEFER: the last tile's
  if (V11_BULK) release11(pend_cnt, pend_turn);  // thread 0's, or with V11_BULK = 2 each lane 0's
  store_rows(qcols + C, ld, (const float(*)[4])dk, key0, T, scale, accumulate);
  store_rows(qcols + 2 * C, ld, (const float(*)[4])dv, key0, T, 1.f, accumulate);
}
#endif  // V7_WGMMA && HS == 64 && V7_SW
