// gelu.cuh: GELU, tanh form as GPT-2 (numpy_ref.GELU_K, _gelu, _gelu_grad), for the kernels that
// apply it: mlp.cu (the 16-bit MLP) and fp8.cu (the FP8 MLP's act and dact passes). One
// definition, so that act = gelu(pre) has the same bits whichever kernel computes it.
#pragma once

#define GELU_K 0.7978845608028654f  // sqrt(2 / pi), as numpy_ref.GELU_K

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(GELU_K * (x + 0.044715f * x * x * x)));
}

// g = gelu(x) and dg = gelu'(x) from one tanh. The backward pass's act (k_mlp_bwd_gelu) and the
// FP8 path's act (fp8.cu) both take g from here.
__device__ __forceinline__ void gelu_and_slope(float x, float& g, float& dg) {
  float th = tanhf(GELU_K * (x + 0.044715f * x * x * x));
  g = 0.5f * x * (1.0f + th);
  dg = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
}
