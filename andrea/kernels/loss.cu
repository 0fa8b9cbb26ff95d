// loss.cu: cross-entropy over the tied projection. The logits (N, V) = inp @ wte^T come from
// cuBLAS into the engine's logits workspace; k_loss_fwd reduces each row to its log-sum-exp
// (one block per row, online max/sum merged in a fixed order) and the loss; k_loss_bwd turns the
// row into dlogits = (softmax - onehot(target)) * dloss in place for the two backward products.
#include "common.cuh"

// One block per row (blockDim.x a multiple of 32, at most 1024). A target outside [0, V)
// gives a NaN loss rather than a read out of bounds.
extern "C" __global__ void k_loss_fwd(float* losses, float* lse, const CT* logits, const int* targets,
                                      i64 N, int V) {
  __shared__ float sm[32], ss[32];
  i64 row = blockIdx.x;
  const CT* x = logits + row * V;
  float m = NEG_INF, z = 0.f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    float v = to_f(x[j]);
    if (v > m) { z = z * expf(m - v) + 1.f; m = v; } else { z += expf(v - m); }
  }
  warp_softmax_state(m, z);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) { sm[warp] = m; ss[warp] = z; }
  __syncthreads();
  if (warp == 0) {
    m = lane < nw ? sm[lane] : NEG_INF;
    z = lane < nw ? ss[lane] : 0.f;
    warp_softmax_state(m, z);
    if (lane == 0) {
      float L = m + logf(z);
      int t = targets[row];
      lse[row] = L;
      losses[row] = (t >= 0 && t < V) ? L - to_f(x[t]) : __int_as_float(0x7fc00000);
    }
  }
}

// logits[row] = (exp(logits - lse) - [j == target]) * dloss, one block per row; dloss is read
// from the device (the engine's, written by k_step_check) when dloss_ptr is not null.
extern "C" __global__ void k_loss_bwd(CT* logits, const float* lse, const int* targets, i64 N, int V,
                                      const float* dloss_ptr, float dloss) {
  if (dloss_ptr) dloss = *dloss_ptr;
  i64 row = blockIdx.x;
  CT* x = logits + row * V;
  float L = lse[row];
  int t = targets[row];
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    float p = expf(to_f(x[j]) - L) - (j == t ? 1.f : 0.f);
    x[j] = from_f<CT>(p * dloss);
  }
}
