// embed.cu: token + position embedding. k_embed_fwd gathers; k_embed_bwd scatters back without
// floating-point atomics: the positions are sorted by (token, position) as packed keys (each
// key's rank counted directly, k_embed_sort_rank, or a one-block bitonic sort, k_embed_sort),
// then one warp per distinct token sums its rows in position order.
// Launchers: andrea/backends/cuda.py (k_embed_fwd, k_embed_bwd).
#include "common.cuh"

// out (N, C) = wte[tokens[n]] + wpe[n % T]; a token outside [0, V) writes NaN so it shows in the
// loss instead of reading memory it does not own.
extern "C" __global__ void k_embed_fwd(CT* out, const int* tokens, const CT* wte, const CT* wpe,
                                       int N, int T, int C, int V) {
  pdl_wait();
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
  pdl_wait();
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

// The same sorted keys as k_embed_sort, by rank: the keys (tokens[i] << shift) | i are distinct, so
// key i goes to keys[rank], rank = the number of keys smaller than it (the tokens smaller than
// tokens[i], and the equal tokens at earlier positions), counted directly: O(N^2) comparisons
// spread over the whole GPU instead of the one-block sort's O(N log^2 N) steps on one SM; the
// launcher takes it up to a size beyond which the count costs more. Integer counts only, no
// atomics. A block owns ER_KEYS keys, ER_PER_THREAD per thread: thread t holds keys
// (t % ER_GROUPS) * ER_PER_THREAD + 0..ER_PER_THREAD-1 of the block and compares them with the
// slice t / ER_GROUPS of every shared-memory tile of ER_TILE keys (16-byte vectors q of the tile
// with q % ER_SLICES == slice, so a warp's slices read different banks); the slices' counts are
// added in shared memory, then each key is written at its rank. Slots N..P-1 get 0xffffffff.
#define ER_THREADS 256
#define ER_PER_THREAD 4
#define ER_GROUPS 8                                  // threads sharing one slice
#define ER_KEYS (ER_GROUPS * ER_PER_THREAD)          // keys a block ranks: 32
#define ER_SLICES (ER_THREADS / ER_GROUPS)           // 32
#define ER_TILE 2048                                 // keys a shared-memory tile holds
extern "C" __global__ void __launch_bounds__(ER_THREADS) k_embed_sort_rank(unsigned int* keys, const int* tokens,
                                                                          int N, int P, int shift) {
  pdl_wait();
  __shared__ vec16 tile[ER_TILE / 4];
  __shared__ int part[ER_SLICES][ER_KEYS + 1];
  int t = threadIdx.x, g = t % ER_GROUPS, slice = t / ER_GROUPS;
  int i0 = blockIdx.x * ER_KEYS + g * ER_PER_THREAD;
  unsigned int ki[ER_PER_THREAD];
  int cnt[ER_PER_THREAD];
#pragma unroll
  for (int q = 0; q < ER_PER_THREAD; ++q) {
    int i = i0 + q;
    ki[q] = i < N ? (((unsigned int)tokens[i]) << shift) | (unsigned int)i : 0u;
    cnt[q] = 0;
  }
  unsigned int* tk = (unsigned int*)tile;
  for (int j0 = 0; j0 < N; j0 += ER_TILE) {
    int nt = N - j0 < ER_TILE ? N - j0 : ER_TILE;
    __syncthreads();  // the previous tile is no longer read
    for (int j = t; j < ER_TILE; j += ER_THREADS)  // padding 0xffffffff: above every key, counts nothing
      tk[j] = j < nt ? (((unsigned int)tokens[j0 + j]) << shift) | (unsigned int)(j0 + j) : 0xffffffffu;
    __syncthreads();
    int nq = (nt + 3) >> 2;
    for (int q = slice; q < nq; q += ER_SLICES) {
      vec16 v = tile[q];
#pragma unroll
      for (int k = 0; k < ER_PER_THREAD; ++k)
        cnt[k] += (v.w[0] < ki[k]) + (v.w[1] < ki[k]) + (v.w[2] < ki[k]) + (v.w[3] < ki[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < ER_PER_THREAD; ++k) part[slice][g * ER_PER_THREAD + k] = cnt[k];
  __syncthreads();
  if (t < ER_KEYS) {
    int i = blockIdx.x * ER_KEYS + t;
    if (i < N) {
      int r = 0;
      for (int s = 0; s < ER_SLICES; ++s) r += part[s][t];
      keys[r] = (((unsigned int)tokens[i]) << shift) | (unsigned int)i;
    }
  }
  for (int i = N + blockIdx.x * ER_THREADS + t; i < P; i += gridDim.x * ER_THREADS) keys[i] = 0xffffffffu;
}

// dwte[tok] += sum of dout rows whose token is tok, in position order. One warp per sorted slot
// (EW_WARPS slots a block): a slot that does not start a run of equal tokens exits; the warp walks
// the run, lane l adding columns l, l + 32, ... of each row into registers (a row's loads issued
// together, the next key loaded before the row is added), EW_COLS columns a pass. Each column is
// summed from 0 in position order, then added to dwte: the bits of one thread per column.
#define EW_WARPS 8
#define EW_PER_LANE 24  // 768 columns a pass: ANDREA-120M's rows in one
#define EW_COLS (32 * EW_PER_LANE)
extern "C" __global__ void __launch_bounds__(32 * EW_WARPS) k_embed_bwd_wte(float* dwte, const unsigned int* keys,
                                                                         const CT* dout, int N, int C, int shift) {
  pdl_wait();
  int i = blockIdx.x * EW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (i >= N) return;
  unsigned int tok = keys[i] >> shift;
  if (i > 0 && (keys[i - 1] >> shift) == tok) return;
  unsigned int mask = (1u << shift) - 1u;
  for (int c0 = 0; c0 < C; c0 += EW_COLS) {
    float acc[EW_PER_LANE];
#pragma unroll
    for (int m = 0; m < EW_PER_LANE; ++m) acc[m] = 0.f;
    unsigned int k = keys[i];
    for (int j = i; j < N;) {
      const CT* row = dout + (i64)(k & mask) * C + c0;
      ++j;
      unsigned int next = j < N ? keys[j] : 0xffffffffu;  // in flight while this row is added
#pragma unroll
      for (int m = 0; m < EW_PER_LANE; ++m) {
        int c = lane + 32 * m;
        if (c0 + c < C) acc[m] += to_f(row[c]);
      }
      if (j >= N || (next >> shift) != tok) break;
      k = next;
    }
#pragma unroll
    for (int m = 0; m < EW_PER_LANE; ++m) {
      int c = c0 + lane + 32 * m;
      if (c < C) dwte[(i64)tok * C + c] += acc[m];
    }
  }
}

// dwpe[t] += sum over the batch of dout[b, t], b in order. One thread per (t, c).
extern "C" __global__ void k_embed_bwd_wpe(float* dwpe, const CT* dout, int B, int T, int C) {
  pdl_wait();
  i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  if (i >= (i64)T * C) return;
  float acc = 0.f;
  for (int b = 0; b < B; ++b) acc += to_f(dout[(i64)b * T * C + i]);
  dwpe[i] += acc;
}
