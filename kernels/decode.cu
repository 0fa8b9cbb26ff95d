// decode.cu: attention of new positions against a key/value cache, and the other kernels of the
// batched decoder (andrea/use/batch.py). Inference only, so there is no backward twin; the NumPy
// references of the same names are andrea/backends/ref/decode.py's.
//
// k_attn_decode_fwd: grid (NH, B), one block per head of each sequence. The block first writes
// the position's k and v (its head's slice of qkv) into row pos of the caches, then computes the
// pos + 1 scores q . k_j / sqrt(hs) (a thread a key in 16-byte loads; where the head's row is no
// power-of-two count of 16-byte chunks up to 32, a warp a key, lanes over the head dimension, the
// fixed shuffle tree), their softmax (block max, then block sum of exp(s - max)), and the weighted
// sum of the cached values (warps over the keys, lanes over 16-byte chunks of the head's row or
// over its elements, the lanes' and then the warps' partials added in a fixed order). Arithmetic in float; the caches and the output are in the compute dtype.
// Block DECODE_THREADS, head size at most DECODE_MAX_HS. Shared memory: ctx + hs + 32 + 8 hs floats.
// k_attn_decode_batch_fwd: the same with each sequence at its own position, read from lengths.
// k_attn_shared_fwd: the same block for a row of an option scored after a shared context
// (andrea/tasks/shared.py): its keys and values are the context's rows, where the context's own
// forward pass left them, then the option's rows up to itself; nothing is written to a cache.
// k_decode_embed_fwd, k_decode_cache_fill: the step's embedding and the prefill's cache copy.
// k_sample_fwd: the per-request sampler (greedy, temperature, top_k, top_p; counter-based noise).
// k_decode_linear_fwd, k_decode_logits_gemv: the step's products for a few rows (N <= 8): a warp an
// output column, its lanes over the inputs in 16-byte loads, every row's dot product in the same
// fixed order whatever N is (so a row's result never depends on the others), the bias (and GELU)
// on the float sum: the weights are read once, at close to the copy bandwidth.
//
// Version 2 (against version 1, which git keeps: dev/cuda/decode_v1.cu, removed once this one won;
// docs/BENCHMARKS.md 2026-12-03 "decode.cu version 2": ANDREA-120M fp16 one stream 2,678 tokens/s
// against 1,430 (few-row products) and 1,521 (cuBLAS layers), 12M 6,897 against 5,337, H200):
// (1) the step's products and the attention hint their weights (the key/value rows of the earlier
// positions) into L2 before waiting on the kernel before them (common.cuh's pdl_prefetch_wait), so
// those reads leave HBM while that kernel runs; (2) the attention's scores are a thread a key in
// 16-byte loads (all of a key's loads in flight at once), its values a lane a 16-byte chunk of the
// head's row, where the head size allows it (else version 1's loops); (3) k_decode_ln_linear_fwd
// normalises its rows with the whole block, where version 1 took a warp a row; (4) k_sample_fwd's
// greedy pass loads the logits 16 bytes at a time.
#include "common.cuh"
#include "gelu.cuh"

__device__ __forceinline__ float block_max(float v, float* scratch) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nw ? scratch[lane] : NEG_INF;
  return warp_max(v);
}

#define DECODE_THREADS 256  // 8 warps a block (the launchers' block size)
#define DECODE_MAX_HS 128    // head sizes up to this: each lane holds hs / 32 output partials

