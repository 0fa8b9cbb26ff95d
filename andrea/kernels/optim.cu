// optim.cu: global-norm clipping and the AdamW update over the flat float32 buffers, and the
// cast of the master weights to the compute copy. The norm is reduced in fixed chunks
// (k_grad_norm_partial: one block per chunk) and summed in order in float64
// (k_grad_norm_final); k_grad_scale reads the norm on the device, so the clip needs no host
// round trip. k_adamw rounds every operation as NumPy's float32 expression in numpy_ref.k_adamw
// does (the _rn intrinsics forbid fused multiply-adds), so both backends agree to the bit.
#include "common.cuh"

// partials[blockIdx.x] = sum of squares of chunk blockIdx.x; chunk = ceil(n / gridDim.x).
extern "C" __global__ void k_grad_norm_partial(float* partials, const float* grads, i64 n) {
  __shared__ float scratch[32];
  i64 chunk = (n + gridDim.x - 1) / gridDim.x;
  i64 start = blockIdx.x * chunk;
  i64 end = start + chunk < n ? start + chunk : n;
  float s = 0.f;
  for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) { float g = grads[i]; s += g * g; }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// norm[0] = sqrt(sum of partials, in order, in float64) * pre_scale. One thread.
extern "C" __global__ void k_grad_norm_final(float* norm, const float* partials, int P, double pre_scale) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double s = 0.0;
  for (int i = 0; i < P; ++i) s += (double)partials[i];
  norm[0] = (float)(sqrt(s) * pre_scale);
}

// grads *= pre_scale * min(1, max_norm / (norm + 1e-6)); max_norm <= 0 turns clipping off.
extern "C" __global__ void k_grad_scale(float* grads, const float* norm, i64 n, double pre_scale, double max_norm) {
  double clip = 1.0;
  if (max_norm > 0.0) {
    double c = max_norm / ((double)norm[0] + 1e-6);
    clip = c < 1.0 ? c : 1.0;
  }
  float f = (float)(pre_scale * clip);
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    grads[i] = __fmul_rn(grads[i], f);
}

// AdamW, as numpy_ref.k_adamw: m = m*b1 + (1-b1)*g; v = v*b2 + ((1-b2)*g)*g; p[:n_decay] *= decay;
// p -= (step_size * m) / (sqrt(v * vhat_scale) + eps). Scalars arrive rounded to float32 as
// NumPy rounds a Python float against a float32 array.
extern "C" __global__ void k_adamw(float* p, const float* g, float* m, float* v, i64 n, i64 n_decay,
                                   float beta1, float omb1, float beta2, float omb2, float decay,
                                   float step_size, float vhat_scale, float eps) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    float gi = g[i];
    float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(omb1, gi));
    float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(omb2, gi), gi));
    float pi = p[i];
    if (i < n_decay) pi = __fmul_rn(pi, decay);
    float den = __fadd_rn(__fsqrt_rn(__fmul_rn(vi, vhat_scale)), eps);
    p[i] = __fsub_rn(pi, __fdiv_rn(__fmul_rn(step_size, mi), den));
    m[i] = mi;
    v[i] = vi;
  }
}

// dst (compute dtype) = src (float32 master weights), rounded to nearest.
extern "C" __global__ void k_cast_params(CT* dst, const float* src, i64 n) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    dst[i] = from_f<CT>(src[i]);
}
