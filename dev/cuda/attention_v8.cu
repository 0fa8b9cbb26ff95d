// attention_v8.cu: the package's andrea/kernels/attention_hopper.cu (version 7's wgmma backward, and
// through it attention.cu) with a Hopper forward, version 8. Built for sm_90a (attention_v8.py, or
// -DV6_SM90A with nvcc -arch=sm_90a), k_attn_flash_fwd computes S = Q K^T and O += P V with
// wgmma.mma_async; for any other target it is version 4's forward. Same arguments, outputs and
// semantics as version 4's: out (B,T,C) and lse (B*NH, T) from qkv (B,T,3C), causal, any T, fp16
// and bf16, every head size that is a multiple of 16 up to 128, deterministic (fixed order, no
// atomics).
//
// What changes against version 6 (dev/cuda's first wgmma forward, no faster than version 4):
// - Q, K and V tiles in the 128-byte swizzled layout at head size 64 (version 7's load_tile7 and
//   descriptors), the core-matrix layout elsewhere.
// - V8_WG consumer warpgroups of 64 query rows a block (3: 192 rows), keys in tiles of V8_BN (128
//   up to head size 64, else 64); every thread copies (cp.async), no producer warpgroup.
// - Inside a warpgroup (V8_OVERLAP), the product of the previous tile's P with its V runs while
//   this tile's softmax is computed: at key tile j a warpgroup issues S_j = Q K_j^T, then
//   O += P_{j-1} V_{j-1}, waits for S_j only, computes the softmax of S_j (new row maxima, P_j in
//   fp32), then waits for O, rescales it and rounds P_j into the A fragments of the next tile's
//   product. So K and V are staged three deep: at step j the block reads K_j and V_{j-1} while
//   K_{j+1} and V_{j+1} are copied in; one barrier a step.
// - The longest query tiles launch first (as versions 4 and 6).
// Not done: TMA loads, a producer warpgroup with mbarriers and setmaxnreg, ping-pong scheduling
// of the two softmaxes across warpgroups, swizzled tiles at head sizes other than 64.
//
// Where wgmma is compiled in, version 4's forward is renamed out of the way and version 8 takes its
// name; elsewhere the file is attention_hopper.cu.
#if defined(__CUDA_ARCH__) && (defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(V6_SM90A)) && (!defined(HS) || (HS % 16 == 0 && HS <= 128))
#define V8_WGMMA 1
#else
#define V8_WGMMA 0
#endif
#ifndef V8_WG
#define V8_WG 3  // consumer warpgroups (64 query rows each) a block
#endif
#define V8_BM (64 * V8_WG)  // query rows a block
#define V8_THREADS (128 * V8_WG)
#ifndef V8_BN
#define V8_BN (HS <= 64 ? 128 : 64)  // keys a tile
#endif
#ifndef V8_OVERLAP
#define V8_OVERLAP 1  // 0: S_j, its softmax, then O += P_j V_j, each waited for in turn
#endif
#ifndef V8_BLOCKS
#define V8_BLOCKS 1  // blocks a multiprocessor the compiler fits the registers to (__launch_bounds__)
#endif
#ifndef V8_STAGES
#define V8_STAGES 3  // K and V tiles staged at once
#endif
// Key tiles being copied while a step computes: the stages not read by it (K_j and V_j, or with the
// overlap K_j and V_{j-1})
#define V8_AHEAD (V8_STAGES - 1 - (V8_OVERLAP ? 1 : 0))
#if V8_AHEAD < 1 || V8_AHEAD > 3
#error "V8_STAGES: 2 to 4 without V8_OVERLAP, 3 to 5 with it"
#endif
// Dynamic shared memory (attention_v8.py asks the same): Q, then K and V V8_STAGES deep.
#define V8_SMEM (V8_BM * HS * 2 + 2 * V8_STAGES * V8_BN * HS * 2)

#if V8_WGMMA
#define k_attn_flash_fwd k_attn_flash_fwd_v4
#endif
#include "attention_hopper.cu"
#if V8_WGMMA
#undef k_attn_flash_fwd
#endif

#if V8_WGMMA
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
extern "C" __global__ void __launch_bounds__(V8_THREADS, V8_BLOCKS) k_attn_flash_fwd(HT* out, float* lse, const HT* qkv,
                                                                                   int B, int T, int NH, float scale) {
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
  load_tile7<V8_BM>(q_tile, qb, q0, T, ld);
#pragma unroll
  for (int i = 0; i < V8_AHEAD; ++i) {
    if (i < n_tiles) {
      load_tile7<V8_BN>(k_tiles + i * V8_BN * HS, kb, i * V8_BN, T, ld);
      load_tile7<V8_BN>(v_tiles + i * V8_BN * HS, vb, i * V8_BN, T, ld);
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
        load_tile7<V8_BN>(k_tiles + nb * V8_BN * HS, kb, k0 + V8_AHEAD * V8_BN, T, ld);
        load_tile7<V8_BN>(v_tiles + nb * V8_BN * HS, vb, k0 + V8_AHEAD * V8_BN, T, ld);
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
}
#endif  // V8_WGMMA