// The attention of one query (q, hs floats in shared memory, scaled by scale) over nA keys and
// values at kA, vA (row stride sA elements), then, where TWO, nB more at kB, vB (stride sB): the
// scores a thread a key (16-byte loads where the head's row is a power-of-two count of 16-byte
// chunks up to 32 and every row is 16-byte aligned, else a warp a key), their softmax (block max,
// block sum of exp(s - max)), and the weighted sum of the values (warps over the keys, lanes over
// 16-byte chunks of the head's row or over its elements, the lanes' and then the warps' partials
// added in a fixed order) into o (hs). s: nA + nB floats, scratch: 32, part: (warps, hs).
// The values are split over the warps (warp w takes keys w, w + nw, ...), whose partials are added
// in warp order: every key's load is independent, where one thread a dimension walking all keys in
// turn waited on each load.
template <bool TWO>
__device__ __forceinline__ void attn_rows_block(CT* o, const float* q, const CT* kA, const CT* vA, i64 sA, int nA,
                                                const CT* kB, const CT* vB, i64 sB, int nB, int hs, float scale,
                                                float* s, float* scratch, float* part) {
  const int n = TWO ? nA + nB : nA;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  constexpr int VEC = 16 / (int)sizeof(CT);
  const int G = hs / VEC;  // 16-byte chunks of a head's row
  // the 16-byte path: whole chunks, a power of two of them dividing a warp, aligned rows
  const bool fast = hs % VEC == 0 && G <= 32 && (32 % G) == 0 && aligned16(kA) && aligned16(vA) && sA % VEC == 0 &&
                    (!TWO || (aligned16(kB) && aligned16(vB) && sB % VEC == 0));
#define ROW(base, j) (TWO && (j) >= nA ? base##B + (i64)((j) - nA) * sB : base##A + (i64)(j) * sA)
  if (fast) {
    // a thread a key: the key's chunks loaded together, q read from shared memory (a broadcast)
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const vec16* kj = reinterpret_cast<const vec16*>(ROW(k, j));
      float a = 0.f;
#pragma unroll 8
      for (int g = 0; g < G; ++g) {
        const vec16 r = kj[g];
#pragma unroll
        for (int i = 0; i < VEC; ++i) a += q[g * VEC + i] * vget(r, i);
      }
      s[j] = a * scale;
    }
  } else {
    // unrolled so that a warp's loads of four keys are in flight together
#pragma unroll 4
    for (int j = warp; j < n; j += nw) {
      const CT* kj = ROW(k, j);
      float a = 0.f;
      for (int d = lane; d < hs; d += 32) a += q[d] * to_f(kj[d]);
      a = warp_sum(a);
      if (lane == 0) s[j] = a * scale;
    }
  }
  __syncthreads();
  float m = NEG_INF;
  for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, s[j]);
  m = block_max(m, scratch);
  float z = 0.f;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    float e = expf(s[j] - m);
    s[j] = e;
    z += e;
  }
  z = block_sum(z, scratch);  // its first barrier also publishes every s[j]
  if (fast) {
    // lane = kg * G + g: chunk g of keys j = warp * KPW + kg, then + nw * KPW, ...; the lanes of
    // one chunk added by the xor tree over kg, the warps' partials in warp order below
    const int g = lane % G, kg = lane / G, KPW = 32 / G;
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
#pragma unroll 4
    for (int j = warp * KPW + kg; j < n; j += nw * KPW) {
      const float pj = s[j];
      const vec16 r = reinterpret_cast<const vec16*>(ROW(v, j))[g];
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += pj * vget(r, i);
    }
    for (int o = G; o < 32; o <<= 1)
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
    if (kg == 0)
#pragma unroll
      for (int i = 0; i < VEC; ++i) part[warp * hs + g * VEC + i] = acc[i];
  } else {
    float acc[DECODE_MAX_HS / 32];
#pragma unroll
    for (int i = 0; i < DECODE_MAX_HS / 32; ++i) acc[i] = 0.f;
#pragma unroll 4
    for (int j = warp; j < n; j += nw) {
      const float pj = s[j];
      const CT* vj = ROW(v, j);
#pragma unroll
      for (int i = 0; i < DECODE_MAX_HS / 32; ++i)
        if (lane + 32 * i < hs) acc[i] += pj * to_f(vj[lane + 32 * i]);
    }
#pragma unroll
    for (int i = 0; i < DECODE_MAX_HS / 32; ++i)
      if (lane + 32 * i < hs) part[warp * hs + lane + 32 * i] = acc[i];
  }
#undef ROW
  __syncthreads();
  const float inv = 1.f / z;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float a = 0.f;
    for (int w = 0; w < nw; ++w) a += part[w * hs + d];
    o[d] = from_f<CT>(a * inv);
  }
}

