// attention_v3.cu: kernels/attention.cu as it was before version 4 (kept to time
// against it until version 4 has won, measured). Two versions; the launcher (andrea/backends/cuda.py)
// picks version 3 (fused, further down) for 16-bit dtypes and head sizes 16..64, version 1 else.
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
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    for (int col = threadIdx.x; col < C; col += blockDim.x)
      out[(i64)bt * C + col] = y[HEAD_IDX(b, col / hs, t, col % hs)];
  }
}

// dy (B*NH, T, hs) <- dout (B, T, C).
extern "C" __global__ void k_attn_split_dout(CT* dy, const CT* dout, int B, int T, int NH, int hs) {
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    for (int col = threadIdx.x; col < C; col += blockDim.x)
      dy[HEAD_IDX(b, col / hs, t, col % hs)] = dout[(i64)bt * C + col];
  }
}

// dqkv (B, T, 3C) += [dq | dk | dv], each float32 (B*NH, T, hs).
extern "C" __global__ void k_attn_merge_grads(CT* dqkv, const float* dq, const float* dk, const float* dv,
                                              int B, int T, int NH, int hs) {
  int C = NH * hs;
  for (int bt = blockIdx.x; bt < B * T; bt += gridDim.x) {
    int b = bt / T, t = bt % T;
    CT* dst = dqkv + (i64)bt * 3 * C;
    for (int col = threadIdx.x; col < 3 * C; col += blockDim.x) {
      int which = col / C, h = (col % C) / hs, d = col % hs;
      const float* src = which == 0 ? dq : (which == 1 ? dk : dv);
      dst[col] = from_f<CT>(to_f(dst[col]) + src[HEAD_IDX(b, h, t, d)]);
    }
  }
}

// One warp per score row (rows = B*NH*T, query i = row % T). S already holds the scaled scores.
// write_lse = 1 (forward): finds lse over j <= i in one online pass and saves it; 0 (backward):
// reads the saved lse. Then P[j] = exp(S[j] - lse) for j <= i and 0 above the diagonal.
extern "C" __global__ void k_attn_softmax(CT* P, float* lse, const float* S, i64 rows, int T, int write_lse) {
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

// ================================================================ version 3: fused (flash) path
// For 16-bit compute dtypes and head sizes that are multiples of 16 up to 64 (HS, set by the
// launcher with -DHS=...): the scores never reach global memory. Tensor-core tiles through the PTX
// instruction mma.sync m16n8k16 (fp32 accumulation), whose register layouts the PTX manual fixes:
//   A (16x16, row-major), lane = 4*g + t4: reg0 = A[g][2t4..2t4+1], reg1 = A[g+8][2t4..],
//     reg2 = A[g][8+2t4..], reg3 = A[g+8][8+2t4..]
//   B (16x8, "col"): reg0 = B[2t4..2t4+1][g], reg1 = B[8+2t4..][g]
//   C (16x8 fp32): c0, c1 = C[g][2t4], C[g][2t4+1]; c2, c3 = C[g+8][2t4], C[g+8][2t4+1]
// so a C tile of scores becomes the A operand of the next product in registers (as FlashAttention-2).
// A block is 4 warps; each warp owns 16 rows of a 64-row tile and loops over 64-row tiles of the
// other side, staged row-major in shared memory by cp.async, two buffers deep (the next tile loads
// while this one computes). Forward: one pass with the online softmax (running row max m, sum l,
// O rescaled when m grows). Backward, without atomics: k_attn_flash_bwd_dq owns query rows
// (dQ += dS K), k_attn_flash_bwd_dkv owns key rows (dV += P^T dO, dK += dS^T Q); both recompute
// P from Q, K and the saved lse. (Version 2, kept in git history, staged transposed copies with
// plain loads and took two passes forward: 0.7 ms forward + 1.6 ms backward per layer at B=8,
// T=1024, 12 heads of 64 on the H200.)
#ifndef HS
#define HS 64
#endif
#define FT 64  // rows per tile, both sides (4 warps x 16)
#define SP 8   // shared-memory row padding in 16-bit elements: rows land on different banks
#define TS (FT * (HS + SP))  // elements of one staged tile

template <typename T> struct half_of { typedef T t; };
template <> struct half_of<float> { typedef f16 t; };  // float builds compile, never launch, this path
typedef half_of<CT>::t HT;
template <typename T> struct is_bf16 { static const bool v = false; };
template <> struct is_bf16<bf16> { static const bool v = true; };

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  return (unsigned)from_f<HT>(lo).x | ((unsigned)from_f<HT>(hi).x << 16);
}
// two consecutive 16-bit elements of one row
__device__ __forceinline__ unsigned ld2(const unsigned short* t, int row, int col) {
  return *(const unsigned*)(t + row * (HS + SP) + col);
}
// the same column of two consecutive rows (a B operand along the rows of a row-major tile)
__device__ __forceinline__ unsigned ld2t(const unsigned short* t, int row, int col) {
  return (unsigned)t[row * (HS + SP) + col] | ((unsigned)t[(row + 1) * (HS + SP) + col] << 16);
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

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_wait_all_but_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Start copying rows [r0, r0 + FT) of one head's slice (element (t, d) at base[t * ld + d]) into
// the row-major tile dst[FT][HS+SP], 16 bytes per copy; rows at or past T are zero-filled.
// Needs base, ld and HS in whole 16-byte units (the launcher checks C % 8 == 0).
__device__ __forceinline__ void flash_load(unsigned short* dst, const HT* base, int r0, int T, int ld) {
  for (int idx = threadIdx.x; idx < FT * (HS / 8); idx += blockDim.x) {
    int r = idx / (HS / 8), c = (idx % (HS / 8)) * 8;
    bool ok = r0 + r < T;
    cp_async16(dst + r * (HS + SP) + c, base + (ok ? (i64)(r0 + r) * ld + c : 0), ok);
  }
}

// A fragments of this warp's 16 rows (starting at R) over all HS columns of a staged tile.
__device__ __forceinline__ void flash_afrag(unsigned (*f)[4], const unsigned short* t, int R, int g, int t4) {
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk) {
    f[kk][0] = ld2(t, R + g, kk * 16 + 2 * t4);
    f[kk][1] = ld2(t, R + g + 8, kk * 16 + 2 * t4);
    f[kk][2] = ld2(t, R + g, kk * 16 + 8 + 2 * t4);
    f[kk][3] = ld2(t, R + g + 8, kk * 16 + 8 + 2 * t4);
  }
}

