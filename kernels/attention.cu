// attention.cu: causal multi-head attention. Two versions; the launcher (andrea/backends/cuda.py)
// picks version 4 (fused, further down) for 16-bit dtypes, head sizes that are multiples of 16 up
// to 128 and GPUs of compute capability 8.0 or later; version 1 otherwise.
//
// Version 1 materialises the scores of one layer: S = Q K^T / sqrt(hs) is a strided
// batched GEMM into a float32 (B*NH, T, T) workspace, k_attn_softmax turns it into P (compute
// dtype) and saves lse, and Y = P V is a second GEMM. The workspace is shared by all layers (the
// backward pass recomputes P from S and lse), so memory grows as B*NH*T*T once, not per layer.
// Backward: S again, P again, dV = P^T dY, dP = dY V^T (into the S workspace), k_attn_dscores
// turns P into dS = P * (dP - D) / sqrt(hs) in place (D = rowsum(dY * Y), as flash attention),
// then dQ = dS K and dK = dS^T Q. The head split (B,T,3C) -> (B,NH,T,hs) and the merges are the
// small permute kernels below. Scores above the diagonal are computed by the GEMM and ignored.
#include "common.cuh"

// The four permutes below run one block per (b, t) row (blocks stride over rows) and threads over
// its channels, so the index arithmetic is 32-bit; head h, channel d of a row sit at h*hs + d.
#define HEAD_IDX(b, h, t, d) ((((i64)(b) * NH + (h)) * T + (t)) * hs + (d))

// q, k, v (B*NH, T, hs) <- qkv (B, T, 3C), C = NH * hs.
extern "C" __global__ void k_attn_split_heads(CT* q, CT* k, CT* v, const CT* qkv, int B, int T, int NH, int hs) {
  pdl_wait();
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    const CT* src = qkv + (i64)bt * 3 * C;
    for (int col = threadIdx.x; col < 3 * C; col += blockDim.x) {
      int which = col / C, h = (col % C) / hs, d = col % hs;
      CT* dst = which == 0 ? q : (which == 1 ? k : v);
      dst[HEAD_IDX(b, h, t, d)] = src[col];
    }
  }
}

// out (B, T, C) <- y (B*NH, T, hs).
extern "C" __global__ void k_attn_merge_heads(CT* out, const CT* y, int B, int T, int NH, int hs) {
  pdl_wait();
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    for (int col = threadIdx.x; col < C; col += blockDim.x)
      out[(i64)bt * C + col] = y[HEAD_IDX(b, col / hs, t, col % hs)];
  }
}

// dy (B*NH, T, hs) <- dout (B, T, C).
extern "C" __global__ void k_attn_split_dout(CT* dy, const CT* dout, int B, int T, int NH, int hs) {
  pdl_wait();
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    for (int col = threadIdx.x; col < C; col += blockDim.x)
      dy[HEAD_IDX(b, col / hs, t, col % hs)] = dout[(i64)bt * C + col];
  }
}

// dqkv (B, T, 3C) += [dq | dk | dv], each float32 (B*NH, T, hs); accumulate = 0: dqkv = (not read).
extern "C" __global__ void k_attn_merge_grads(CT* dqkv, const float* dq, const float* dk, const float* dv,
                                              int B, int T, int NH, int hs, int accumulate) {
  pdl_wait();
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    CT* dst = dqkv + (i64)bt * 3 * C;
    for (int col = threadIdx.x; col < 3 * C; col += blockDim.x) {
      int which = col / C, h = (col % C) / hs, d = col % hs;
      const float* src = which == 0 ? dq : (which == 1 ? dk : dv);
      dst[col] = from_f<CT>((accumulate ? to_f(dst[col]) : 0.f) + src[HEAD_IDX(b, h, t, d)]);
    }
  }
}

// One warp per score row (rows = B*NH*T, query i = row % T). S already holds the scaled scores.
// write_lse = 1 (forward): finds lse over j <= i in one online pass and saves it; 0 (backward):
// reads the saved lse. Then P[j] = exp(S[j] - lse) for j <= i and 0 above the diagonal.
extern "C" __global__ void k_attn_softmax(CT* P, float* lse, const float* S, i64 rows, int T, int write_lse) {
  pdl_wait();
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  int i = (int)(row % T);
  const float* s = S + row * T;
  float L;
  if (write_lse) {
    float m = NEG_INF, z = 0.f;
    for (int j = lane; j <= i; j += 32) {
      float v = s[j];
      if (v > m) { z = z * expf(m - v) + 1.f; m = v; } else { z += expf(v - m); }
    }
    warp_softmax_state(m, z);
    L = m + logf(z);
    if (lane == 0) lse[row] = L;
  } else {
    L = lse[row];
  }
  CT* p = P + row * T;
  for (int j = lane; j < T; j += 32) p[j] = from_f<CT>(j <= i ? expf(s[j] - L) : 0.f);
}

