// fp8.cuh: the FP8 format a kernel file is compiled for, and the conversion to it, shared by
// fp8.cu (the operands of the linear layers) and loss.cu (the classifier's dlogits, written in FP8
// by its row pass). -DFP8_E5M2=1 for E5M2, else E4M3. The conversion is the sm_89+ instruction
// cvt.rn.satfinite.{e4m3,e5m2}x2.f32: round to nearest even, saturating to the largest finite
// value, NaN stays NaN; built for an older GPU it traps, and the backend refuses
// train.precision=fp8 there before any launch.
#pragma once

#ifndef FP8_E5M2
#define FP8_E5M2 0
#endif
#if FP8_E5M2
#define FP8_TOP_EXP 15  // largest finite E5M2 value 57344 = 1.75 * 2^15
#define FP8_MANT 2      // mantissa bits
#define FP8_EMIN (-14)  // exponent of the smallest normal value
#else
#define FP8_TOP_EXP 8  // largest finite E4M3 value 448 = 1.75 * 2^8
#define FP8_MANT 3
#define FP8_EMIN (-6)
#endif

// Eight fp8 bytes, stored as one 8-byte word (element i in byte i).
struct alignas(8) Bytes8 { unsigned int x, y; };

// Two floats to two fp8 bytes: lo in the low byte (the first in memory), hi in the high one.
__device__ __forceinline__ unsigned int fp8x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
#if FP8_E5M2
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
#endif
  return r;
#else
  __trap();  // no FP8 conversion below sm_89: never launched there (the backend refuses first)
  return 0u;
#endif
}

// Stochastic rounding onto the format's grid: v rounded to one of the two grid values around it,
// the upper one with probability (|v| - lower) / quantum, decided by u (16 random bits): with
// t = |v| / quantum (exact, a power of two), the result is floor(t + u / 2^16) * quantum, t taken
// with 16 fractional bits (truncated). The quantum is 2^(e - FP8_MANT) for |v| = 1.m * 2^e, the
// subnormals' 2^(FP8_EMIN - FP8_MANT) below 2^FP8_EMIN, so values under the smallest subnormal
// round to 0 or to it. The result is a float on the grid (or above the largest value, which the
// saturating conversion then clamps); infinities and NaN are returned as they are. Sign kept.
// The expected value of the result is v (to 2^-16 of a quantum): no bias on the many small
// values that round to nearest would send the same way every time. numpy_ref.fp8_round_stochastic.
__device__ __forceinline__ float fp8_round_stochastic(float v, unsigned int u) {
  unsigned int b = __float_as_uint(v), a = b & 0x7fffffffu;
  if (a >= 0x7f800000u) return v;
  int e = (int)(a >> 23) - 127;
  int qe = (e > FP8_EMIN ? e : FP8_EMIN) - FP8_MANT;  // the quantum's exponent
  float t = __uint_as_float(a) * __uint_as_float((unsigned int)(127 - qe) << 23);  // < 2^(FP8_MANT+1)
  unsigned int T = __float2uint_rz(t * 65536.f);
  float r = (float)((T + (u & 0xffffu)) >> 16) * __uint_as_float((unsigned int)(127 + qe) << 23);
  return __uint_as_float(__float_as_uint(r) | (b & 0x80000000u));
}