// acc[FT/8][4] = A (16 x HS, fragments) @ Y^T for a staged tile Y[FT][HS]: 16 rows x FT columns.
__device__ __forceinline__ void flash_rows_dot(float (*acc)[4], const unsigned (*a)[4], const unsigned short* Y,
                                               int g, int t4) {
#pragma unroll
  for (int n8 = 0; n8 < FT / 8; ++n8) { acc[n8][0] = acc[n8][1] = acc[n8][2] = acc[n8][3] = 0.f; }
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk)
#pragma unroll
    for (int n8 = 0; n8 < FT / 8; ++n8)
      mma16816(acc[n8], a[kk], ld2(Y, n8 * 8 + g, kk * 16 + 2 * t4), ld2(Y, n8 * 8 + g, kk * 16 + 8 + 2 * t4));
}

// out[HS/8][4] += P (16 x FT, C-layout floats, rounded to HT here) @ Z for a staged tile Z[FT][HS].
__device__ __forceinline__ void flash_p_dot(float (*out)[4], const float (*p)[4], const unsigned short* Z,
                                            int g, int t4) {
#pragma unroll
  for (int kc = 0; kc < FT / 16; ++kc) {
    unsigned a[4] = {pack2(p[2 * kc][0], p[2 * kc][1]), pack2(p[2 * kc][2], p[2 * kc][3]),
                     pack2(p[2 * kc + 1][0], p[2 * kc + 1][1]), pack2(p[2 * kc + 1][2], p[2 * kc + 1][3])};
#pragma unroll
    for (int n8 = 0; n8 < HS / 8; ++n8)
      mma16816(out[n8], a, ld2t(Z, kc * 16 + 2 * t4, n8 * 8 + g), ld2t(Z, kc * 16 + 8 + 2 * t4, n8 * 8 + g));
  }
}