// P (holding probabilities) becomes dS = P * (dP - D) * scale in place, for j <= i (entries above
// the diagonal are already 0). D = sum over the head's hs channels of dout * out at (b, i).
extern "C" __global__ void k_attn_dscores(CT* P, const float* dP, const CT* dout, const CT* out,
                                          i64 rows, int T, int NH, int hs, float scale) {
  pdl_wait();
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  int i = (int)(row % T);
  i64 bh = row / T;
  int h = (int)(bh % NH);
  i64 b = bh / NH;
  i64 o = (b * T + i) * (i64)(NH * hs) + (i64)h * hs;
  float D = 0.f;
  for (int d = lane; d < hs; d += 32) D += to_f(dout[o + d]) * to_f(out[o + d]);
  D = warp_sum(D);
  CT* p = P + row * T;
  const float* dp = dP + row * T;
  for (int j = lane; j <= i; j += 32) p[j] = from_f<CT>(to_f(p[j]) * (dp[j] - D) * scale);
}

// ================================================================ version 4: fused (flash) path
// Causal flash attention on tensor cores through mma.sync (sm_80 and later),
// laid out as FlashAttention-2 lays out its kernels; the scores never reach global memory.
// Versions 2 and 3 are in git history (dev/cuda/attention_bench.py
// checks and times the versions against PyTorch SDPA). What changed from version 3:
// - Shared-memory fragments come through ldmatrix (x4: four 8x8 matrices per instruction; the
//   .trans form gives the B operand of P V, dS K and P^T dO straight from row-major tiles), not
//   32-bit and 16-bit scalar loads.
// - Forward: 128 query rows per block when HS <= 64 (4 warps of 32 rows: each K/V fragment
//   read from shared memory feeds two tensor-core products), 64 when larger.
// - exp2 with log2(e) folded into the scale (one FFMA + MUFU.EX2 per score).
// - Only tiles that cross the diagonal (or the end of the sequence) are masked; a warp whose rows
//   are all above or all below a tile skips it.
// - The heaviest tiles (most keys in the forward pass and dQ, most queries in dK/dV) launch first,
//   so the last wave is made of short blocks.
// - Backward without atomics, as before: k_attn_flash_bwd_dq owns query rows, k_attn_flash_bwd_dkv
//   owns key rows; both recompute P from Q, K and the saved lse; the softmax scale is applied to
//   dQ and dK once at the end.
// Tiles are staged by cp.async, two deep, through one helper (pipeline_wait).
//
// mma.sync m16n8k16 register layouts (PTX manual), lane = 4*g + t4:
//   A (16x16 row-major): a0 = A[g][2t4..], a1 = A[g+8][2t4..], a2 = A[g][8+2t4..], a3 = A[g+8][8+2t4..]
//   B (16x8, "col"):     b0 = B[2t4..2t4+1][g], b1 = B[8+2t4..][g]
//   C (16x8 fp32):       c0, c1 = C[g][2t4], C[g][2t4+1]; c2, c3 = the same at row g+8
// so a C tile of scores becomes the A operand of the next product in registers.

#ifndef HS
#define HS 64
#endif
#define SP 8                      // row padding (16-bit elements): ldmatrix rows land on different banks
#define LDS (HS + SP)             // row stride of a staged tile
#define BN 64                     // keys per tile (forward, dQ); keys per block (dK/dV)
#define FWD_WM (HS <= 64 ? 2 : 1)  // 16-row slabs per warp in the forward pass
#define FWD_BM (64 * FWD_WM)      // query rows per forward block (4 warps)
#define DQ_BM 64                  // query rows per dQ block (4 warps of 16)
#define DKV_BQ (HS <= 64 ? 64 : 32)  // queries per streamed tile in dK/dV
#define DKV_KV_REGS (HS <= 64)    // dK/dV keeps its K and V fragments in registers (else re-reads them)
#define LOG2E 1.4426950408889634f