// The block of head h of sequence b at position pos: see the header. Shared memory: the scores
// (ctx), q (hs), 32 reduction slots, the warps' partial outputs (8 hs).
__device__ __forceinline__ void attn_decode_block(CT* out, CT* kcache, CT* vcache, const CT* qkv, int NH, int hs,
                                                  int ctx, int pos, float scale, int h, int b) {
  extern __shared__ float sm[];
  float* q = sm + ctx;
  const int C = NH * hs;
  const CT* row = qkv + (i64)b * 3 * C;
  CT* kc = kcache + (i64)b * ctx * C + h * hs;
  CT* vc = vcache + (i64)b * ctx * C + h * hs;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    int c = h * hs + d;
    q[d] = to_f(row[c]);
    kc[(i64)pos * C + d] = row[C + c];
    vc[(i64)pos * C + d] = row[2 * C + c];
  }
  __syncthreads();  // the new cache row and q are visible to the whole block
  attn_rows_block<false>(out + (i64)b * C + h * hs, q, kc, vc, C, pos + 1, nullptr, nullptr, 0, 0, hs, scale, sm,
                         q + hs, q + hs + 32);
}

// The key/value rows 0..pos-1 of head h of sequence b (their bytes, stride, count) for the hints
// before the wait: rows written by earlier steps, never by the kernel before this one (pos itself is
// written by this block). pos clamped into the cache.
#define DECODE_HINT_ROWS(pos) ((pos) < 0 ? 0 : ((pos) > ctx ? ctx : (pos)))

// out (B,1,C); kcache, vcache (B,ctx,C); qkv (B,1,3C); 0 <= pos < ctx; blockDim.x a multiple of 32.
extern "C" __global__ void k_attn_decode_fwd(CT* out, CT* kcache, CT* vcache, const CT* qkv, int NH, int hs,
                                             int ctx, int pos, float scale) {
  pdl_prefetch_wait(kcache + (i64)blockIdx.y * ctx * NH * hs + blockIdx.x * hs,
                    vcache + (i64)blockIdx.y * ctx * NH * hs + blockIdx.x * hs, DECODE_HINT_ROWS(pos),
                    hs * (int)sizeof(CT), (i64)NH * hs * sizeof(CT));
  attn_decode_block(out, kcache, vcache, qkv, NH, hs, ctx, pos, scale, blockIdx.x, blockIdx.y);
}

// ---------------------------------------------------------------- batched decoding (andrea/use/batch.py)
// N slots, each at its own position lengths[n] (device memory: one captured graph serves them all).

// k_attn_decode_batch_fwd: k_attn_decode_fwd with sequence b at position lengths[b]. Grid (NH, N).
// lengths[b] is read before the wait, only to size the hints (the sampler of the step before wrote
// it; a stale value would only hint other rows).
extern "C" __global__ void k_attn_decode_batch_fwd(CT* out, CT* kcache, CT* vcache, const CT* qkv,
                                                   const int* lengths, int NH, int hs, int ctx, float scale) {
  pdl_prefetch_wait(kcache + (i64)blockIdx.y * ctx * NH * hs + blockIdx.x * hs,
                    vcache + (i64)blockIdx.y * ctx * NH * hs + blockIdx.x * hs, DECODE_HINT_ROWS(lengths[blockIdx.y]),
                    hs * (int)sizeof(CT), (i64)NH * hs * sizeof(CT));
  attn_decode_block(out, kcache, vcache, qkv, NH, hs, ctx, lengths[blockIdx.y], scale, blockIdx.x, blockIdx.y);
}

// ---------------------------------------------------------------- shared-context scoring (andrea/tasks/shared.py)

