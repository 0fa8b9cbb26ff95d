// embed_v1.cu: the embedding backward as it was before its keys were sorted by rank and its
// dwte pass took one warp per sorted slot: every B*T sorted by the one-block bitonic sort
// (k_embed_sort, still in andrea/kernels/embed.cu for sizes where the rank count costs more), then
// one block per sorted slot and 128 columns (k_embed_bwd_wte below). The package file is included
// and its k_embed_bwd_wte renamed out of the way; embed_v1.py launches the bitonic sort at every
// size and this k_embed_bwd_wte with its grid.
#define k_embed_bwd_wte k_embed_bwd_wte_current  // the package's version, out of the way
#include "embed.cu"
#undef k_embed_bwd_wte

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