typedef unsigned short u16;
template <typename T> struct half_of { typedef T t; };
template <> struct half_of<float> { typedef f16 t; };  // float builds compile, never launch, this path
typedef half_of<CT>::t HT;
template <typename T> struct is_bf16 { static const bool v = false; };
template <> struct is_bf16<bf16> { static const bool v = true; };

// Dynamic shared memory of each kernel, in bytes (the launcher asks for the same figures).
#define FWD_SMEM ((FWD_BM + 4 * BN) * LDS * 2)
#define DQ_SMEM ((2 * DQ_BM + 4 * BN) * LDS * 2)
#define DKV_SMEM ((2 * BN + 4 * DKV_BQ) * LDS * 2 + 4 * DKV_BQ * 4)

// ---------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned s;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(p));
  return s;
}
__device__ __forceinline__ void ldsm_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  if (is_bf16<HT>::v)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float fast_exp2(float x) {  // MUFU.EX2; exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  return (unsigned)from_f<HT>(lo).x | ((unsigned)from_f<HT>(hi).x << 16);
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(smem)), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(smem)), "l"(gmem), "r"(valid ? 4 : 0));
}
// Every kernel below first checks that the launcher gave it the dynamic shared memory it carves up.
__device__ __forceinline__ void require_smem(unsigned bytes) {
  unsigned have;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
  if (have < bytes) __trap();
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_wait_all_but_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// ---------------------------------------------------------------- tiles
// Start copying rows [r0, r0 + ROWS) of one head's slice (element (t, d) at base[t * ld + d]) into
// the row-major tile dst[ROWS][LDS], 16 bytes per copy; rows at or past T are zero-filled.
// Needs base, ld and HS in whole 16-byte units (the launcher checks).
template <int ROWS>
__device__ __forceinline__ void load_tile(u16* dst, const HT* base, int r0, int T, int ld) {
  for (int idx = threadIdx.x; idx < ROWS * (HS / 8); idx += blockDim.x) {
    int r = idx / (HS / 8), c = (idx % (HS / 8)) * 8;
    bool ok = r0 + r < T;
    cp_async16(dst + r * LDS + c, base + (ok ? (i64)(r0 + r) * ld + c : 0), ok);
  }
}
// ROWS floats v[r0 + i] (0 past T) into dst[i].
template <int ROWS>
__device__ __forceinline__ void load_row_values(float* dst, const float* v, int r0, int T) {
  for (int i = threadIdx.x; i < ROWS; i += blockDim.x) cp_async4(dst + i, v + (r0 + i < T ? r0 + i : 0), r0 + i < T);
}

// The double-buffered pipeline of every kernel here: step i computes on buffer i & 1. Before it
// does, issue() starts the copies of step i + 1 into the other buffer (when there is one), then
// this waits for step i's copies and for every thread's. Each step ends with __syncthreads() so
// that the next step's copies never overwrite a buffer still being read.
template <typename Issue>
__device__ __forceinline__ void pipeline_copies(bool has_next, Issue issue) {  // this thread's part
  if (has_next) {
    issue();
    cp_commit();
    cp_wait_all_but_one();
  } else {
    cp_wait_all();
  }
}
template <typename Issue>
__device__ __forceinline__ void pipeline_wait(bool has_next, Issue issue) {
  pipeline_copies(has_next, issue);
  __syncthreads();
}

// A fragments (16 rows from row0, all HS columns) of a staged tile.
__device__ __forceinline__ void load_afrag(unsigned (*f)[4], const u16* tile, int row0) {
  int lane = threadIdx.x & 31;
  unsigned base = smem_u32(tile + (row0 + (lane & 15)) * LDS + (lane >> 4) * 8);
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk) ldsm_x4(f[kk], base + kk * 32);
}

// acc[m][NT/8][4] = A_m (16 x HS) @ Y^T, Y a staged tile [NT][LDS]: WM slabs of 16 rows x NT columns.
template <int WM, int NT>
__device__ __forceinline__ void rows_dot(float (*acc)[NT / 8][4], const unsigned (*a)[HS / 16][4], const u16* Y) {
  int lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m < WM; ++m)
