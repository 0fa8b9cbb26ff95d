// layernorm.cu: layer norm over the last axis (C), forward and backward. One warp per row for
// the row-wise parts; the weight and bias gradients are column sums over all rows, done in fixed
// row chunks then added in chunk order (in k_layernorm_bwd_fused itself; after
// k_layernorm_bwd_partial by k_colsum_final, linear.cu), so no floating-point atomics. Statistics (mean, rstd) are float32 whatever CT is.
#include "common.cuh"

#define LN_EPS 1e-5f  // torch.nn.LayerNorm's default, as numpy_ref.LN_EPS

// The normalisation of one row x by one warp, given the lane's partial sum s of the row.
__device__ __forceinline__ void ln_row(CT* o, float* mean, float* rstd, const CT* x, const CT* weight,
                                       const CT* bias, int C, int lane, float s) {
  float mu = warp_sum(s) / C;
  float v = 0.f;
  for (int c = lane; c < C; c += 32) { float d = to_f(x[c]) - mu; v += d * d; }
  float rs = 1.0f / sqrtf(warp_sum(v) / C + LN_EPS);
  for (int c = lane; c < C; c += 32)
    o[c] = from_f<CT>((to_f(x[c]) - mu) * rs * to_f(weight[c]) + to_f(bias[c]));
  if (lane == 0) { *mean = mu; *rstd = rs; }
}

// out = (inp - mean) * rstd * weight + bias; block of 8 warps = 8 rows.
extern "C" __global__ void k_layernorm_fwd(CT* out, float* mean, float* rstd, const CT* inp,
                                           const CT* weight, const CT* bias, i64 N, int C) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  const CT* x = inp + row * C;
  float s = 0.f;
  for (int c = lane; c < C; c += 32) s += to_f(x[c]);
  ln_row(out + row * C, mean + row, rstd + row, x, weight, bias, C, lane, s);
}

// The residual add fused into the layer norm that follows it: res = a + b (rounded to CT, as
// k_residual_add writes it), then out = layer norm of res, as k_layernorm_fwd; one pass over a
// and b instead of a write and a read of res in between. Block of 8 warps = 8 rows.
extern "C" __global__ void k_residual_layernorm_fwd(CT* res, CT* out, float* mean, float* rstd,
                                                    const CT* a, const CT* b, const CT* weight,
                                                    const CT* bias, i64 N, int C) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  CT* x = res + row * C;
  const CT* ar = a + row * C;
  const CT* br = b + row * C;
  float s = 0.f;
  for (int c = lane; c < C; c += 32) {
    CT r = from_f<CT>(to_f(ar[c]) + to_f(br[c]));
    x[c] = r;
    s += to_f(r);
  }
  ln_row(out + row * C, mean + row, rstd + row, x, weight, bias, C, lane, s);
}

// dinp += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dout * weight.
extern "C" __global__ void k_layernorm_bwd_dx(CT* dinp, const CT* dout, const CT* inp, const CT* weight,
                                              const float* mean, const float* rstd, i64 N, int C) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  const CT* x = inp + row * C;
  const CT* d = dout + row * C;
  float mu = mean[row], rs = rstd[row];
  float a = 0.f, b = 0.f;
  for (int c = lane; c < C; c += 32) {
    float xh = (to_f(x[c]) - mu) * rs;
    float dxh = to_f(d[c]) * to_f(weight[c]);
    a += dxh;
    b += dxh * xh;
  }
  a = warp_sum(a) / C;
  b = warp_sum(b) / C;
  CT* g = dinp + row * C;
  for (int c = lane; c < C; c += 32) {
    float xh = (to_f(x[c]) - mu) * rs;
    float dxh = to_f(d[c]) * to_f(weight[c]);
    g[c] = from_f<CT>(to_f(g[c]) + rs * (dxh - a - xh * b));
  }
}

