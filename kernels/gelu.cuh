// gelu.cuh: GELU, tanh form as GPT-2 (ref.GELU_K, _gelu, _gelu_grad), for the kernels that
// apply it: mlp.cu (the 16-bit MLP: gelu, gelu_and_slope) and fp8.cu (the FP8 MLP's act and dact
// passes: gelu_sigmoid_and_slope). One definition per path, so that act = gelu(pre) has the same
// bits whichever kernel of that path computes it.
#pragma once

#define GELU_K 0.7978845608028654f  // sqrt(2 / pi), as ref.GELU_K

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

// The same function as x * sigmoid(2u), u = GELU_K * (x + 0.044715 x^3) (0.5 (1 + tanh u) =
// sigmoid(2u)), with the hardware exponential and a fast reciprocal: a few instructions where
// tanhf takes a few dozen, which made the FP8 path's passes over the 4C-wide pre compute-bound
// (docs/FP8.md). No cancellation in the negative tail, unlike 1 + tanh(u); relative error about
// 1e-6, far below bf16's 2^-9 and E4M3's 2^-4. exp's argument is capped at 80 (e^80 < 2^126, where
// the fast reciprocal would flush to 0): beyond it g and dg are x * e^-80 and below, which round
// to 0 in bf16 as the exact values do; a NaN x stays NaN (fminf's cap takes 80, x carries the NaN).
// Its constants are folded: the exponent as one product x (A + B x^2) = -2u log2(e) for
// ex2.approx.ftz (no range fix-up: a result under 2^-126 is 0, where s is 1 to float32's precision
// anyway) and the slope as two fused multiply-adds, s + x s (1 - s) (C + D x^2): 14 instructions a
// value in the dGELU pass where the unfolded form (in git history) compiled to 22 (SASS, sm_90:
// k_fp8_dgelu_cast_transpose_colsum_amax 840 against 968 instructions,
// k_fp8_gelu_cast_transpose_amax 520 against 616); the cap is the same (80 for -2u).
__device__ __forceinline__ void gelu_sigmoid_and_slope(float x, float& g, float& dg) {
  const float A = -2.0f * GELU_K * 1.4426950408889634f, B = A * 0.044715f;  // -2u log2(e) = x (A + B x^2)
  const float C = 2.0f * GELU_K, D = C * 3.0f * 0.044715f;                 // the slope's C + D x^2
  float x2 = x * x;
  float t = fminf(x * fmaf(B, x2, A), 80.0f * 1.4426950408889634f), e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
  float s = __fdividef(1.0f, 1.0f + e);  // sigmoid(2u)
  g = x * s;
  dg = fmaf(g * (1.0f - s), fmaf(D, x2, C), s);
}