#pragma unroll
    for (int n8 = 0; n8 < NT / 8; ++n8) acc[m][n8][0] = acc[m][n8][1] = acc[m][n8][2] = acc[m][n8][3] = 0.f;
  unsigned base = smem_u32(Y + ((lane & 7) + ((lane >> 4) << 3)) * LDS + ((lane >> 3) & 1) * 8);
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk)
#pragma unroll
    for (int n16 = 0; n16 < NT / 16; ++n16) {
      unsigned b[4];
      ldsm_x4(b, base + (n16 * 16 * LDS + kk * 16) * 2);
#pragma unroll
      for (int m = 0; m < WM; ++m) {
        mma16816(acc[m][2 * n16], a[m][kk], b[0], b[1]);
        mma16816(acc[m][2 * n16 + 1], a[m][kk], b[2], b[3]);
      }
    }
}

// out[m][HS/8][4] += P_m (16 x NT, C-layout floats, rounded to HT here) @ Z, Z a staged tile [NT][LDS].
template <int WM, int NT>
__device__ __forceinline__ void p_dot(float (*out)[HS / 8][4], const float (*p)[NT / 8][4], const u16* Z) {
  int lane = threadIdx.x & 31;
  unsigned base = smem_u32(Z + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);
#pragma unroll
  for (int kc = 0; kc < NT / 16; ++kc) {
    unsigned a[WM][4];
#pragma unroll
    for (int m = 0; m < WM; ++m) {
      a[m][0] = pack2(p[m][2 * kc][0], p[m][2 * kc][1]);
      a[m][1] = pack2(p[m][2 * kc][2], p[m][2 * kc][3]);
      a[m][2] = pack2(p[m][2 * kc + 1][0], p[m][2 * kc + 1][1]);
      a[m][3] = pack2(p[m][2 * kc + 1][2], p[m][2 * kc + 1][3]);
    }
#pragma unroll
    for (int n16 = 0; n16 < HS / 16; ++n16) {
      unsigned b[4];
      ldsm_x4_t(b, base + (kc * 16 * LDS + n16 * 16) * 2);
#pragma unroll
      for (int m = 0; m < WM; ++m) {
        mma16816(out[m][2 * n16], a[m], b[0], b[1]);
        mma16816(out[m][2 * n16 + 1], a[m], b[2], b[3]);
      }
    }
  }
}

template <int WM>
__device__ __forceinline__ void zero_acc(float (*acc)[HS / 8][4]) {
#pragma unroll
  for (int m = 0; m < WM; ++m)
#pragma unroll
    for (int n8 = 0; n8 < HS / 8; ++n8) acc[m][n8][0] = acc[m][n8][1] = acc[m][n8][2] = acc[m][n8][3] = 0.f;
}

// dst (16-bit, row stride ld) += scale * acc for this warp's 16 rows from row0 (rows >= T skipped),
// two elements per 32-bit access; ACC false: dst = scale * acc, dst not read (the same bits as
// adding into zeros, but for the sign of a zero). store_rows picks the instance once per launch.
template <bool ACC>
__device__ __forceinline__ void add_rows(HT* dst, i64 ld, const float (*acc)[4], int row0, int T, float scale) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int row = row0 + g + 8 * r;
    if (row >= T) continue;
    unsigned* p = (unsigned*)(dst + row * ld + 2 * t4);
#pragma unroll
    for (int n8 = 0; n8 < HS / 8; ++n8) {
      unsigned old = ACC ? p[n8 * 4] : 0u;
      HT lo, hi;
      lo.x = (u16)(old & 0xffffu);
      hi.x = (u16)(old >> 16);
      p[n8 * 4] = pack2(to_f(lo) + scale * acc[n8][2 * r], to_f(hi) + scale * acc[n8][2 * r + 1]);
    }
  }
}

__device__ __forceinline__ void store_rows(HT* dst, i64 ld, const float (*acc)[4], int row0, int T, float scale,
                                           int accumulate) {
  if (accumulate) add_rows<true>(dst, ld, acc, row0, T, scale);
  else add_rows<false>(dst, ld, acc, row0, T, scale);
}

// ---------------------------------------------------------------- forward
// One forward tile: scores of this warp's rows against keys [k0, k0 + BN), online softmax, O += P V.
template <bool MASK>
__device__ __forceinline__ void fwd_tile(float (*o)[HS / 8][4], float (*m)[2], float (*l)[2],
                                         const unsigned (*qf)[HS / 16][4], const u16* K, const u16* V,
                                         int row0, int k0, int T, float sl2) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float s[FWD_WM][BN / 8][4];
  rows_dot<FWD_WM, BN>(s, qf, K);