// Partial column sums of dout * xhat (-> pdw) and dout (-> pdb) over one chunk of rows per
// blockIdx.y; block (32, 8) as k_colsum_partial.
extern "C" __global__ void k_layernorm_bwd_partial(float* pdw, float* pdb, const CT* dout, const CT* inp,
                                                   const float* mean, const float* rstd, i64 N, int C,
                                                   int rows_per_chunk) {
  __shared__ float sw[8][33], sb[8][33];
  int c = blockIdx.x * 32 + threadIdx.x;
  i64 r0 = (i64)blockIdx.y * rows_per_chunk;
  i64 r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float aw = 0.f, ab = 0.f;
  if (c < C)
    for (i64 r = r0 + threadIdx.y; r < r1; r += 8) {
      float d = to_f(dout[r * C + c]);
      aw += d * (to_f(inp[r * C + c]) - mean[r]) * rstd[r];
      ab += d;
    }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float w = 0.f, b = 0.f;
    for (int k = 0; k < 8; ++k) { w += sw[k][threadIdx.x]; b += sb[k][threadIdx.x]; }
    pdw[(i64)blockIdx.y * C + c] = w;
    pdb[(i64)blockIdx.y * C + c] = b;
  }
}

#ifndef LN_MAXC
#define LN_MAXC 1024
#endif
#define LN_VEC CT_VEC  // elements per 16-byte vector (common.cuh)
#define LN_CHUNKS ((LN_MAXC + 32 * LN_VEC - 1) / (32 * LN_VEC))  // vectors per lane of one row

// Version 3 of the backward pass (version 2, in git history, loaded one element per lane):
// for C <= LN_MAXC with rows in whole 16-byte vectors (C a multiple of 16 / sizeof(CT)); the
// launcher compiles it with LN_MAXC = C rounded up to 32 vectors, so the per-lane arrays are no
// longer than the row. One kernel reads each row once, 16 bytes per load. A block of 8 warps owns
// a contiguous chunk of rows (one warp per row at a time); each lane keeps the row's values and its
// running dweight/dbias sums for its vectors (lane, lane+32, ...) in registers. The warps then add
// their sums into shared memory one warp after another (a fixed order) and the block writes its
// partial row pdw/pdb[blockIdx.x][C]; k_colsum_final adds the blocks in order. dinp's row is
// loaded with the row's other inputs, with two blocks per SM up to C = 768.
extern "C" __global__ void __launch_bounds__(256, LN_MAXC <= 768 ? 2 : 1) k_layernorm_bwd_fused(
    CT* dinp, float* pdw, float* pdb, const CT* dout, const CT* inp, const CT* weight,
    const float* mean, const float* rstd, i64 N, int C, int rows_per_block) {
  __shared__ float sw[LN_CHUNKS * 32 * LN_VEC], sb[LN_CHUNKS * 32 * LN_VEC];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, nq = C / LN_VEC;
  float aw[LN_CHUNKS][LN_VEC], ab[LN_CHUNKS][LN_VEC];
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k)
#pragma unroll
    for (int j = 0; j < LN_VEC; ++j) aw[k][j] = ab[k][j] = 0.f;
  i64 r0 = (i64)blockIdx.x * rows_per_block;
  i64 r1 = r0 + rows_per_block < N ? r0 + rows_per_block : N;
  for (i64 r = r0 + warp; r < r1; r += nw) {
    const CT* x = inp + r * C;
    const CT* d = dout + r * C;
    CT* g = dinp + r * C;
    float mu = mean[r], rs = rstd[r], xh[LN_CHUNKS][LN_VEC], dy[LN_CHUNKS][LN_VEC], a = 0.f, b = 0.f;
    vec16 rg[LN_CHUNKS];  // dinp's row, loaded with the others: one memory round trip per row, not two
#pragma unroll
    for (int k = 0; k < LN_CHUNKS; ++k) {
      int q = lane + 32 * k;
      vec16 rx = {{0u, 0u, 0u, 0u}}, rd = rx, rw = rx;
      rg[k] = rx;
      if (q < nq) {
        rx = *(const vec16*)(x + q * LN_VEC);
        rd = *(const vec16*)(d + q * LN_VEC);
        rw = *(const vec16*)(weight + q * LN_VEC);
        rg[k] = *(const vec16*)(g + q * LN_VEC);
      }
      const CT* ex = (const CT*)&rx;
      const CT* ed = (const CT*)&rd;
      const CT* ew = (const CT*)&rw;
#pragma unroll
      for (int j = 0; j < LN_VEC; ++j) {
        xh[k][j] = q < nq ? (to_f(ex[j]) - mu) * rs : 0.f;
        dy[k][j] = to_f(ed[j]);
        float dxh = dy[k][j] * to_f(ew[j]);
        a += dxh;
        b += dxh * xh[k][j];
        aw[k][j] += dy[k][j] * xh[k][j];
        ab[k][j] += dy[k][j];
      }
    }
    a = warp_sum(a) / C;
    b = warp_sum(b) / C;
#pragma unroll
    for (int k = 0; k < LN_CHUNKS; ++k) {
      int q = lane + 32 * k;
      if (q < nq) {
        vec16 rw = *(const vec16*)(weight + q * LN_VEC);
        CT* eg = (CT*)&rg[k];
        const CT* ew = (const CT*)&rw;
#pragma unroll
        for (int j = 0; j < LN_VEC; ++j)
          eg[j] = from_f<CT>(to_f(eg[j]) + rs * (dy[k][j] * to_f(ew[j]) - a - xh[k][j] * b));
        *(vec16*)(g + q * LN_VEC) = rg[k];
      }
    }
  }
  for (int w = 0; w < nw; ++w) {  // warps add into shared memory in order: reproducible sums
    if (warp == w)
#pragma unroll
      for (int k = 0; k < LN_CHUNKS; ++k) {
        int q = lane + 32 * k;
        if (q < nq)
#pragma unroll
          for (int j = 0; j < LN_VEC; ++j) {
            int c = q * LN_VEC + j;
            sw[c] = (w == 0 ? 0.f : sw[c]) + aw[k][j];
            sb[c] = (w == 0 ? 0.f : sb[c]) + ab[k][j];
          }
      }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    pdw[(i64)blockIdx.x * C + c] = sw[c];
    pdb[(i64)blockIdx.x * C + c] = sb[c];
  }
}

