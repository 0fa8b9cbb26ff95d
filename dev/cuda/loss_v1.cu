// loss_v1.cu: version 1 of andrea/kernels/loss.cu, the row pass with one block of 512 threads per
// row that reads the row twice (launched by loss_v1.py). Version 2 holds the row in registers and
// reads it once; version 1's kernels stay in the package file (loss_fwd / loss_bwd) for the rows
// version 2 does not take.
//
// loss.cu: cross-entropy over the tied projection, the fused classifier. The launchers
// (andrea/backends/cuda.py) go over the N = B*T rows in chunks the size of the logits workspace:
// per chunk cuBLAS makes logits (R, V) = inp @ wte^T, then one block per row reduces it to its
// log-sum-exp (online max/sum merged in a fixed order) and loss. k_loss_fwd stops there
// (evaluation); k_loss_bwd goes on in the same pass over the row, turning it in place into
// dlogits = (softmax - onehot(target)) * dloss for the two backward products of the chunk. So no
// (B, T, V) buffer exists, and training reads each row of logits twice and writes it once.
#include "common.cuh"

// Merge CT_VEC values of one 16-byte vector into a thread's online softmax state (m, z): one
// rescale per vector instead of one per element.
__device__ __forceinline__ void merge_vec(const vec16& r, float& m, float& z) {
  float v[CT_VEC], mx = m;
#pragma unroll
  for (int i = 0; i < CT_VEC; ++i) { v[i] = vget(r, i); mx = fmaxf(mx, v[i]); }
  if (mx == NEG_INF) return;  // nothing but -inf so far
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < CT_VEC; ++i) s += expf(v[i] - mx);
  z = z * expf(m - mx) + s;
  m = mx;
}

// Log-sum-exp of row x (V values) by one block (blockDim.x a multiple of 32, at most 1024),
// returned to every thread. A row in whole aligned 16-byte vectors is read 16 bytes per load, two
// loads in flight per thread (version 1, in git history, loaded one element per thread and
// waited on memory latency); any other row one element at a time.
__device__ __forceinline__ float row_lse(const CT* x, int V) {
  __shared__ float sm[32], ss[32], out;
  float m = NEG_INF, z = 0.f;
  if (V % CT_VEC == 0 && aligned16(x)) {
    const vec16* xv = (const vec16*)x;
    int nv = V / CT_VEC, j = threadIdx.x;
    for (; j + (int)blockDim.x < nv; j += 2 * blockDim.x) {
      vec16 a = xv[j], b = xv[j + blockDim.x];
      merge_vec(a, m, z);
      merge_vec(b, m, z);
    }
    if (j < nv) merge_vec(xv[j], m, z);
  } else {
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      float v = to_f(x[j]);
      if (v > m) { z = z * expf(m - v) + 1.f; m = v; } else { z += expf(v - m); }
    }
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
  if (V % CT_VEC == 0 && aligned16(x)) {
    vec16* xv = (vec16*)x;
    for (int q = threadIdx.x; q < V / CT_VEC; q += blockDim.x) {
      vec16 r = xv[q];
#pragma unroll
      for (int i = 0; i < CT_VEC; ++i) {
        int j = q * CT_VEC + i;
        vset(r, i, (expf(vget(r, i) - L) - (j == t ? 1.f : 0.f)) * dloss);
      }
      xv[q] = r;
    }
  } else {
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      float p = expf(to_f(x[j]) - L) - (j == t ? 1.f : 0.f);
      x[j] = from_f<CT>(p * dloss);
    }
  }
}