#pragma unroll
  for (int i = 0; i < FWD_WM; ++i) {
    float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n8 = 0; n8 < BN / 8; ++n8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (MASK) {
          int key = k0 + n8 * 8 + 2 * t4 + (e & 1), row = row0 + i * 16 + g + 8 * (e >> 1);
          if (key > row || key >= T) s[i][n8][e] = NEG_INF;
        }
        tmax[e >> 1] = fmaxf(tmax[e >> 1], s[i][n8][e]);
      }
    float alpha[2], ms[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the 4 lanes of a group hold one row between them
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
      float mn = fmaxf(m[i][r], tmax[r]);
      ms[r] = mn == NEG_INF ? 0.f : mn * sl2;  // a row with no key yet keeps exp2(-inf) = 0
      alpha[r] = fast_exp2(m[i][r] * sl2 - ms[r]);
      m[i][r] = mn;
      l[i][r] *= alpha[r];
    }
#pragma unroll
    for (int n8 = 0; n8 < BN / 8; ++n8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = fast_exp2(fmaf(s[i][n8][e], sl2, -ms[e >> 1]));
        s[i][n8][e] = p;
        l[i][e >> 1] += p;
      }
#pragma unroll
    for (int n8 = 0; n8 < HS / 8; ++n8) {
      o[i][n8][0] *= alpha[0]; o[i][n8][1] *= alpha[0]; o[i][n8][2] *= alpha[1]; o[i][n8][3] *= alpha[1];
    }
  }
  p_dot<FWD_WM, BN>(o, s, V);
}

