// optim.cu: the optimizer step on the device, with no host round trip. The gradient norm is
// reduced in fixed chunks (k_grad_norm_partial: one block per chunk); k_step_check (one thread,
// with a small block's help) sums the chunks in order in float64, applies the non-finite policy
// and the dynamic loss scale to the optimizer state (a small float64 array, slots below) and
// writes the step's scalars;
// k_adamw_step then makes one pass over params, grads, m and v: unscale and clip the gradient,
// AdamW, the cast to the compute copy, and (if asked) zero the gradient for the next step. Every float32
// operation is rounded as NumPy's expression in ref/optim.py (the _rn intrinsics forbid fused
// multiply-adds), and every float64 one as Python's, so both backends agree to the bit.
#include "common.cuh"

// Slots of the optimizer state; interface.STATE_SLOTS lists the same names in the same order.
enum {
  S_SCALE, S_GOOD, S_BAD, S_SKIPPED, S_LOSS_SUM,  // carried from step to step (and checkpointed)
  S_LOSS, S_NORM, S_REC_SCALE, S_SKIP,            // the record of the last step
  S_CLIP, S_DECAY, S_STEP_SIZE, S_VHAT,           // float32 values for k_adamw_step
  S_LR, S_STEP,                                   // written by the host before the step
  STATE_LEN
};

// partials[blockIdx.x] = sum of squares of chunk blockIdx.x; chunk = ceil(n / gridDim.x).
// (float4 loads measured no faster on an H200: 0.131 against 0.129 ms for 124M gradients.)
extern "C" __global__ void k_grad_norm_partial(float* partials, const float* grads, i64 n) {
  pdl_wait();
  __shared__ float scratch[32];
  i64 chunk = (n + gridDim.x - 1) / gridDim.x;
  i64 start = blockIdx.x * chunk;
  i64 end = start + chunk < n ? start + chunk : n;
  float s = 0.f;
  for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) { float g = grads[i]; s += g * g; }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// state[S_LOSS_SUM] += sum of losses (N positions of one microbatch) in float64: one block,
// each thread a strided share, then the fixed block tree.
extern "C" __global__ void k_loss_accum(double* state, const float* losses, i64 N) {
  pdl_wait();
  __shared__ double scratch[32];
  double s = 0.0;
  for (i64 i = threadIdx.x; i < N; i += blockDim.x) s += (double)losses[i];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  s = warp_sum_d(s);
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < nw ? scratch[lane] : 0.0;
    s = warp_sum_d(s);
    if (lane == 0) state[S_LOSS_SUM] += s;
  }
}

__device__ __forceinline__ bool finite_d(double x) { return x - x == 0.0; }

// Global-norm clipping under the seed's names, as separate kernels (ref/optim.py k_grad_norm_final,
// k_grad_scale): the engine's step runs the fused form (k_step_check, then k_adamw_step), which
// computes the same values. k_grad_norm_final: state[S_NORM] = sqrt of the partials' sum, added in
// order in float64 as k_step_check adds them, rounded to float32 (k_step_check's norm when
// n_micro * scale is 1); one thread.
extern "C" __global__ void k_grad_norm_final(double* state, const float* partials, int P) {
  pdl_wait();
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double ss = 0.0;
  for (int i = 0; i < P; ++i) ss = __dadd_rn(ss, (double)partials[i]);
  state[S_NORM] = (double)(float)sqrt(ss);
}

// grads (n) *= f, f = min(1, max_norm / (state[S_NORM] + 1e-6)) in float64 rounded to float32 (1
// where max_norm <= 0): the clip factor k_step_check writes and k_adamw_step multiplies by. A
// non-finite norm leaves grads as they are (the fused step skips such a step).
extern "C" __global__ void k_grad_scale(float* grads, const double* state, i64 n, double max_norm) {
  pdl_wait();
  double norm = state[S_NORM];
  if (!finite_d(norm)) return;
  double clip = 1.0;
  if (max_norm > 0.0) {
    double c = __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6));
    clip = c < 1.0 ? c : 1.0;
  }
  float f = (float)clip;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    grads[i] = __fmul_rn(grads[i], f);
}

