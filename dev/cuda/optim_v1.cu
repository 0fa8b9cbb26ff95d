// optim_v1.cu: version 1 of k_grad_norm_partial and k_adamw_step, one float per load and thread
// (the package's version 2 moves float4 vectors; the arithmetic per element is the same). Kept
// until the harness has timed both: python dev/cuda/harness.py optim main v1
#define k_grad_norm_partial k_grad_norm_partial_current
#define k_adamw_step k_adamw_step_current
#include "optim.cu"
#undef k_grad_norm_partial
#undef k_adamw_step

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

extern "C" __global__ void k_adamw_step(float* p, CT* pc, float* g, float* m, float* v,
                                        const double* state, i64 n, i64 n_decay, float beta1,
                                        float omb1, float beta2, float omb2, float eps, int cast) {
  bool skip = state[S_SKIP] != 0.0;
  float clip = (float)state[S_CLIP], decay = (float)state[S_DECAY];
  float step_size = (float)state[S_STEP_SIZE], vhat_scale = (float)state[S_VHAT];
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    if (!skip) {
      float gi = __fmul_rn(g[i], clip);
      float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(omb1, gi));
      float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(omb2, gi), gi));
      float pi = p[i];
      if (i < n_decay) pi = __fmul_rn(pi, decay);
      float den = __fadd_rn(__fsqrt_rn(__fmul_rn(vi, vhat_scale)), eps);
      pi = __fsub_rn(pi, __fdiv_rn(__fmul_rn(step_size, mi), den));
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
      if (cast) pc[i] = from_f<CT>(pi);
    }
    g[i] = 0.f;
  }
}