// Version 4 of the backward pass, k_layernorm_bwd_tree (CudaOps.ln_bwd_version = 4), for
// C <= 1024 with rows in whole 16-byte vectors (C a multiple of 16 / sizeof(CT)).
// The grid is sized to the SMs; each block of 8 warps owns a contiguous chunk of rows.
//
// Rows: a warp takes LN_ROWS rows at a time (a slab), read once, 16 bytes per load: vector v of
// the slab (row v / nq, column vector v % nq, nq = C / LN_VEC) belongs to lane v % 32, slot v / 32,
// LN_SLOTS slots per lane. LN_ROWS is chosen by the launcher so that the slab fills the slots
// (C = 384 in 16 bits: 48 vectors a row, 2 rows = 3 full slots, where one row left 16 lanes idle
// in its second slot), which also puts LN_ROWS rows' loads in flight at once. Each slot maps to
// the same (row in slab, column) in every slab, so the lane keeps the running dweight/dbias sums
// of its slots in registers.
//
// Columns: the warps' sums are added in a fixed pairwise tree through shared memory, the block
// folds the slab rows and writes its partial row pdw/pdb[blockIdx.x]. Then a two-level
// tree, no floating-point atomics: the blocks come in groups of `group`; the last block of a group
// to finish (an integer counter elects it) adds its group's partial rows in block order into a
// group row, and the last group to finish adds the group rows in group order into dweight/dbias.
// The sums' order depends on the grid only, never on which block finished last: the same bits
// every run. The counters (one per group and one for the groups, zero before the launch) are set
// back to zero by the blocks that used them, so the next launch (or graph replay) finds them zero.
#ifndef LN_ROWS
#define LN_ROWS 1
#endif
#ifndef LN_SLOTS
#define LN_SLOTS (LN_ROWS * LN_CHUNKS)
#endif
#ifndef LN_DINP_EARLY
#define LN_DINP_EARLY 1
#endif

// Element j of a 16-byte vector of CT as a float, taken from its 32-bit word (fewer registers
// than vget's 16-bit view of the vector: it keeps the backward below free of spills).
template <typename T> __device__ __forceinline__ float ln_elem(const vec16& r, int j);
template <> __device__ __forceinline__ float ln_elem<float>(const vec16& r, int j) { return __uint_as_float(r.w[j]); }
template <> __device__ __forceinline__ float ln_elem<bf16>(const vec16& r, int j) {
  unsigned w = r.w[j >> 1];
  return __uint_as_float(j & 1 ? w & 0xffff0000u : w << 16);
}
template <> __device__ __forceinline__ float ln_elem<f16>(const vec16& r, int j) {
  unsigned w = r.w[j >> 1];
  f16 h = {(unsigned short)(j & 1 ? w >> 16 : w & 0xffffu)};
  return to_f(h);
}