// The end-of-step bookkeeping of ref.k_step_check, in the same float64 order, by one thread
// (thread 0) of a block of SC_THREADS: the block first copies the partials into shared memory (all
// loads in flight at once, not one dependent load per term), then thread 0 adds them in order
// while warps 1 and 2 compute beta1^t and beta2^t (float64 pow, hundreds of cycles each, which do
// not depend on the sum), then thread 0 does the rest. Partials beyond SC_SHARED are read from
// global memory. norm = sqrt(sum partials) / (n_micro * scale) (the averaged, unscaled gradient's
// norm, rounded to float32); loss = loss sum / (n_micro * n_pos). Non-finite loss or norm: skip
// (fp16 halves the scale; an fp16 overflow with a finite loss does not count towards the bad
// streak); otherwise the clip factor and the AdamW scalars of update number step - skipped, and
// the scale may grow.
#define SC_THREADS 96
#define SC_SHARED 4096
extern "C" __global__ void __launch_bounds__(SC_THREADS) k_step_check(
    double* state, float* dloss, const float* partials, int P, int n_micro, double n_pos, double beta1,
    double beta2, double weight_decay, double max_norm, int fp16, double growth_interval, double max_scale) {
  pdl_wait();
  __shared__ float sp[SC_SHARED];
  __shared__ double pw[2];
  if (blockDim.x < 65) __trap();  // threads 32 and 64 compute the powers
  if (blockIdx.x != 0) return;
  int ps = P < SC_SHARED ? P : SC_SHARED;
  for (int i = threadIdx.x; i < ps; i += blockDim.x) sp[i] = partials[i];
  double t = __dsub_rn(state[S_STEP], state[S_SKIPPED]);  // update number (unchanged below until used)
  __syncthreads();
  if (threadIdx.x == 32) pw[0] = pow(beta1, t);
  if (threadIdx.x == 64) pw[1] = pow(beta2, t);
  double ss = 0.0;
  if (threadIdx.x == 0) {
#pragma unroll 16
    for (int i = 0; i < ps; ++i) ss = __dadd_rn(ss, (double)sp[i]);
    for (int i = ps; i < P; ++i) ss = __dadd_rn(ss, (double)partials[i]);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double scale = state[S_SCALE];
  double pre_scale = __ddiv_rn(1.0, __dmul_rn((double)n_micro, scale));
  float normf = (float)__dmul_rn(sqrt(ss), pre_scale);
  double norm = (double)normf;
  double loss = __ddiv_rn(__ddiv_rn(state[S_LOSS_SUM], n_pos), (double)n_micro);
  state[S_LOSS_SUM] = 0.0;
  state[S_LOSS] = loss;
  state[S_NORM] = norm;
  state[S_REC_SCALE] = scale;
  if (!(finite_d(loss) && finite_d(norm))) {
    state[S_SKIP] = 1.0;
    state[S_SKIPPED] += 1.0;
    state[S_GOOD] = 0.0;
    bool overflow = fp16 && finite_d(loss) && scale > 1.0;
    if (fp16) scale = fmax(1.0, scale * 0.5);
    state[S_BAD] = overflow ? 0.0 : state[S_BAD] + 1.0;
  } else {
    state[S_SKIP] = 0.0;
    double clip = 1.0;
    if (max_norm > 0.0) {
      double c = __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6));
      clip = c < 1.0 ? c : 1.0;
    }
    double lr = state[S_LR];
    double mhat = __ddiv_rn(1.0, __dsub_rn(1.0, pw[0]));
    double vhat = __ddiv_rn(1.0, __dsub_rn(1.0, pw[1]));
    state[S_CLIP] = (double)(float)__dmul_rn(pre_scale, clip);
    state[S_DECAY] = (double)(float)__dsub_rn(1.0, __dmul_rn(lr, weight_decay));
    state[S_STEP_SIZE] = (double)(float)__dmul_rn(lr, mhat);
    state[S_VHAT] = (double)(float)vhat;
    state[S_BAD] = 0.0;
    state[S_GOOD] += 1.0;
    if (fp16 && state[S_GOOD] >= growth_interval) {
      scale = fmin(max_scale, scale * 2.0);
      state[S_GOOD] = 0.0;
    }
  }
  state[S_SCALE] = scale;
  *dloss = (float)__ddiv_rn(scale, n_pos);
}

// The update of ref.k_adamw_step for one element: g = grads * clip; m = m*b1 + (1-b1)*g;
// v = v*b2 + ((1-b2)*g)*g; p *= decay (decay = 1 beyond n_decay is not used: the multiply is
// skipped there, as NumPy's slice skips it); p -= (step_size * m) / (sqrt(v * vhat) + eps).
struct AdamW {
  float clip, decay, step_size, vhat_scale, beta1, omb1, beta2, omb2, eps;
  __device__ __forceinline__ float step(float pi, float& mi, float& vi, float g, bool decayed) const {
    float gi = __fmul_rn(g, clip);
    mi = __fadd_rn(__fmul_rn(mi, beta1), __fmul_rn(omb1, gi));
    vi = __fadd_rn(__fmul_rn(vi, beta2), __fmul_rn(__fmul_rn(omb2, gi), gi));
    if (decayed) pi = __fmul_rn(pi, decay);
    float den = __fadd_rn(__fsqrt_rn(__fmul_rn(vi, vhat_scale)), eps);
    return __fsub_rn(pi, __fdiv_rn(__fmul_rn(step_size, mi), den));
  }
};