__device__ __forceinline__ void zero_acc(float (*acc)[4]) {
#pragma unroll
  for (int n8 = 0; n8 < HS / 8; ++n8) acc[n8][0] = acc[n8][1] = acc[n8][2] = acc[n8][3] = 0.f;
}

// out (B,T,C) and lse (B*NH, T) from qkv (B,T,3C). grid (ceil(T/FT), B*NH), block 128.
extern "C" __global__ void __launch_bounds__(128) k_attn_flash_fwd(HT* out, float* lse, const HT* qkv,
                                                                   int B, int T, int NH, float scale) {
  __shared__ __align__(16) unsigned short Ks[2 * TS];
  __shared__ __align__(16) unsigned short Vs[2 * TS];
  int C = NH * HS, ld = 3 * C, bh = blockIdx.y, b = bh / NH, h = bh % NH, q0 = blockIdx.x * FT;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, R = warp * 16;
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  unsigned qf[HS / 16][4];
  flash_load(Ks, qb, q0, T, ld);
  cp_commit();
  cp_wait_all();
  __syncthreads();
  flash_afrag(qf, Ks, R, g, t4);
  __syncthreads();
  int rows[2] = {q0 + R + g, q0 + R + g + 8};
  int n_tiles = (min(q0 + FT, T) - 1) / FT + 1;  // causal: keys up to the block's last query
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, s[FT / 8][4], o[HS / 8][4];
  zero_acc(o);
  flash_load(Ks, kb, 0, T, ld);
  flash_load(Vs, vb, 0, T, ld);
  cp_commit();
  for (int kt = 0; kt < n_tiles; ++kt) {
    const unsigned short* K = Ks + (kt & 1) * TS;
    const unsigned short* V = Vs + (kt & 1) * TS;
    if (kt + 1 < n_tiles) {
      flash_load(Ks + ((kt + 1) & 1) * TS, kb, (kt + 1) * FT, T, ld);
      flash_load(Vs + ((kt + 1) & 1) * TS, vb, (kt + 1) * FT, T, ld);
      cp_commit();
      cp_wait_all_but_one();
    } else {
      cp_wait_all();
    }
    __syncthreads();
    flash_rows_dot(s, qf, K, g, t4);
    float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n8 = 0; n8 < FT / 8; ++n8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int key = kt * FT + n8 * 8 + 2 * t4 + (e & 1), r = e >> 1;
        s[n8][e] = (key <= rows[r] && key < T) ? s[n8][e] * scale : NEG_INF;
        tmax[r] = fmaxf(tmax[r], s[n8][e]);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the 4 lanes of a group hold one row between them
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
      float mn = fmaxf(m[r], tmax[r]);
      alpha[r] = mn == NEG_INF ? 1.f : expf(m[r] - mn);
      m[r] = mn;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int n8 = 0; n8 < FT / 8; ++n8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int r = e >> 1;
        float p = s[n8][e] == NEG_INF ? 0.f : expf(s[n8][e] - m[r]);
        s[n8][e] = p;
        l[r] += p;
      }
#pragma unroll
    for (int n8 = 0; n8 < HS / 8; ++n8) {
      o[n8][0] *= alpha[0]; o[n8][1] *= alpha[0]; o[n8][2] *= alpha[1]; o[n8][3] *= alpha[1];
    }
    flash_p_dot(o, s, V, g, t4);
    __syncthreads();  // the next iteration's copies overwrite this buffer
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = 1.f / l[r];
    if (t4 == 0 && rows[r] < T) lse[(i64)bh * T + rows[r]] = m[r] + logf(l[r]);
  }
#pragma unroll
  for (int n8 = 0; n8 < HS / 8; ++n8)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int r = e >> 1;
      if (rows[r] < T)
        out[((i64)b * T + rows[r]) * C + h * HS + n8 * 8 + 2 * t4 + (e & 1)] = from_f<HT>(o[n8][e] * inv[r]);
    }
}

