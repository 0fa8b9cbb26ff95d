// loss_v1.cu: andrea/kernels/loss.cu before 16-byte loads (kept to time against it until the new
// version has won, measured): one element per thread and load, one rescale per element.
//
// loss.cu: cross-entropy over the tied projection, the fused classifier. The launchers
// (andrea/backends/cuda.py) go over the N = B*T rows in chunks the size of the logits workspace:
// per chunk cuBLAS makes logits (R, V) = inp @ wte^T, then one block per row reduces it to its
// log-sum-exp (online max/sum merged in a fixed order) and loss. k_loss_fwd stops there
// (evaluation); k_loss_bwd goes on in the same pass over the row, turning it in place into
// dlogits = (softmax - onehot(target)) * dloss for the two backward products of the chunk. So no
// (B, T, V) buffer exists, and training reads each row of logits twice and writes it once.
#include "common.cuh"

// Log-sum-exp of row x (V values) by one block (blockDim.x a multiple of 32, at most 1024),
// returned to every thread.
__device__ __forceinline__ float row_lse(const CT* x, int V) {
  __shared__ float sm[32], ss[32], out;
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
    if (lane == 0) out = m + logf(z);
  }
  __syncthreads();
  return out;
}

// Thread 0 of the block writes the row's lse and loss. A target outside [0, V) gives a NaN loss
// rather than a read out of bounds.
__device__ __forceinline__ void row_loss(float* losses, float* lse, const CT* x, int t, int V, float L) {
  if (threadIdx.x == 0) {
    lse[0] = L;
    losses[0] = (t >= 0 && t < V) ? L - to_f(x[t]) : __int_as_float(0x7fc00000);
  }
}

// Rows of one chunk: losses, lse, targets and logits all start at the chunk's first row.
extern "C" __global__ void k_loss_fwd(float* losses, float* lse, const CT* logits, const int* targets,
                                      i64 N, int V) {
  i64 row = blockIdx.x;
  const CT* x = logits + row * V;
  float L = row_lse(x, V);
  row_loss(losses + row, lse + row, x, targets[row], V, L);
}

// As k_loss_fwd, then logits[row] = (exp(logits - lse) - [j == target]) * dloss in place; dloss
// is read from the device (the engine's, written by k_step_check) when dloss_ptr is not null.
extern "C" __global__ void k_loss_bwd(float* losses, float* lse, CT* logits, const int* targets,
                                      i64 N, int V, const float* dloss_ptr, float dloss) {
  if (dloss_ptr) dloss = *dloss_ptr;
  i64 row = blockIdx.x;
  CT* x = logits + row * V;
  int t = targets[row];
  float L = row_lse(x, V);
  row_loss(losses + row, lse + row, x, t, V, L);
  __syncthreads();  // thread 0 reads x[t] before it is overwritten
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    float p = expf(to_f(x[j]) - L) - (j == t ? 1.f : 0.f);
    x[j] = from_f<CT>(p * dloss);
  }
}