// AdamW on four consecutive elements, the first at flat index i.
__device__ __forceinline__ float4 adamw4(const AdamW& a, float4 pv, float4& mv, float4& vv, float4 gv, i64 i,
                                         i64 n_decay) {
  pv.x = a.step(pv.x, mv.x, vv.x, gv.x, i < n_decay);
  pv.y = a.step(pv.y, mv.y, vv.y, gv.y, i + 1 < n_decay);
  pv.z = a.step(pv.z, mv.z, vv.z, gv.z, i + 2 < n_decay);
  pv.w = a.step(pv.w, mv.w, vv.w, gv.w, i + 3 < n_decay);
  return pv;
}

// Four compute-dtype values as one 8-byte (fp16/bf16) or 16-byte (float) store.
template <typename T> struct alignas(4 * sizeof(T)) Vec4 { T v[4]; };

// The update of float4 vector j in place (p, m, v; g read): the new weights.
__device__ __forceinline__ float4 adamw_vec4(const AdamW& a, float* p, const float* g, float* m, float* v, i64 j,
                                             i64 n_decay) {
  float4 gv = ((const float4*)g)[j], mv = ((float4*)m)[j], vv = ((float4*)v)[j], pv = ((float4*)p)[j];
  pv = adamw4(a, pv, mv, vv, gv, 4 * j, n_decay);
  ((float4*)p)[j] = pv;
  ((float4*)m)[j] = mv;
  ((float4*)v)[j] = vv;
  return pv;
}

// Four float32 values rounded to the compute dtype.
__device__ __forceinline__ Vec4<CT> to_ct4(float4 x) {
  Vec4<CT> c;
  c.v[0] = from_f<CT>(x.x); c.v[1] = from_f<CT>(x.y);
  c.v[2] = from_f<CT>(x.z); c.v[3] = from_f<CT>(x.w);
  return c;
}

// The whole update of ref.k_adamw_step in one pass: AdamW (above) on every element, the
// cast to the compute copy pc (when cast), and grads = 0 (when zero; the engine leaves them: the
// next step's first backward pass writes every gradient). A skipped step does nothing else.
// Version 2: with every buffer 16-byte aligned (pc: 4 elements aligned) each thread moves float4
// vectors (one 16-byte load or store per buffer and 4 elements), the last n % 4 elements one at a
// time; the arithmetic per element is the same, so are the bits (version 1, one element per
// thread and iteration, is in git history).
extern "C" __global__ void k_adamw_step(float* p, CT* pc, float* g, float* m, float* v,
                                        const double* state, i64 n, i64 n_decay, float beta1,
                                        float omb1, float beta2, float omb2, float eps, int cast,
                                        int zero) {
  pdl_wait();
  bool skip = state[S_SKIP] != 0.0;
  AdamW a{(float)state[S_CLIP], (float)state[S_DECAY], (float)state[S_STEP_SIZE], (float)state[S_VHAT],
          beta1, omb1, beta2, omb2, eps};
  i64 stride = (i64)gridDim.x * blockDim.x, t0 = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  i64 done = 0;
  bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) &&
             (!cast || ((unsigned long long)pc % (4 * sizeof(CT))) == 0);
  if (vec) {
    i64 nv = n / 4;
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
    for (i64 j = t0; j < nv; j += stride) {
      if (!skip) {
        float4 pv = adamw_vec4(a, p, g, m, v, j, n_decay);
        if (cast) ((Vec4<CT>*)pc)[j] = to_ct4(pv);
      }
      if (zero) ((float4*)g)[j] = zero4;
    }
    done = nv * 4;
  }
  for (i64 i = done + t0; i < n; i += stride) {
    if (!skip) {
      float mi = m[i], vi = v[i];
      float pi = a.step(p[i], mi, vi, g[i], i < n_decay);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
      if (cast) pc[i] = from_f<CT>(pi);
    }
    if (zero) g[i] = 0.f;
  }
}