// out (B,T,C) and lse (B*NH, T) from qkv (B,T,3C). grid (B*NH, ceil(T/FWD_BM)), block 128,
// FWD_SMEM bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(128) k_attn_flash_fwd(HT* out, float* lse, const HT* qkv,
                                                                   int B, int T, int NH, float scale) {
  pdl_wait();
  extern __shared__ __align__(16) u16 smem[];
  require_smem(FWD_SMEM);
  u16* q_tile = smem;                   // [FWD_BM][LDS], read once into registers
  u16* k_tiles = q_tile + FWD_BM * LDS;  // [2][BN][LDS]
  u16* v_tiles = k_tiles + 2 * BN * LDS;  // [2][BN][LDS]
  int C = NH * HS, ld = 3 * C, bh = blockIdx.x, b = bh / NH, h = bh % NH;
  int q0 = (gridDim.y - 1 - blockIdx.y) * FWD_BM;  // the longest rows first
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  int row0 = q0 + warp * 16 * FWD_WM;  // this warp's first row
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  float sl2 = scale * LOG2E;
  int n_tiles = (min(q0 + FWD_BM, T) - 1) / BN + 1;  // causal: keys up to the block's last query
  load_tile<FWD_BM>(q_tile, qb, q0, T, ld);
  load_tile<BN>(k_tiles, kb, 0, T, ld);
  load_tile<BN>(v_tiles, vb, 0, T, ld);
  cp_commit();
  unsigned qf[FWD_WM][HS / 16][4];
  float m[FWD_WM][2], l[FWD_WM][2], o[FWD_WM][HS / 8][4];
#pragma unroll
  for (int i = 0; i < FWD_WM; ++i) m[i][0] = m[i][1] = NEG_INF, l[i][0] = l[i][1] = 0.f;
  zero_acc<FWD_WM>(o);
  for (int kt = 0; kt < n_tiles; ++kt) {
    int k0 = kt * BN, nb = (kt + 1) & 1;
    pipeline_wait(kt + 1 < n_tiles, [&] {
      load_tile<BN>(k_tiles + nb * BN * LDS, kb, k0 + BN, T, ld);
      load_tile<BN>(v_tiles + nb * BN * LDS, vb, k0 + BN, T, ld);
    });
    if (kt == 0)
#pragma unroll
      for (int i = 0; i < FWD_WM; ++i) load_afrag(qf[i], q_tile, row0 - q0 + i * 16);
    const u16* K = k_tiles + (kt & 1) * BN * LDS;
    const u16* V = v_tiles + (kt & 1) * BN * LDS;
    if (k0 <= row0 + 16 * FWD_WM - 1) {  // else every key of the tile is after this warp's rows
      if (k0 + BN - 1 > row0 || k0 + BN > T) fwd_tile<true>(o, m, l, qf, K, V, row0, k0, T, sl2);
      else fwd_tile<false>(o, m, l, qf, K, V, row0, k0, T, sl2);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < FWD_WM; ++i) {
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[i][r] += __shfl_xor_sync(0xffffffffu, l[i][r], 1);
      l[i][r] += __shfl_xor_sync(0xffffffffu, l[i][r], 2);
      inv[r] = 1.f / l[i][r];
      int row = row0 + i * 16 + g + 8 * r;
      if (t4 == 0 && row < T) lse[(i64)bh * T + row] = m[i][r] * scale + logf(l[i][r]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int row = row0 + i * 16 + g + 8 * r;
      if (row >= T) continue;
      unsigned* p = (unsigned*)(out + ((i64)b * T + row) * C + h * HS + 2 * t4);
#pragma unroll
      for (int n8 = 0; n8 < HS / 8; ++n8) p[n8 * 4] = pack2(o[i][n8][2 * r] * inv[r], o[i][n8][2 * r + 1] * inv[r]);
    }
  }
}

// ---------------------------------------------------------------- backward
// D (B*NH, T) = rowsum(dout * out) per head. One thread per head row r = (b*T + i)*NH + h, in
// memory order, so a warp reads consecutive rows, each as HS / 8 16-byte vectors (version 4,
// in git history, took a warp per row with 2-byte loads; 4% slower in k_attn_bwd on an H200).
extern "C" __global__ void k_attn_flash_D(float* Dv, const HT* dout, const HT* out, int B, int T, int NH) {
  pdl_wait();
  i64 r = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  if (r >= (i64)B * NH * T) return;
  int h = (int)(r % NH);
  i64 bi = r / NH;
  int i = (int)(bi % T);
  i64 b = bi / T;
  const vec16* d = (const vec16*)(dout + r * HS);
  const vec16* o = (const vec16*)(out + r * HS);
  float D = 0.f;
#pragma unroll
  for (int q = 0; q < HS / 8; ++q) {
    vec16 dv = d[q], ov = o[q];
#pragma unroll
    for (int e = 0; e < 8; ++e) D += to_f(((const HT*)&dv)[e]) * to_f(((const HT*)&ov)[e]);
  }
  Dv[(b * NH + h) * T + i] = D;
}

// One dQ tile: S = Q K^T, dP = dO V^T for this warp's 16 rows and keys [k0, k0 + BN);
// dS' = P (dP - D) (the scale comes at the end); dQ += dS' K.
template <bool MASK>
__device__ __forceinline__ void dq_tile(float (*dq)[HS / 8][4], const unsigned (*qf)[HS / 16][4],
                                        const unsigned (*df)[HS / 16][4], const u16* K, const u16* V,
                                        const float* L2, const float* D, int row0, int k0, int T, float sl2) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float s[1][BN / 8][4], dp[1][BN / 8][4];
  rows_dot<1, BN>(s, qf, K);
  rows_dot<1, BN>(dp, df, V);
#pragma unroll
  for (int n8 = 0; n8 < BN / 8; ++n8)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int r = e >> 1;
      float p = fast_exp2(fmaf(s[0][n8][e], sl2, -L2[r]));
      if (MASK) {
        int key = k0 + n8 * 8 + 2 * t4 + (e & 1);
        if (key > row0 + g + 8 * r || key >= T) p = 0.f;
      }
      s[0][n8][e] = p * (dp[0][n8][e] - D[r]);
    }
  p_dot<1, BN>(dq, s, K);
}