// A float another block wrote in this launch: through L2 (ld.global.cg), never a stale L1 line.
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// Whether this block is the last of n to pass (counter incremented once per block); the last
// sets the counter back to zero. Every block's writes before the call are visible to the last.
__device__ __forceinline__ bool last_block_of(unsigned* counter, unsigned n, int* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned t = atomicAdd(counter, 1u);
    *flag = t == n - 1;
    if (t == n - 1) *counter = 0u;
  }
  __syncthreads();
  bool last = *flag;
  if (last) __threadfence();
  return last;
}

// For every column c: the sums over rows k0 .. k1-1 of pw[k * C + c] and pb[k * C + c], each
// added in k order from zero, written to (add: added to) dw[c], db[c]. A thread takes two
// columns at a time and issues the loads of up to 16 rows of both (64 loads) before adding any:
// one memory round trip per 16 rows, not one per row and column.
__device__ __forceinline__ void ln_sum_block(float* dw, float* db, bool add, const float* pw, const float* pb,
                                             int k0, int k1, int C) {
  for (int c = threadIdx.x; c < C; c += 2 * blockDim.x) {
    int c2 = c + blockDim.x;
    bool two = c2 < C;
    float w1 = 0.f, b1 = 0.f, w2 = 0.f, b2 = 0.f;
    for (int k = k0; k < k1; k += 16) {
      float vw1[16], vb1[16], vw2[16], vb2[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        bool ok = k + u < k1;
        i64 o = (i64)(k + u) * C;
        vw1[u] = ok ? ld_cg(pw + o + c) : 0.f;
        vb1[u] = ok ? ld_cg(pb + o + c) : 0.f;
        vw2[u] = ok && two ? ld_cg(pw + o + c2) : 0.f;
        vb2[u] = ok && two ? ld_cg(pb + o + c2) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < 16; ++u)
        if (k + u < k1) { w1 += vw1[u]; b1 += vb1[u]; w2 += vw2[u]; b2 += vb2[u]; }
    }
    dw[c] = add ? dw[c] + w1 : w1;
    db[c] = add ? db[c] + b1 : b1;
    if (two) {
      dw[c2] = add ? dw[c2] + w2 : w2;
      db[c2] = add ? db[c2] + b2 : b2;
    }
  }
}

// The two-level tree after every block wrote its partial row pdw/pdb[blockIdx.x]: group rows
// after the gridDim.x block rows, then dweight/dbias += the group rows in order.
__device__ __forceinline__ void ln_tree(float* dweight, float* dbias, float* pdw, float* pdb, unsigned* counters,
                                        int C, int group, int* flag) {
  int nb = gridDim.x, g = blockIdx.x / group, ng = (nb + group - 1) / group;
  int b0 = g * group, b1 = b0 + group < nb ? b0 + group : nb;
  if (!last_block_of(counters + g, b1 - b0, flag)) return;
  ln_sum_block(pdw + (i64)(nb + g) * C, pdb + (i64)(nb + g) * C, false, pdw, pdb, b0, b1, C);
  if (!last_block_of(counters + ng, ng, flag)) return;
  ln_sum_block(dweight, dbias, true, pdw, pdb, nb, nb + ng, C);
}

