// embed.cu: token + position embedding. k_embed_fwd gathers; k_embed_bwd scatters back without
// floating-point atomics: the positions are sorted by (token, position) in one block (bitonic
// sort of packed keys), then one block per distinct token sums its rows in position order.
// Launchers: andrea/backends/cuda.py (k_embed_fwd, k_embed_bwd).
#include "common.cuh"

// out (N, C) = wte[tokens[n]] + wpe[n % T]; a token outside [0, V) writes NaN so it shows in the
// loss instead of reading memory it does not own.
extern "C" __global__ void k_embed_fwd(CT* out, const int* tokens, const CT* wte, const CT* wpe,
                                       int N, int T, int C, int V) {
  for (int n = blockIdx.x; n < N; n += gridDim.x) {  // blocks over positions, threads over C
    int tok = tokens[n];
    const CT* e = wte + (i64)tok * C;
    const CT* p = wpe + (i64)(n % T) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float v = (tok >= 0 && tok < V) ? to_f(e[c]) + to_f(p[c]) : __int_as_float(0x7fc00000);
      out[(i64)n * C + c] = from_f<CT>(v);
    }
  }
}

// Sorts keys[i] = (tokens[i] << shift) | i for i < N, padded with 0xffffffff up to P (a power of
// two), ascending. One block; keys live in `keys` (global) or, when use_shared, in dynamic shared
// memory of P * 4 bytes. __syncthreads orders both shared and global accesses within the block.
extern "C" __global__ void k_embed_sort(unsigned int* keys, const int* tokens, int N, int P, int shift,
                                        int use_shared) {
  extern __shared__ unsigned int smem_keys[];
  unsigned int* s = use_shared ? smem_keys : keys;
  for (int i = threadIdx.x; i < P; i += blockDim.x)
    s[i] = i < N ? (((unsigned int)tokens[i]) << shift) | (unsigned int)i : 0xffffffffu;
  __syncthreads();
  for (int k = 2; k <= P; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < P; i += blockDim.x) {
        int ixj = i ^ j;
        if (ixj > i) {
          unsigned int a = s[i], b = s[ixj];
          bool ascending = (i & k) == 0;
          if ((a > b) == ascending) { s[i] = b; s[ixj] = a; }
        }
      }
      __syncthreads();
    }
  }
  if (use_shared)
    for (int i = threadIdx.x; i < P; i += blockDim.x) keys[i] = s[i];
}

// dwte[tok] += sum of dout rows whose token is tok, in position order. grid.x = N sorted slots:
// a slot that does not start a run of equal tokens exits; grid.y * blockDim.x covers C.
extern "C" __global__ void k_embed_bwd_wte(float* dwte, const unsigned int* keys, const CT* dout,
                                           int N, int C, int shift) {
  int i = blockIdx.x;
  int c = blockIdx.y * blockDim.x + threadIdx.x;
  unsigned int tok = keys[i] >> shift;
  if (c >= C || (i > 0 && (keys[i - 1] >> shift) == tok)) return;
  unsigned int mask = (1u << shift) - 1u;
  float acc = 0.f;
  for (int j = i; j < N && (keys[j] >> shift) == tok; ++j)
    acc += to_f(dout[(i64)(keys[j] & mask) * C + c]);
  dwte[(i64)tok * C + c] += acc;
}

// dwpe[t] += sum over the batch of dout[b, t], b in order. One thread per (t, c).
extern "C" __global__ void k_embed_bwd_wpe(float* dwpe, const CT* dout, int B, int T, int C) {
  i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  if (i >= (i64)T * C) return;
  float acc = 0.f;
  for (int b = 0; b < B; ++b) acc += to_f(dout[(i64)b * T * C + i]);
  dwpe[i] += acc;
}