// The FP8 weight cache's amax from the update itself (train.precision=fp8):
// k_adamw_step, and for each weight t of the cache's table (cuda/fp8/quant.py make_table: row t =
// {its compute copy's address, ..., R, K}, nt rows, in increasing address order) meta[t *
// meta_stride] = max(that, max |pc| over the weight's R * K elements) as fp8.cu's k_fp8_amax_many
// takes it (the bits of |value| in the compute dtype, an unsigned maximum, so NaN wins; the
// launcher zeroes meta first). A skipped step leaves the weights and still reads them for their
// amax. The refresh of the cache then casts without its amax pass (ref.k_adamw_step_amax).
// The launcher asks: every buffer 16-byte aligned (pc: 4 elements), n % 4 == 0, every weight
// inside pc at a multiple of 4 elements (so no float4 straddles two), nt <= ADAMW_AMAX_MAX.
// The same grid-stride walk over float4s as k_adamw_step, made warp-uniform (lane l of a warp
// takes vector base + l): each lane keeps the maximum of the weight its vector is in (a binary
// search of the weights' bounds in shared memory when it leaves them) and when any lane of the
// warp moves to another weight or to a gap the warp folds the lanes of each weight together
// (__match_any_sync, __reduce_max_sync) and one lane a weight reduces it into meta (a RED: no
// value comes back). Launch bounds of 5 blocks an SM: 48 registers (bf16); 4 gives 50 and measured
// the same, 6 gives 40 with 52 bytes of spills in the loop and measured 0.1 ms a step slower
// (k_adamw_step: 40, 6 blocks). Version 1 gave each block one contiguous
// run of the buffer (1056 blocks, 54 registers): 1.24 ms a step at ANDREA-120M on an H200,
// against 0.93 for k_adamw_step and its amax pass 0.07.
#define ADAMW_AMAX_MAX 256
struct AmaxRun {  // the weight (row >= 0) or the gap (row -1) of elements [lo, hi)
  i64 lo, hi;
  int row;
};
__device__ __forceinline__ AmaxRun amax_run(i64 e, const i64* lo, const i64* hi, int nt, i64 n) {
  int a = 0, b = nt;  // b: the first weight starting above e
  while (a < b) {
    int c = (a + b) >> 1;
    if (lo[c] <= e) a = c + 1; else b = c;
  }
  if (b > 0 && e < hi[b - 1]) return AmaxRun{lo[b - 1], hi[b - 1], b - 1};
  return AmaxRun{b > 0 ? hi[b - 1] : 0, b < nt ? lo[b] : n, -1};
}
__device__ __forceinline__ void amax_fold(float* meta, int meta_stride, int row, unsigned int& mx) {
  unsigned int same = __match_any_sync(0xffffffffu, row);
  unsigned int top = __reduce_max_sync(same, mx);
  if (row >= 0 && top != 0u && (int)(threadIdx.x & 31) == __ffs(same) - 1)
    atomicMax(reinterpret_cast<unsigned int*>(meta + (i64)row * meta_stride), top);
  mx = 0u;
}
extern "C" __global__ void __launch_bounds__(256, 5) k_adamw_step_amax(float* p, CT* pc, float* g, float* m, float* v, const double* state,
                                             i64 n, i64 n_decay, float beta1, float omb1, float beta2, float omb2,
                                             float eps, int zero, const i64* table, int nt, float* meta,
                                             int meta_stride) {
  pdl_wait();
  __shared__ i64 s_lo[ADAMW_AMAX_MAX], s_hi[ADAMW_AMAX_MAX];
  for (int t = threadIdx.x; t < nt; t += blockDim.x) {
    s_lo[t] = (table[t * 5] - (i64)pc) / (i64)sizeof(CT);
    s_hi[t] = s_lo[t] + table[t * 5 + 3] * table[t * 5 + 4];
  }
  __syncthreads();
  bool skip = state[S_SKIP] != 0.0;
  AdamW a{(float)state[S_CLIP], (float)state[S_DECAY], (float)state[S_STEP_SIZE], (float)state[S_VHAT],
          beta1, omb1, beta2, omb2, eps};
  const int lane = threadIdx.x & 31;
  const i64 stride = (i64)gridDim.x * blockDim.x, nv = n / 4;
  AmaxRun run{0, 0, -1};
  unsigned int mx = 0u;
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
  for (i64 jw = blockIdx.x * (i64)blockDim.x + threadIdx.x - lane; jw < nv; jw += stride) {  // warp-uniform
    i64 j = jw + lane;
    bool live = j < nv, move = live && (4 * j < run.lo || 4 * j >= run.hi);
    if (__any_sync(0xffffffffu, move)) {
      amax_fold(meta, meta_stride, run.row, mx);
      if (move) run = amax_run(4 * j, s_lo, s_hi, nt, n);
    }
    if (!live) continue;
    Vec4<CT> c;
    if (!skip) {
      c = to_ct4(adamw_vec4(a, p, g, m, v, j, n_decay));
      ((Vec4<CT>*)pc)[j] = c;
    } else if (run.row >= 0) {
      c = ((const Vec4<CT>*)pc)[j];
    }
    if (run.row >= 0) {
#pragma unroll
      for (int k = 0; k < 4; ++k) mx = umax(mx, __float_as_uint(to_f(c.v[k])) & 0x7fffffffu);
    }
    if (zero) ((float4*)g)[j] = zero4;
  }
  amax_fold(meta, meta_stride, run.row, mx);
}

// dst (compute dtype) = src (float32 master weights), rounded to nearest.
extern "C" __global__ void k_cast_params(CT* dst, const float* src, i64 n) {
  pdl_wait();
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    dst[i] = from_f<CT>(src[i]);
}
