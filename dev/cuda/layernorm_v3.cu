// layernorm_v3.cu: version 4 of the layer-norm backward (andrea/kernels/layernorm.cu) with the
// block's column sums added by a pairwise tree over its 8 warps (3 rounds of shared memory
// traffic and barriers) instead of one warp after another (8 rounds); the rest is unchanged.
// The package file is included and its k_layernorm_bwd_fused renamed out of the way; the
// package's launcher launches this one (same arguments, -D options and grid).
#define k_layernorm_bwd_fused k_layernorm_bwd_fused_current  // the package's version, out of the way
#include "layernorm.cu"
#undef k_layernorm_bwd_fused

extern "C" __global__ void __launch_bounds__(256, LN_SLOTS * LN_VEC <= 24 && LN_SLOTS <= 4 ? 2 : 1) k_layernorm_bwd_fused(
    CT* dinp, float* dweight, float* dbias, float* pdw, float* pdb, unsigned* counters, const CT* dout,
    const CT* inp, const CT* weight, const float* mean, const float* rstd, i64 N, int C, int rows_per_block,
    int group) {
  __shared__ float tw[4][LN_SLOTS * 32 * LN_VEC], tb[4][LN_SLOTS * 32 * LN_VEC];  // nw / 2 = 4 halves
  if (blockDim.x != 256) __trap();
  __shared__ int flag;
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
#if LN_DINP_EARLY && LN_ACCUMULATE
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
#if !LN_DINP_EARLY && LN_ACCUMULATE
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
  // ..., 1): log2(nw) rounds instead of nw, then warp 0 holds the block's sums.
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
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float w = tw[0][c], b = tb[0][c];
#pragma unroll
    for (int i = 1; i < LN_ROWS; ++i) { w += tw[0][i * C + c]; b += tb[0][i * C + c]; }
    pdw[(i64)blockIdx.x * C + c] = w;
    pdb[(i64)blockIdx.x * C + c] = b;
  }
  // the tree: group rows after the gridDim.x block rows of pdw/pdb
  int nb = gridDim.x, g = blockIdx.x / group, ng = (nb + group - 1) / group;
  int b0 = g * group, b1 = b0 + group < nb ? b0 + group : nb;
  if (!last_block_of(counters + g, b1 - b0, &flag)) return;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    pdw[(i64)(nb + g) * C + c] = ln_sum_rows(pdw + c, b0, b1, C);
    pdb[(i64)(nb + g) * C + c] = ln_sum_rows(pdb + c, b0, b1, C);
  }
  if (!last_block_of(counters + ng, ng, &flag)) return;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    dweight[c] += ln_sum_rows(pdw + c, nb, nb + ng, C);
    dbias[c] += ln_sum_rows(pdb + c, nb, nb + ng, C);
  }
}