// k_attn_shared_fwd: the attention of an option's rows after its item's shared context, the context
// read where its own forward pass left it. Row r of qkv (R,1,3C) attends to plen[r] keys and values
// of saved (M,3C) from row pre[r] on (the context), then to the rows first[r]..r of qkv (its
// option's rows up to itself): out (R,1,C) = the row of k_attn_fwd on the whole sequence. Grid
// (R, NH) (rows may be more than a grid's 65,535 y-blocks), a block a head of a row; shared memory
// as the decode attention's, ctx >= plen + rows.
extern "C" __global__ void k_attn_shared_fwd(CT* out, const CT* qkv, const CT* saved, const int* pre,
                                             const int* plen, const int* first, int NH, int hs, int ctx,
                                             float scale) {
  pdl_wait();
  extern __shared__ float sm_rows[];  // (another name than attn_decode_block's: another linkage)
  float* q = sm_rows + ctx;
  const int C = NH * hs, r = blockIdx.x, h = blockIdx.y;
  const CT* row = qkv + (i64)r * 3 * C;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) q[d] = to_f(row[h * hs + d]);
  __syncthreads();
  const CT* ctxk = saved + (i64)pre[r] * 3 * C + C + h * hs;
  const CT* own = qkv + (i64)first[r] * 3 * C + C + h * hs;
  attn_rows_block<true>(out + (i64)r * C + h * hs, q, ctxk, ctxk + C, 3 * C, plen[r], own, own + C, 3 * C,
                        r - first[r] + 1, hs, scale, sm_rows, q + hs, q + hs + 32);
}

// k_decode_embed_fwd: out (N,1,C) = wte[tokens[n]] + wpe[lengths[n]]. Grid N, a block a row.
extern "C" __global__ void k_decode_embed_fwd(CT* out, const int* tokens, const int* lengths, const CT* wte,
                                              const CT* wpe, int C) {
  pdl_wait();
  const int n = blockIdx.x;
  const CT* e = wte + (i64)tokens[n] * C;
  const CT* p = wpe + (i64)lengths[n] * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) out[(i64)n * C + c] = from_f<CT>(to_f(e[c]) + to_f(p[c]));
}

// k_decode_cache_fill: kcache, vcache (L,N,ctx,C)[l, slot, r] = the k, v thirds of qkv (L,1,T,3C)[l, 0, r]
// for r < n: the prefill's keys and values of every layer, one launch. Grid-stride over L*n*C.
extern "C" __global__ void k_decode_cache_fill(CT* kcache, CT* vcache, const CT* qkv, int L, int N, int ctx, int T,
                                               int C, int slot, int n) {
  pdl_wait();
  const i64 total = (i64)L * n * C;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const int c = (int)(i % C), r = (int)((i / C) % n), l = (int)(i / ((i64)n * C));
    const CT* row = qkv + ((i64)l * T + r) * 3 * C;
    const i64 dst = (((i64)l * N + slot) * ctx + r) * C + c;
    kcache[dst] = row[C + c];
    vcache[dst] = row[2 * C + c];
  }
}