// D (B*NH, T) = rowsum(dout * out) per head: one warp per row.
extern "C" __global__ void k_attn_flash_D(float* Dv, const HT* dout, const HT* out, int B, int T, int NH) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= (i64)B * NH * T) return;
  int i = (int)(row % T), h = (int)((row / T) % NH);
  i64 b = row / ((i64)T * NH);
  i64 o = (b * T + i) * (i64)(NH * HS) + (i64)h * HS;
  float D = 0.f;
  for (int d = lane; d < HS; d += 32) D += to_f(dout[o + d]) * to_f(out[o + d]);
  D = warp_sum(D);
  if (lane == 0) Dv[row] = D;
}

// dQ part of dqkv += ...: one block per 64 query rows of one head. grid (ceil(T/FT), B*NH).
extern "C" __global__ void __launch_bounds__(128) k_attn_flash_bwd_dq(HT* dqkv, const HT* qkv, const HT* dout,
                                                                      const float* lse, const float* Dv,
                                                                      int B, int T, int NH, float scale) {
  __shared__ __align__(16) unsigned short Ks[2 * TS];
  __shared__ __align__(16) unsigned short Vs[2 * TS];
  int C = NH * HS, ld = 3 * C, bh = blockIdx.y, b = bh / NH, h = bh % NH, q0 = blockIdx.x * FT;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, R = warp * 16;
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  const HT* ob = dout + (i64)b * T * C + h * HS;
  unsigned qf[HS / 16][4], df[HS / 16][4];
  flash_load(Ks, qb, q0, T, ld);
  flash_load(Vs, ob, q0, T, C);
  cp_commit();
  cp_wait_all();
  __syncthreads();
  flash_afrag(qf, Ks, R, g, t4);
  flash_afrag(df, Vs, R, g, t4);
  __syncthreads();
  int rows[2] = {q0 + R + g, q0 + R + g + 8};
  float L[2], D[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    L[r] = rows[r] < T ? lse[(i64)bh * T + rows[r]] : 0.f;
    D[r] = rows[r] < T ? Dv[(i64)bh * T + rows[r]] : 0.f;
  }
  float dq[HS / 8][4], s[FT / 8][4], dp[FT / 8][4];
  zero_acc(dq);
  int n_tiles = (min(q0 + FT, T) - 1) / FT + 1;
  flash_load(Ks, kb, 0, T, ld);
  flash_load(Vs, vb, 0, T, ld);
  cp_commit();
  for (int kt = 0; kt < n_tiles; ++kt) {
    const unsigned short* K = Ks + (kt & 1) * TS;
    const unsigned short* V = Vs + (kt & 1) * TS;
    if (kt + 1 < n_tiles) {
      flash_load(Ks + ((kt + 1) & 1) * TS, kb, (kt + 1) * FT, T, ld);
      flash_load(Vs + ((kt + 1) & 1) * TS, vb, (kt + 1) * FT, T, ld);
      cp_commit();
      cp_wait_all_but_one();
    } else {
      cp_wait_all();
    }
    __syncthreads();
    flash_rows_dot(s, qf, K, g, t4);   // S = Q K^T
    flash_rows_dot(dp, df, V, g, t4);  // dP = dO V^T
#pragma unroll
    for (int n8 = 0; n8 < FT / 8; ++n8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int key = kt * FT + n8 * 8 + 2 * t4 + (e & 1), r = e >> 1;
        float p = (key <= rows[r] && key < T) ? expf(s[n8][e] * scale - L[r]) : 0.f;
        s[n8][e] = p * (dp[n8][e] - D[r]) * scale;  // dS
      }
    flash_p_dot(dq, s, K, g, t4);  // dQ += dS K
    __syncthreads();
  }
#pragma unroll
  for (int n8 = 0; n8 < HS / 8; ++n8)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int r = e >> 1;
      if (rows[r] < T) {
        HT* p = dqkv + ((i64)b * T + rows[r]) * ld + h * HS + n8 * 8 + 2 * t4 + (e & 1);
        *p = from_f<HT>(to_f(*p) + dq[n8][e]);
      }
    }
}

