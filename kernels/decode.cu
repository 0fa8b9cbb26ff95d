// decode.cu: attention of one new position against a key/value cache. Inference only, so there is
// no backward twin; the NumPy reference of the same name is andrea/backends/ref/decode.py's.
//
// k_attn_decode_fwd: grid (NH, B), one block per head of each sequence. The block first writes
// the position's k and v (its head's slice of qkv) into row pos of the caches, then computes the
// pos + 1 scores q . k_j / sqrt(hs) (one warp per key, lanes over the head dimension, the fixed
// shuffle tree), their softmax (block max, then block sum of exp(s - max)), and the weighted sum
// of the cached values (one thread per output element, keys in order). Arithmetic in float; the
// caches and the output are in the compute dtype. Shared memory: ctx + hs + 32 floats.
#include "common.cuh"

__device__ __forceinline__ float block_max(float v, float* scratch) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nw ? scratch[lane] : NEG_INF;
  return warp_max(v);
}

// out (B,1,C); kcache, vcache (B,ctx,C); qkv (B,1,3C); 0 <= pos < ctx; blockDim.x a multiple of 32.
extern "C" __global__ void k_attn_decode_fwd(CT* out, CT* kcache, CT* vcache, const CT* qkv, int NH, int hs,
                                             int ctx, int pos, float scale) {
  pdl_wait();
  extern __shared__ float sm[];
  float* s = sm;            // scores, then probabilities (unnormalised), pos + 1 of them
  float* q = sm + ctx;      // the query of this head, hs
  float* scratch = q + hs;  // 32, for the block reductions
  const int h = blockIdx.x, b = blockIdx.y, C = NH * hs, n = pos + 1;
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
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int j = warp; j < n; j += nw) {
    const CT* kj = kc + (i64)j * C;
    float a = 0.f;
    for (int d = lane; d < hs; d += 32) a += q[d] * to_f(kj[d]);
    a = warp_sum(a);
    if (lane == 0) s[j] = a * scale;
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
  const float inv = 1.f / z;
  CT* o = out + (i64)b * C + h * hs;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float a = 0.f;
    for (int j = 0; j < n; ++j) a += s[j] * to_f(vc[(i64)j * C + d]);
    o[d] = from_f<CT>(a * inv);
  }
}
