// layernorm_v4.cu: version 4 of the layer-norm backward (andrea/kernels/layernorm.cu,
// k_layernorm_bwd_tree, CudaOps.ln_bwd_version = 4) with each
// warp's running dweight/dbias sums in its own region of shared memory instead of registers
// (16-byte read-modify-writes, laid out so a warp's accesses are contiguous): about 48 fewer
// registers a thread at C = 384 in 16 bits, so more warps (blocks of 4 warps, V4_MIN_BLOCKS per
// SM) have rows in flight. The block's sums are then added over the slab rows and the warps in
// a fixed order, and the two-level tree is the package's. layernorm_v4.py launches it (blocks of
// 128 threads, its own grid). The package file is included, its kernel renamed out of the way.
#define k_layernorm_bwd_tree k_layernorm_bwd_tree_current  // the package's version, out of the way
#include "layernorm.cu"
#undef k_layernorm_bwd_tree

#define V4_WARPS 4
#ifndef V4_MIN_BLOCKS
#define V4_MIN_BLOCKS (LN_SLOTS <= 3 ? 5 : 3)  // 5: at most 102 registers a thread, 20 warps a SM
#endif
struct __align__(16) V4F { float x, y, z, w; };

extern "C" __global__ void __launch_bounds__(V4_WARPS * 32, V4_MIN_BLOCKS) k_layernorm_bwd_tree(
    CT* dinp, float* dweight, float* dbias, float* pdw, float* pdb, unsigned* counters, const CT* dout,
    const CT* inp, const CT* weight, const float* mean, const float* rstd, i64 N, int C, int rows_per_block,
    int group) {
  // each warp's running sums: element j of slot vector v at [j / 4][v], component j % 4
  __shared__ V4F acc_w[V4_WARPS][LN_VEC / 4][LN_SLOTS * 32], acc_b[V4_WARPS][LN_VEC / 4][LN_SLOTS * 32];
  __shared__ int flag;
  if (blockDim.x != V4_WARPS * 32) __trap();
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = V4_WARPS, nq = C / LN_VEC;
  int nv = LN_ROWS * nq;  // vectors of a slab
#pragma unroll
  for (int k = 0; k < LN_SLOTS; ++k)
#pragma unroll
    for (int h = 0; h < LN_VEC / 4; ++h) {
      acc_w[warp][h][lane + 32 * k] = V4F{0.f, 0.f, 0.f, 0.f};
      acc_b[warp][h][lane + 32 * k] = V4F{0.f, 0.f, 0.f, 0.f};
    }
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
      for (int h = 0; h < LN_VEC / 4; ++h) {
        V4F aw = acc_w[warp][h][lane + 32 * k], ab = acc_b[warp][h][lane + 32 * k];
        float* pw = &aw.x;
        float* pb = &ab.x;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          int j = 4 * h + u;
          float xh = (ln_elem<CT>(rx[k], j) - mu[k]) * rs[k], dy = ln_elem<CT>(rd[k], j), dxh = dy * ln_elem<CT>(rw, j);
          sa += dxh;
          sx += dxh * xh;
          pw[u] += dy * xh;
          pb[u] += dy;
        }
        acc_w[warp][h][lane + 32 * k] = aw;
        acc_b[warp][h][lane + 32 * k] = ab;
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
  __syncthreads();
  // element (row ro of the slab, column c) is slot vector v = ro * nq + c / LN_VEC, j = c % LN_VEC;
  // added over the slab rows, then over the warps, in that order
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    int h = (c % LN_VEC) >> 2, u = c & 3, cq = c / LN_VEC;
    float w = 0.f, b = 0.f;
    for (int i = 0; i < LN_ROWS; ++i)
      for (int ww = 0; ww < V4_WARPS; ++ww) {
        w += (&acc_w[ww][h][i * nq + cq].x)[u];
        b += (&acc_b[ww][h][i * nq + cq].x)[u];
      }
    pdw[(i64)blockIdx.x * C + c] = w;
    pdb[(i64)blockIdx.x * C + c] = b;
  }
  ln_tree(dweight, dbias, pdw, pdb, counters, C, group, &flag);
}