// ---------------------------------------------------------------- sampling
// k_sample_fwd: one block (1024 threads) a slot; the token at position pos = lengths[n] + 1 from
// logits[n] (V floats), as ref.sample_row: greedy (the first largest) at temperature <= 0; else
// z = logits / temperature, kept = the top_k largest z (0: all) and of those the smallest set of
// the largest whose softmax mass reaches top_p (ties at a threshold kept); each threshold is the
// largest order key K of a float whose count (top_k) or mass (top_p) of z with key >= K reaches
// the bound, found by bisection over the 32-bit keys with fixed-order block sums. Then the
// Gumbel-max draw: argmax over kept v of z_v - log(-log(u_v)), u_v from splitmix64 of (seed, pos,
// v) (the first index on ties). Writes tokens[n] and lengths[n] = min(pos, ctx - 1); a slot that is
// not live gets token 0 at row 0.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// floats as unsigned integers in their order (-inf lowest)
__device__ __forceinline__ unsigned int order_key(float f) {
  unsigned int u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// (value, index) of the block's largest value, the smallest index on ties; every thread gets it
__device__ __forceinline__ void block_argmax(float& v, int& i, float* sv, int* si) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int pass = 0; pass < 2; ++pass) {
    for (int o = 16; o > 0; o >>= 1) {
      float v2 = __shfl_xor_sync(0xffffffffu, v, o);
      int i2 = __shfl_xor_sync(0xffffffffu, i, o);
      if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
    }
    if (pass == 1) break;
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = lane < nw ? sv[lane] : NEG_INF;
    i = lane < nw ? si[lane] : 0x7fffffff;
  }
}
// the largest key K >= lo whose measure (count, or mass of exp(z - zmax)) over z with key >= K
// (and >= lo) is at least bound; every thread calls it
__device__ unsigned int bisect_key(const float* lg, float t, int V, unsigned int lo, float zmax, bool mass,
                                   float bound, float* scratch) {
  unsigned int hi = 0xffffffffu;
  while (lo < hi) {
    unsigned int mid = lo + (unsigned int)(((unsigned long long)hi - lo + 1) >> 1);
    float a = 0.f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      float z = lg[v] / t;  // divided as the reference divides: the same keys
      if (order_key(z) >= mid) a += mass ? expf(z - zmax) : 1.f;
    }
    a = block_sum(a, scratch);
    if (a >= bound) lo = mid; else hi = mid - 1;
  }
  return lo;
}
extern "C" __global__ void k_sample_fwd(int* tokens, int* lengths, const float* logits, const float* temperature,
                                        const int* top_k, const float* top_p, const unsigned long long* seeds,
                                        const int* live, int V, int ctx) {
  pdl_wait();
  __shared__ float scratch[32];
  __shared__ int iscratch[32];
  const int n = blockIdx.x;
  if (!live[n]) {  // a free slot: token 0 at row 0, so its row costs nothing in the next steps
    if (threadIdx.x == 0) tokens[n] = lengths[n] = 0;
    return;
  }
  const int pos = lengths[n] + 1;
  const float* lg = logits + (i64)n * V;
  const float t = temperature[n];
  float best = NEG_INF;
  int arg = 0x7fffffff;
  if (!(t > 0.f)) {
    if ((V & 3) == 0 && aligned16(lg)) {
      // 16-byte loads, a thread's four values in index order: 12 loads a thread at V = 50304
      const vec16* l4 = reinterpret_cast<const vec16*>(lg);
#pragma unroll 4
      for (int q = threadIdx.x; q < (V >> 2); q += blockDim.x) {
        const vec16 r = l4[q];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float x = __uint_as_float(r.w[i]);
          if (x > best) { best = x; arg = 4 * q + i; }
        }
      }
    } else {
#pragma unroll 8  // loads in flight together
      for (int v = threadIdx.x; v < V; v += blockDim.x)
        if (lg[v] > best) { best = lg[v]; arg = v; }
    }
  } else {
    float zmax = NEG_INF;
    for (int v = threadIdx.x; v < V; v += blockDim.x) zmax = fmaxf(zmax, lg[v] / t);
    zmax = block_max(zmax, scratch);
    unsigned int thr = 0;
    const int k = top_k[n];
    if (k > 0 && k < V) thr = bisect_key(lg, t, V, 0u, zmax, false, (float)k, scratch);
    const float p = top_p[n];
    if (p < 1.f) {
      float zs = 0.f;
      for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float z = lg[v] / t;
        if (order_key(z) >= thr) zs += expf(z - zmax);
      }
      zs = block_sum(zs, scratch);
      thr = bisect_key(lg, t, V, thr, zmax, true, p * zs, scratch);
    }
    const unsigned long long key = splitmix64(seeds[n] ^ splitmix64((unsigned long long)pos));
#pragma unroll 4
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      float z = lg[v] / t;
      if (order_key(z) < thr) continue;
      unsigned long long h = splitmix64(key + (unsigned long long)v);
      float u = ((float)(unsigned int)(h >> 41) + 0.5f) * 1.1920928955078125e-7f;  // 2^-23
      float s = z - logf(-logf(u));
      if (s > best) { best = s; arg = v; }
    }
  }
  block_argmax(best, arg, scratch, iscratch);
  if (threadIdx.x == 0) {
    tokens[n] = arg;
    lengths[n] = pos < ctx - 1 ? pos : ctx - 1;
  }
}

