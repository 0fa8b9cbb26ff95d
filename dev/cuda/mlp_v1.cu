// mlp_v1.cu: andrea/kernels/mlp.cu before 16-byte loads and the fused GELU + dGELU pass (kept to
// time against it until the new version has won, measured). Launched by mlp_v1.py.
//
// mlp.cu: the elementwise parts of k_mlp_fwd / k_mlp_bwd (andrea/backends/cuda/ops.py), around the
// two products, named by the operation they belong to: k_mlp_fwd_bias_gelu (the first bias fused
// with GELU, tanh form as GPT-2; only when cuBLASLt's bias + GELU epilogue does not apply),
// k_mlp_bwd_gelu (GELU recomputed from the saved pre-activation) and k_mlp_bwd_dgelu (the GELU
// derivative; only without cuBLASLt's dGELU epilogue). The second bias and the bias gradients
// are linear.cu's k_bias_add and k_colsum_*.
#include "common.cuh"

#define GELU_K 0.7978845608028654f  // sqrt(2 / pi), as numpy_ref.GELU_K

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(GELU_K * (x + 0.044715f * x * x * x)));
}

// pre (N, H) += b1 (rounded to CT, as saved); act = gelu(pre).
// Blocks stride over rows, threads over columns (no 64-bit division per element).
extern "C" __global__ void k_mlp_fwd_bias_gelu(CT* pre, CT* act, const CT* b1, i64 N, int H) {
  for (i64 r = blockIdx.x; r < N; r += gridDim.x)
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
      i64 i = r * H + c;
      CT v = from_f<CT>(to_f(pre[i]) + to_f(b1[c]));
      pre[i] = v;
      act[i] = from_f<CT>(gelu(to_f(v)));
    }
}

// act = gelu(pre): the backward pass recomputes what the forward pass did not keep.
extern "C" __global__ void k_mlp_bwd_gelu(CT* act, const CT* pre, i64 total) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
    act[i] = from_f<CT>(gelu(to_f(pre[i])));
}

// dact *= gelu'(pre).
extern "C" __global__ void k_mlp_bwd_dgelu(CT* dact, const CT* pre, i64 total) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    float x = to_f(pre[i]);
    float u = GELU_K * (x + 0.044715f * x * x * x);
    float th = tanhf(u);
    float g = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    dact[i] = from_f<CT>(to_f(dact[i]) * g);
  }
}