// dQ part of dqkv += ...: one block per DQ_BM query rows of one head. grid (B*NH, ceil(T/DQ_BM)),
// block 128, DQ_SMEM bytes of dynamic shared memory. accumulate = 0: dQ written (store_rows).
extern "C" __global__ void __launch_bounds__(128) k_attn_flash_bwd_dq(HT* dqkv, const HT* qkv, const HT* dout,
                                                                      const float* lse, const float* Dv,
                                                                      int B, int T, int NH, float scale,
                                                                      int accumulate) {
  pdl_wait();
  extern __shared__ __align__(16) u16 smem[];
  require_smem(DQ_SMEM);
  u16* q_tile = smem;                      // [DQ_BM][LDS], read once into registers
  u16* do_tile = q_tile + DQ_BM * LDS;     // [DQ_BM][LDS], likewise
  u16* k_tiles = do_tile + DQ_BM * LDS;    // [2][BN][LDS]
  u16* v_tiles = k_tiles + 2 * BN * LDS;   // [2][BN][LDS]
  int C = NH * HS, ld = 3 * C, bh = blockIdx.x, b = bh / NH, h = bh % NH;
  int q0 = (gridDim.y - 1 - blockIdx.y) * DQ_BM;  // the longest rows first
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  int row0 = q0 + warp * 16;
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  const HT* ob = dout + (i64)b * T * C + h * HS;
  float sl2 = scale * LOG2E, L2[2], D[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int row = row0 + g + 8 * r;
    L2[r] = row < T ? lse[(i64)bh * T + row] * LOG2E : 0.f;
    D[r] = row < T ? Dv[(i64)bh * T + row] : 0.f;
  }
  int n_tiles = (min(q0 + DQ_BM, T) - 1) / BN + 1;
  load_tile<DQ_BM>(q_tile, qb, q0, T, ld);
  load_tile<DQ_BM>(do_tile, ob, q0, T, C);
  load_tile<BN>(k_tiles, kb, 0, T, ld);
  load_tile<BN>(v_tiles, vb, 0, T, ld);
  cp_commit();
  unsigned qf[1][HS / 16][4], df[1][HS / 16][4];
  float dq[1][HS / 8][4];
  zero_acc<1>(dq);
  for (int kt = 0; kt < n_tiles; ++kt) {
    int k0 = kt * BN, nb = (kt + 1) & 1;
    pipeline_wait(kt + 1 < n_tiles, [&] {
      load_tile<BN>(k_tiles + nb * BN * LDS, kb, k0 + BN, T, ld);
      load_tile<BN>(v_tiles + nb * BN * LDS, vb, k0 + BN, T, ld);
    });
    if (kt == 0) {
      load_afrag(qf[0], q_tile, row0 - q0);
      load_afrag(df[0], do_tile, row0 - q0);
    }
    const u16* K = k_tiles + (kt & 1) * BN * LDS;
    const u16* V = v_tiles + (kt & 1) * BN * LDS;
    if (k0 <= row0 + 15) {
      if (k0 + BN - 1 > row0 || k0 + BN > T) dq_tile<true>(dq, qf, df, K, V, L2, D, row0, k0, T, sl2);
      else dq_tile<false>(dq, qf, df, K, V, L2, D, row0, k0, T, sl2);
    }
    __syncthreads();
  }
  store_rows(dqkv + (i64)b * T * ld + h * HS, ld, dq[0], row0, T, scale, accumulate);
}

// One dK/dV tile: S^T = K Q^T, dP^T = V dO^T for this warp's 16 keys and queries [q0, q0 + DKV_BQ);
// dV += P^T dO, dK += dS'^T Q (the scale comes at the end).
template <bool MASK>
__device__ __forceinline__ void dkv_tile(float (*dk)[HS / 8][4], float (*dv)[HS / 8][4],
                                         const unsigned (*kf)[HS / 16][4], const unsigned (*vf)[HS / 16][4],
                                         const u16* Q, const u16* dO, const float* L, const float* Dt,
                                         int key0, int q0, int T, float sl2) {
  int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float s[1][DKV_BQ / 8][4], dp[1][DKV_BQ / 8][4];
  rows_dot<1, DKV_BQ>(s, kf, Q);
  rows_dot<1, DKV_BQ>(dp, vf, dO);
#pragma unroll
  for (int n8 = 0; n8 < DKV_BQ / 8; ++n8)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int qc = n8 * 8 + 2 * t4 + (e & 1);
      float p = fast_exp2(fmaf(s[0][n8][e], sl2, -L[qc] * LOG2E));
      if (MASK) {
        int q = q0 + qc;
        if (q < key0 + g + 8 * (e >> 1) || q >= T) p = 0.f;
      }
      s[0][n8][e] = p;
      dp[0][n8][e] = p * (dp[0][n8][e] - Dt[qc]);
    }
  p_dot<1, DKV_BQ>(dv, s, dO);
  p_dot<1, DKV_BQ>(dk, dp, Q);
}