extern "C" __global__ void __launch_bounds__(256, LN_SLOTS * LN_VEC <= 24 && LN_SLOTS <= 4 ? 2 : 1) k_layernorm_bwd_tree(
    CT* dinp, float* dweight, float* dbias, float* pdw, float* pdb, unsigned* counters, const CT* dout,
    const CT* inp, const CT* weight, const float* mean, const float* rstd, i64 N, int C, int rows_per_block,
    int group) {
  __shared__ float tw[4][LN_SLOTS * 32 * LN_VEC], tb[4][LN_SLOTS * 32 * LN_VEC];  // the warp tree's halves
  __shared__ int flag;
  if (blockDim.x != 256) __trap();  // 8 warps: the tree's 4 halves
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, nq = C / LN_VEC;
  int nv = LN_ROWS * nq;  // vectors of a slab
  float aw[LN_SLOTS][LN_VEC], ab[LN_SLOTS][LN_VEC];
#pragma unroll
  for (int k = 0; k < LN_SLOTS; ++k)
#pragma unroll
    for (int j = 0; j < LN_VEC; ++j) aw[k][j] = ab[k][j] = 0.f;
  i64 r0 = (i64)blockIdx.x * rows_per_block;
  i64 r1 = r0 + rows_per_block < N ? r0 + rows_per_block : N;
  for (i64 s = r0 + (i64)warp * LN_ROWS; s < r1; s += (i64)nw * LN_ROWS) {
    vec16 rx[LN_SLOTS], rd[LN_SLOTS], rg[LN_SLOTS];
    float mu[LN_SLOTS], rs[LN_SLOTS], pa[LN_ROWS], pb[LN_ROWS];
#pragma unroll
    for (int i = 0; i < LN_ROWS; ++i) pa[i] = pb[i] = 0.f;
#pragma unroll
    for (int k = 0; k < LN_SLOTS; ++k) {  // every load of the slab first: LN_ROWS rows in flight
      int v = lane + 32 * k, ro = v / nq;
      i64 r = s + ro;
      rx[k] = rd[k] = rg[k] = vec16{{0u, 0u, 0u, 0u}};
      mu[k] = rs[k] = 0.f;  // a slot past the slab or past the chunk: xhat = dout = 0, adds nothing
      if (v < nv && r < r1) {
        i64 o = r * C + (i64)(v - ro * nq) * LN_VEC;
        rx[k] = *(const vec16*)(inp + o);
        rd[k] = *(const vec16*)(dout + o);
#if LN_DINP_EARLY
        rg[k] = *(const vec16*)(dinp + o);
#endif
        mu[k] = mean[r];
        rs[k] = rstd[r];
      }
    }
#pragma unroll
    for (int k = 0; k < LN_SLOTS; ++k) {
      int v = lane + 32 * k, ro = v / nq;
      vec16 rw = *(const vec16*)(weight + (v - ro * nq) * LN_VEC);  // a column < nq even past the slab
      float sa = 0.f, sx = 0.f;
#pragma unroll
      for (int j = 0; j < LN_VEC; ++j) {
        float xh = (ln_elem<CT>(rx[k], j) - mu[k]) * rs[k], dy = ln_elem<CT>(rd[k], j), dxh = dy * ln_elem<CT>(rw, j);
        sa += dxh;
        sx += dxh * xh;
        aw[k][j] += dy * xh;
        ab[k][j] += dy;
      }
#pragma unroll
      for (int i = 0; i < LN_ROWS; ++i)
        if (ro == i) { pa[i] += sa; pb[i] += sx; }
    }
#pragma unroll
    for (int i = 0; i < LN_ROWS; ++i) { pa[i] = warp_sum(pa[i]) / C; pb[i] = warp_sum(pb[i]) / C; }
#pragma unroll
    for (int k = 0; k < LN_SLOTS; ++k) {
      int v = lane + 32 * k, ro = v / nq;
      i64 r = s + ro;
      if (v < nv && r < r1) {
        vec16 rw = *(const vec16*)(weight + (v - ro * nq) * LN_VEC);
#if !LN_DINP_EARLY
        rg[k] = *(const vec16*)(dinp + r * C + (i64)(v - ro * nq) * LN_VEC);
#endif
        float a = pa[0], b = pb[0];
#pragma unroll
        for (int i = 1; i < LN_ROWS; ++i)
          if (ro == i) { a = pa[i]; b = pb[i]; }
#pragma unroll
        for (int j = 0; j < LN_VEC; ++j) {
          float xh = (ln_elem<CT>(rx[k], j) - mu[k]) * rs[k];
          vset(rg[k], j, ln_elem<CT>(rg[k], j) + rs[k] * (ln_elem<CT>(rd[k], j) * ln_elem<CT>(rw, j) - a - xh * b));
        }
        *(vec16*)(dinp + r * C + (i64)(v - ro * nq) * LN_VEC) = rg[k];
      }
    }
  }
  // slot (lane, k) is element v * LN_VEC + j of the slab, i.e. row ro, column c: element ro * C + c.
  // The warps' sums are added pairwise in a fixed tree (warp w + half into warp w, half = nw / 2,
  // ..., 1): log2(nw) rounds of shared memory traffic and barriers, then warp 0 holds the block's.
  for (int half = nw >> 1; half >= 1; half >>= 1) {
    if (warp >= half && warp < 2 * half)
#pragma unroll
      for (int k = 0; k < LN_SLOTS; ++k)
#pragma unroll
        for (int j = 0; j < LN_VEC; ++j) {
          int e = (lane + 32 * k) * LN_VEC + j;
          tw[warp - half][e] = aw[k][j];
          tb[warp - half][e] = ab[k][j];
        }
    __syncthreads();
    if (warp < half)
#pragma unroll
      for (int k = 0; k < LN_SLOTS; ++k)
#pragma unroll
        for (int j = 0; j < LN_VEC; ++j) {
          int e = (lane + 32 * k) * LN_VEC + j;
          aw[k][j] += tw[warp][e];
          ab[k][j] += tb[warp][e];
        }
    __syncthreads();
  }
  if (warp == 0)
#pragma unroll
    for (int k = 0; k < LN_SLOTS; ++k)
#pragma unroll
      for (int j = 0; j < LN_VEC; ++j) {
        int e = (lane + 32 * k) * LN_VEC + j;
        tw[0][e] = aw[k][j];
        tb[0][e] = ab[k][j];
      }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += blockDim.x) {  // the slab's rows added in order
    float w = tw[0][c], b = tb[0][c];
#pragma unroll
    for (int i = 1; i < LN_ROWS; ++i) { w += tw[0][i * C + c]; b += tb[0][i * C + c]; }
    pdw[(i64)blockIdx.x * C + c] = w;
    pdb[(i64)blockIdx.x * C + c] = b;
  }
  ln_tree(dweight, dbias, pdw, pdb, counters, C, group, &flag);
}