// dK and dV parts of dqkv += ...: one block per 64 key rows of one head, looping over the query
// tiles at or after them. grid (ceil(T/FT), B*NH).
extern "C" __global__ void __launch_bounds__(128) k_attn_flash_bwd_dkv(HT* dqkv, const HT* qkv, const HT* dout,
                                                                       const float* lse, const float* Dv,
                                                                       int B, int T, int NH, float scale) {
  __shared__ __align__(16) unsigned short Qs[2 * TS];
  __shared__ __align__(16) unsigned short Os[2 * TS];
  __shared__ float Ls[2][FT], Ds[2][FT];
  int C = NH * HS, ld = 3 * C, bh = blockIdx.y, b = bh / NH, h = bh % NH, k0 = blockIdx.x * FT;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, R = warp * 16;
  const HT* qb = qkv + (i64)b * T * ld + h * HS;
  const HT* kb = qb + C;
  const HT* vb = qb + 2 * C;
  const HT* ob = dout + (i64)b * T * C + h * HS;
  unsigned kf[HS / 16][4], vf[HS / 16][4];
  flash_load(Qs, kb, k0, T, ld);
  flash_load(Os, vb, k0, T, ld);
  cp_commit();
  cp_wait_all();
  __syncthreads();
  flash_afrag(kf, Qs, R, g, t4);
  flash_afrag(vf, Os, R, g, t4);
  __syncthreads();
  int keys[2] = {k0 + R + g, k0 + R + g + 8};
  float dk[HS / 8][4], dv[HS / 8][4], s[FT / 8][4], dp[FT / 8][4];
  zero_acc(dk);
  zero_acc(dv);
  int first = k0 / FT, n_tiles = (T - 1) / FT + 1;
  flash_load(Qs, qb, first * FT, T, ld);
  flash_load(Os, ob, first * FT, T, C);
  for (int i = threadIdx.x; i < FT; i += blockDim.x) {
    int q = first * FT + i;
    Ls[0][i] = q < T ? lse[(i64)bh * T + q] : 0.f;
    Ds[0][i] = q < T ? Dv[(i64)bh * T + q] : 0.f;
  }
  cp_commit();
  for (int qt = first; qt < n_tiles; ++qt) {
    int cur = (qt - first) & 1, q0 = qt * FT;
    const unsigned short* Q = Qs + cur * TS;
    const unsigned short* O = Os + cur * TS;
    if (qt + 1 < n_tiles) {
      flash_load(Qs + (cur ^ 1) * TS, qb, q0 + FT, T, ld);
      flash_load(Os + (cur ^ 1) * TS, ob, q0 + FT, T, C);
      for (int i = threadIdx.x; i < FT; i += blockDim.x) {
        int q = q0 + FT + i;
        Ls[cur ^ 1][i] = q < T ? lse[(i64)bh * T + q] : 0.f;
        Ds[cur ^ 1][i] = q < T ? Dv[(i64)bh * T + q] : 0.f;
      }
      cp_commit();
      cp_wait_all_but_one();
    } else {
      cp_wait_all();
    }
    __syncthreads();
    flash_rows_dot(s, kf, Q, g, t4);   // S^T = K Q^T (rows keys, columns queries)
    flash_rows_dot(dp, vf, O, g, t4);  // dP^T = V dO^T
#pragma unroll
    for (int n8 = 0; n8 < FT / 8; ++n8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int qc = n8 * 8 + 2 * t4 + (e & 1), q = q0 + qc, r = e >> 1;
        float p = (q >= keys[r] && q < T) ? expf(s[n8][e] * scale - Ls[cur][qc]) : 0.f;
        s[n8][e] = p;
        dp[n8][e] = p * (dp[n8][e] - Ds[cur][qc]) * scale;  // dS^T
      }
    flash_p_dot(dv, s, O, g, t4);   // dV += P^T dO
    flash_p_dot(dk, dp, Q, g, t4);  // dK += dS^T Q
    __syncthreads();
  }
#pragma unroll
  for (int n8 = 0; n8 < HS / 8; ++n8)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int r = e >> 1;
      if (keys[r] < T) {
        HT* p = dqkv + ((i64)b * T + keys[r]) * ld + C + h * HS + n8 * 8 + 2 * t4 + (e & 1);
        *p = from_f<HT>(to_f(*p) + dk[n8][e]);
        p += C;
        *p = from_f<HT>(to_f(*p) + dv[n8][e]);
      }
    }
}
