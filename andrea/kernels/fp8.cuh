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
#else
#define FP8_TOP_EXP 8  // largest finite E4M3 value 448 = 1.75 * 2^8
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
