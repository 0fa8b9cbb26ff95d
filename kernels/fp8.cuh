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

// Stochastic rounding onto the format's grid: v goes to one of the two grid values around it,
// the upper one with probability (|v| - lower) / quantum, decided by u (16 random bits), with
// integer operations on the float's bits (no conversions: they are quarter rate):
// - |v| >= 2^FP8_EMIN (the format's normal range and above): u goes into the top 16 of the
//   23 - FP8_MANT mantissa bits the format drops, which are then cleared. A carry moves |v| up
//   one quantum (into the next binade where the mantissa overflows): up for floor(frac * 2^16) of
//   the 2^16 values of u, frac = (|v| - lower) / quantum.
// - below 2^FP8_EMIN (the subnormals, where the quantum is 2^(FP8_EMIN - FP8_MANT) whatever the
//   exponent): the same on the bits of s = |v| + 2^FP8_EMIN (a float sum, rounded to nearest to
//   2^(FP8_EMIN - 23)), then s - 2^FP8_EMIN (exact). Values under the smallest subnormal round to
//   0 or to it.
// The result is a float on the grid (or above the largest value, which the saturating conversion
// then clamps); sign kept; infinities and NaN are returned as they are. Its expected value is v to 2^-16 of a quantum: no bias on the many small values that
// rounding to nearest sends the same way every time. ref.fp8_round_stochastic.
__device__ __forceinline__ float fp8_round_stochastic(float v, unsigned int u) {
  const unsigned int drop = 23 - FP8_MANT, keep = ~((1u << drop) - 1u), r = (u & 0xffffu) << (drop - 16);
  const float lo = __uint_as_float((unsigned int)(127 + FP8_EMIN) << 23);  // 2^FP8_EMIN
  unsigned int b = __float_as_uint(v), a = b & 0x7fffffffu;
  bool sub = a < ((unsigned int)(127 + FP8_EMIN) << 23);
  unsigned int y = ((sub ? __float_as_uint(__uint_as_float(a) + lo) : a) + r) & keep;
  float out = sub ? __uint_as_float(y) - lo : __uint_as_float(y);
  return a >= 0x7f800000u ? v : __uint_as_float(__float_as_uint(out) | (b & 0x80000000u));
}

// The per-tensor scale (fp8.cu's casts, layernorm.cu's k_layernorm_fwd_fp8).
#define FP8_MAX_SHIFT 126  // |k| at most this: 2^k and 2^-k stay normal float32 numbers

// scale = 2^k from the float32 bits of amax (ref.fp8_scale); *inv = 2^-k. NaN for a
// non-finite amax, 1 for zero.
__device__ __forceinline__ float fp8_scale(float amax, float* inv) {
  unsigned int u = __float_as_uint(amax) & 0x7fffffffu;
  if (u >= 0x7f800000u) {
    *inv = __uint_as_float(0x7fc00000u);
    return *inv;
  }
  if (u == 0u) {
    *inv = 1.f;
    return 1.f;
  }
  int k = FP8_TOP_EXP - ((int)(u >> 23) - 127) - ((u & 0x7fffffu) > 0x600000u ? 1 : 0);
  k = k > FP8_MAX_SHIFT ? FP8_MAX_SHIFT : (k < -FP8_MAX_SHIFT ? -FP8_MAX_SHIFT : k);
  *inv = __uint_as_float((unsigned int)(127 - k) << 23);
  return __uint_as_float((unsigned int)(127 + k) << 23);
}