// ---------------------------------------------------------------- the step's products, few rows
#define GEMV_MAX_ROWS 8  // interface.DECODE_GEMV_ROWS

// acc[r] = the dot product of row r of inp (N, IC) with row o of w (OC, IC), r < N, summed by each
// lane over its 16-byte chunks in order, then the warp's shuffle tree. vec: IC a multiple of the
// chunk and inp, w 16-byte aligned (the launcher checks); else one element at a time.
__device__ __forceinline__ void gemv_column(float* acc, const CT* inp, const CT* w, int N, int IC, int o, int vec) {
  const int lane = threadIdx.x & 31;
  const CT* wr = w + (i64)o * IC;
#pragma unroll
  for (int r = 0; r < GEMV_MAX_ROWS; ++r) acc[r] = 0.f;
  if (vec) {
    constexpr int VEC = 16 / sizeof(CT);
#pragma unroll 4  // four weight loads in flight a lane: a 3072-wide row is twelve chunks a lane
    for (int k = lane * VEC; k < IC; k += 32 * VEC) {
      union { uint4 u; CT c[VEC]; } wv;
      wv.u = *reinterpret_cast<const uint4*>(wr + k);
#pragma unroll
      for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r >= N) break;
        union { uint4 u; CT c[VEC]; } xv;
        xv.u = *reinterpret_cast<const uint4*>(inp + (i64)r * IC + k);
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) a += to_f(wv.c[i]) * to_f(xv.c[i]);
        acc[r] += a;
      }
    }
  } else {
    for (int k = lane; k < IC; k += 32) {
      float wk = to_f(wr[k]);
      for (int r = 0; r < N; ++r) acc[r] += wk * to_f(inp[(i64)r * IC + k]);
    }
  }
#pragma unroll
  for (int r = 0; r < GEMV_MAX_ROWS; ++r) acc[r] = warp_sum(acc[r]);
}

// The rows of w (OC, IC) that this block's warps take (a warp an output column): where they start
// and their bytes, for the hints before the wait.
__device__ __forceinline__ const CT* gemv_block_rows(const CT* w, int IC) {
  return w + (i64)blockIdx.x * (blockDim.x >> 5) * IC;
}
__device__ __forceinline__ i64 gemv_block_bytes(int OC, int IC) {
  const int per = blockDim.x >> 5, left = OC - (int)blockIdx.x * per;
  return (i64)(left < per ? left : per) * IC * (i64)sizeof(CT);
}

// out (N,1,OC) = inp (N,1,IC) @ w (OC,IC).T + b, then GELU (tanh form) where gelu; N <= 8.
extern "C" __global__ void k_decode_linear_fwd(CT* out, const CT* inp, const CT* w, const CT* b, int N, int IC,
                                               int OC, int gelu_, int vec) {
  pdl_prefetch_wait(gemv_block_rows(w, IC), gemv_block_bytes(OC, IC));
  const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (o >= OC) return;
  float acc[GEMV_MAX_ROWS];
  gemv_column(acc, inp, w, N, IC, o, vec);
  if ((threadIdx.x & 31) == 0) {
    const float bias = to_f(b[o]);
    for (int r = 0; r < N; ++r) {
      float y = acc[r] + bias;
      out[(i64)r * OC + o] = from_f<CT>(gelu_ ? gelu(y) : y);
    }
  }
}

// logits (N,V) float32 = inp (N,1,C) @ wte (V,C).T; N <= 8.
extern "C" __global__ void k_decode_logits_gemv(float* logits, const CT* inp, const CT* wte, int N, int C, int V,
                                                int vec) {
  pdl_prefetch_wait(gemv_block_rows(wte, C), gemv_block_bytes(V, C));
  const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (o >= V) return;
  float acc[GEMV_MAX_ROWS];
  gemv_column(acc, inp, wte, N, C, o, vec);
  if ((threadIdx.x & 31) == 0)
    for (int r = 0; r < N; ++r) logits[(i64)r * V + o] = acc[r];
}