// dK and dV parts of dqkv += ...: one block per BN keys of one head, streaming the query tiles at
// or after them. grid (B*NH, ceil(T/BN)), block 128, DKV_SMEM bytes of dynamic shared memory.
// accumulate = 0: dK and dV written (store_rows).
extern "C" __global__ void __launch_bounds__(128) k_attn_flash_bwd_dkv(HT* dqkv, const HT* qkv, const HT* dout,
                                                                       const float* lse, const float* Dv,
                                                                       int B, int T, int NH, float scale,
                                                                       int accumulate) {
  pdl_wait();
  extern __shared__ __align__(16) u16 smem[];
  require_smem(DKV_SMEM);
  u16* k_tile = smem;                      // [BN][LDS]
  u16* v_tile = k_tile + BN * LDS;         // [BN][LDS]
  u16* q_tiles = v_tile + BN * LDS;        // [2][DKV_BQ][LDS]
  u16* do_tiles = q_tiles + 2 * DKV_BQ * LDS;  // [2][DKV_BQ][LDS]
  float* lse_tiles = (float*)(do_tiles + 2 * DKV_BQ * LDS);  // [2][DKV_BQ]
  float* d_tiles = lse_tiles + 2 * DKV_BQ;                   // [2][DKV_BQ]
  int C = NH * HS, ld = 3 * C, bh = blockIdx.x, b = bh / NH, h = bh % NH;
  int k0 = blockIdx.y * BN;  // the first keys see the most queries: they go first
  int warp = threadIdx.x >> 5;
  int key0 = k0 + warp * 16;
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  const HT* ob = dout + (i64)b * T * C + h * HS;
  const float* lb = lse + (i64)bh * T;
  const float* db = Dv + (i64)bh * T;
  float sl2 = scale * LOG2E;
  int first = k0 / DKV_BQ, n_tiles = (T - 1) / DKV_BQ + 1;
  load_tile<BN>(k_tile, kb, k0, T, ld);
  load_tile<BN>(v_tile, vb, k0, T, ld);
  load_tile<DKV_BQ>(q_tiles, qb, first * DKV_BQ, T, ld);
  load_tile<DKV_BQ>(do_tiles, ob, first * DKV_BQ, T, C);
  load_row_values<DKV_BQ>(lse_tiles, lb, first * DKV_BQ, T);
  load_row_values<DKV_BQ>(d_tiles, db, first * DKV_BQ, T);
  cp_commit();
  unsigned kf[1][HS / 16][4], vf[1][HS / 16][4];
  float dk[1][HS / 8][4], dv[1][HS / 8][4];
  zero_acc<1>(dk);
  zero_acc<1>(dv);
  for (int qt = first; qt < n_tiles; ++qt) {
    int q0 = qt * DKV_BQ, cur = (qt - first) & 1, nb = cur ^ 1;
    pipeline_wait(qt + 1 < n_tiles, [&] {
      load_tile<DKV_BQ>(q_tiles + nb * DKV_BQ * LDS, qb, q0 + DKV_BQ, T, ld);
      load_tile<DKV_BQ>(do_tiles + nb * DKV_BQ * LDS, ob, q0 + DKV_BQ, T, C);
      load_row_values<DKV_BQ>(lse_tiles + nb * DKV_BQ, lb, q0 + DKV_BQ, T);
      load_row_values<DKV_BQ>(d_tiles + nb * DKV_BQ, db, q0 + DKV_BQ, T);
    });
    if (DKV_KV_REGS ? qt == first : true) {  // fragments of K and V: once, or every step to save registers
      load_afrag(kf[0], k_tile, key0 - k0);
      load_afrag(vf[0], v_tile, key0 - k0);
    }
    const u16* Q = q_tiles + cur * DKV_BQ * LDS;
    const u16* dO = do_tiles + cur * DKV_BQ * LDS;
    const float* L = lse_tiles + cur * DKV_BQ;
    const float* Dt = d_tiles + cur * DKV_BQ;
    if (q0 + DKV_BQ - 1 >= key0) {  // else every query of the tile is before this warp's keys
      if (q0 < key0 + 15 || q0 + DKV_BQ > T) dkv_tile<true>(dk, dv, kf, vf, Q, dO, L, Dt, key0, q0, T, sl2);
      else dkv_tile<false>(dk, dv, kf, vf, Q, dO, L, Dt, key0, q0, T, sl2);
    }
    __syncthreads();
  }
  HT* base = dqkv + (i64)b * T * ld + h * HS;
  store_rows(base + C, ld, dk[0], key0, T, scale, accumulate);
  store_rows(base + 2 * C, ld, dv[0], key0, T, 1.f, accumulate);
}