// Version 2 of the layer-norm forward, for rows in whole 16-byte vectors with C <= LN_MAXC
// (compiled per width as k_layernorm_bwd_fused): k_layernorm_fwd (b null: the row is a) and
// k_residual_layernorm_fwd (res = a + b, rounded to CT, written, then normalised) with 16-byte
// loads and stores and the row kept in registers between its three uses. Both launchers take it
// for such rows, so the fused kernel still gives the bits of k_residual_add + k_layernorm_fwd;
// k_layernorm_fwd / k_residual_layernorm_fwd above (one element per lane) serve other rows.
// One warp per row, lane l holding vectors l, l + 32, ...; block of 8 warps = 8 rows.
extern "C" __global__ void __launch_bounds__(256) k_layernorm_fwd_vec(
    CT* res, CT* out, float* mean, float* rstd, const CT* a, const CT* b, const CT* weight,
    const CT* bias, i64 N, int C) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31, nq = C / LN_VEC;
  if (row >= N) return;
  const vec16* av = (const vec16*)(a + row * C);
  const vec16* bv = (const vec16*)(b + row * C);
  vec16* rv = (vec16*)(res + row * C);
  vec16* ov = (vec16*)(out + row * C);
  float x[LN_CHUNKS][LN_VEC], s = 0.f;
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k) {
    int q = lane + 32 * k;
    if (q < nq) {
      vec16 rr = av[q];
      if (b) {
        vec16 rb = bv[q];
#pragma unroll
        for (int i = 0; i < LN_VEC; ++i) vset(rr, i, vget(rr, i) + vget(rb, i));  // as k_residual_add
        rv[q] = rr;
      }
#pragma unroll
      for (int i = 0; i < LN_VEC; ++i) { x[k][i] = vget(rr, i); s += x[k][i]; }
    }
  }
  float mu = warp_sum(s) / C, v = 0.f;
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k)
    if (lane + 32 * k < nq)
#pragma unroll
      for (int i = 0; i < LN_VEC; ++i) { float d = x[k][i] - mu; v += d * d; }
  float rs = 1.0f / sqrtf(warp_sum(v) / C + LN_EPS);
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k) {
    int q = lane + 32 * k;
    if (q < nq) {
      vec16 rw = ((const vec16*)weight)[q], rb = ((const vec16*)bias)[q], ro;
#pragma unroll
      for (int i = 0; i < LN_VEC; ++i) vset(ro, i, (x[k][i] - mu) * rs * vget(rw, i) + vget(rb, i));
      ov[q] = ro;
    }
  }
  if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
}