// k_decode_ln_linear_fwd: res = a + b (rounded to CT, as k_residual_add; written by block 0), or
// res = a where has_b is 0 (not written); each row's layer norm of res (rounded to CT, as
// k_layernorm_fwd writes it) into shared memory; then out = that @ w.T + bias, GELU where gelu_:
// k_residual_layernorm_fwd and k_decode_linear_fwd in one launch, every block normalising the N
// rows (N <= 8) itself, all its threads on each row. Shared memory: N * C values of CT.
#define DECODE_LN_EPS 1e-5f  // layernorm.cu's LN_EPS (torch's default, ref.LN_EPS)
extern "C" __global__ void k_decode_ln_linear_fwd(CT* out, CT* res, const CT* a, const CT* b, int has_b,
                                                  const CT* ln_w, const CT* ln_b, const CT* w, const CT* bias,
                                                  int N, int C, int OC, int gelu_, int vec) {
  pdl_prefetch_wait(gemv_block_rows(w, C), gemv_block_bytes(OC, C));
  extern __shared__ __align__(16) unsigned char smraw[];
  CT* xs = reinterpret_cast<CT*>(smraw);  // (N, C): the normalised rows, the product's input
  __shared__ float red[GEMV_MAX_ROWS][32];  // the warps' partial sums of each row
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  // the whole block on every row: thread t takes columns t, t + blockDim.x, ... of each row (the
  // rows' loads in flight together); a row's sum is the threads' in column order, the warps' xor
  // tree, then the warps' in order; its mean, then the sum of squared deviations the same way
  float st[GEMV_MAX_ROWS], mu[GEMV_MAX_ROWS], rs[GEMV_MAX_ROWS];
#pragma unroll
  for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
    st[r] = 0.f;
    if (r >= N) continue;
    const CT* ar = a + (i64)r * C;
    const CT* br = b + (i64)r * C;
    CT* xr = xs + r * C;
#pragma unroll 4
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      CT v = has_b ? from_f<CT>(to_f(ar[c]) + to_f(br[c])) : ar[c];
      if (has_b && blockIdx.x == 0) res[(i64)r * C + c] = v;
      xr[c] = v;
      st[r] += to_f(v);
    }
  }
#pragma unroll
  for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
    if (r >= N) continue;
    st[r] = warp_sum(st[r]);
    if (lane == 0) red[r][warp] = st[r];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
    if (r >= N) continue;
    float t = 0.f;
    for (int k = 0; k < nw; ++k) t += red[r][k];
    mu[r] = t / C;
    const CT* xr = xs + r * C;
    st[r] = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {  // this thread's own columns: no barrier needed
      const float d = to_f(xr[c]) - mu[r];
      st[r] += d * d;
    }
    st[r] = warp_sum(st[r]);
  }
  __syncthreads();  // every warp has read red[] before it is written again
#pragma unroll
  for (int r = 0; r < GEMV_MAX_ROWS; ++r)
    if (r < N && lane == 0) red[r][warp] = st[r];
  __syncthreads();
#pragma unroll
  for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
    if (r >= N) continue;
    float t = 0.f;
    for (int k = 0; k < nw; ++k) t += red[r][k];
    rs[r] = 1.0f / sqrtf(t / C + DECODE_LN_EPS);
    CT* xr = xs + r * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
      xr[c] = from_f<CT>((to_f(xr[c]) - mu[r]) * rs[r] * to_f(ln_w[c]) + to_f(ln_b[c]));
  }
  __syncthreads();  // every row normalised before any warp's product reads it
  const int o = blockIdx.x * nw + warp;
  if (o >= OC) return;
  float acc[GEMV_MAX_ROWS];
  gemv_column(acc, xs, w, N, C, o, vec);
  if (lane == 0) {
    const float bo = to_f(bias[o]);
    for (int r = 0; r < N; ++r) {
      float y = acc[r] + bo;
      out[(i64)r * OC + o] = from_f<CT>(gelu_ ? gelu(y) : y);
    }
  }
}
