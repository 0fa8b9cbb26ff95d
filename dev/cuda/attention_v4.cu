// attention_v4.cu: andrea/kernels/attention.cu with k_attn_flash_D as it was before it read 16-byte
// vectors (one warp per head row, 2-byte loads; attention_v4.py launches it so); kept to time
// against the new one until it has won, measured. The rest is the package file itself.
#define k_attn_flash_D k_attn_flash_D_current  // the package's version, out of the way
#include "attention.cu"
#undef k_attn_flash_D

// D (B*NH, T) = rowsum(dout * out) per head: one warp per row.
extern "C" __global__ void k_attn_flash_D(float* Dv, const HT* dout, const HT* out, int B, int T, int NH) {
  i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= (i64)B * NH * T) return;
  int i = (int)(row % T), h = (int)((row / T) % NH);
  i64 b = row / ((i64)T * NH);
  i64 o = (b * T + i) * (i64)(NH * HS) + (i64)h * HS;
  float D = 0.f;
  for (int d = lane; d < HS; d += 32) D += to_f(dout[o + d]) * to_f(out[o + d]);
  D = warp_sum(D);
  if (lane == 0) Dv[row] = D;
}
