// loss.cu: cross-entropy over the tied projection, the fused classifier. The launchers
// (andrea/backends/cuda/ops/) go over the N = B*T rows in chunks the size of the logits
// workspace: per chunk cuBLAS makes logits (R, V) = inp @ wte^T, then the row pass reduces each row
// to its log-sum-exp and loss. k_loss_fwd stops there (evaluation); k_loss_bwd goes on in the same
// pass, turning the row in place into dlogits = (softmax - onehot(target)) * dloss for the two
// backward products of the chunk. So no (B, T, V) buffer exists.
//
// Two row passes, the same arithmetic contract (lse = max + log(sum exp), merged in a fixed order,
// so reruns give the same bits; fwd and bwd of one path give the same lse bits):
// - loss_fwd_regs / loss_bwd_regs (version 2): each row read from memory ONCE. A row of whole
//   16-byte vectors is held in registers, LOSS_NV vectors per thread (LOSS_THREADS threads, both
//   -D options chosen by the launcher from V); lse, loss and dlogits are made from the registers.
//   A block walks rows blockIdx.x, + gridDim.x, ... (the grid is what fits on the GPU at once) and
//   with LOSS_PREFETCH stages its next row in shared memory by cp.async while it computes this
//   one, in two buffers taken in turn, each thread copying and later reading only its own vectors.
//   exp is ex2.approx of (x - m) * log2(e) (one MUFU op per element and pass).
// - loss_fwd / loss_bwd (version 1): one block of 512 threads per row, the row read twice (lse,
//   then dlogits), with expf. Every row that is no whole 16-byte vectors or too long for the
//   registers (float32 at V = 50304) takes it; Tuning.loss_vectors = 0 sends every row to it.
//
// The FP8 classifier (train.precision=fp8, docs/FP8.md "The classifier") uses loss_bwd_fp8 and
// loss_bwd_fp8_regs: the same row passes, but dlogits goes out of place to q8 (R, V) as FP8 bytes
// (fp8.cuh's format) of (softmax - onehot) * 2^FP8_TOP_EXP, the logits row left as it was. Every
// |softmax - onehot| <= 1, so 2^FP8_TOP_EXP (256 for E4M3, 32768 for E5M2) is the scale that
// fp8.cu gives an amax of 1: no amax pass, and no scale that depends on the data. dloss moves to
// the product's scale: block 0 writes *q8_inv = dloss / 2^FP8_TOP_EXP. Rounded to nearest, or
// with -DFP8_SR=1 stochastically (below, at sr_key), which keeps the many small values unbiased.
//
// The ignore index: a row whose target is LOSS_IGNORE (-1, andrea/data/chat.py IGNORE_INDEX: the
// chat loss mask) gets loss 0 and a zero dlogits row (its multiplier is 0), so it adds nothing to
// any gradient; its lse is written as any row's. Any other target outside [0, V) gives a NaN loss.
// A row that counts runs the same arithmetic as before the ignore index existed (its multiplier
// is the same value), so its results keep their bits.
#include "common.cuh"
#include "fp8.cuh"

#define FP8_BOUND_SCALE __uint_as_float((unsigned int)(127 + FP8_TOP_EXP) << 23)  // 2^FP8_TOP_EXP
#define FP8_BOUND_INV __uint_as_float((unsigned int)(127 - FP8_TOP_EXP) << 23)    // 2^-FP8_TOP_EXP
#define LOSS_IGNORE (-1)  // the target of a position the loss skips

// CT_VEC floats to CT_VEC fp8 bytes at dst (CT_VEC-byte aligned): one 8-byte store for 16-bit CT,
// one 4-byte store for float.
__device__ __forceinline__ void store_fp8_vec(unsigned char* dst, const float* p) {
  unsigned int w[CT_VEC / 4];
#pragma unroll
  for (int k = 0; k < CT_VEC / 4; ++k) w[k] = fp8x2(p[4 * k], p[4 * k + 1]) | (fp8x2(p[4 * k + 2], p[4 * k + 3]) << 16);
  if (CT_VEC == 8) *reinterpret_cast<Bytes8*>(dst) = Bytes8{w[0], w[CT_VEC / 4 - 1]};
  else *reinterpret_cast<unsigned int*>(dst) = w[0];
}

// One value to its fp8 byte.
__device__ __forceinline__ unsigned char fp8_byte(float v) { return (unsigned char)(fp8x2(v, 0.f) & 0xffu); }

// -DFP8_SR=1: dlogits rounded stochastically onto the FP8 grid (fp8.cuh fp8_round_stochastic)
// before the conversion, else to nearest. The random bits are a function of the data, no state:
// for the 16-byte group q of a row (elements q * CT_VEC ..., as the vectors lie in memory, the
// elements past V taken as zero bits), key = its four 32-bit words of logits, the row's index in
// the microbatch (row0 + the row in the chunk) and q mixed linearly (sr_key); element i of the
// group takes the low (i even) or high (i odd) 16 bits of sr_mix(key + (i / 2) * SR_STEP),
// murmur3's 32-bit finaliser. The logits change every step, so do the bits; a rerun gives the same
// bytes, whatever the chunks (ref.fp8_sr_bits). The row's index keeps rows of equal logits
// (a prompt every sequence starts with) from rounding alike.
#ifndef FP8_SR
#define FP8_SR 0
#endif
#define SR_STEP 0x9e3779b9u
__device__ __forceinline__ unsigned int sr_mix(unsigned int x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}
__device__ __forceinline__ unsigned int sr_key(const vec16& r, i64 row, int q) {
  return r.w[0] * 0x9e3779b1u + r.w[1] * 0x85ebca77u + r.w[2] * 0xc2b2ae3du + r.w[3] * 0x27d4eb2fu +
         (unsigned int)row * 0x165667b1u + (unsigned int)q;
}
__device__ __forceinline__ float sr_round(float v, unsigned int key, int i) {
  unsigned int w = sr_mix(key + (unsigned int)(i >> 1) * SR_STEP);
  return fp8_round_stochastic(v, i & 1 ? w >> 16 : w);
}
// CT_VEC values of group q (its logits r) rounded in place, FP8_SR only.
__device__ __forceinline__ void sr_vec(float* p, const vec16& r, i64 row, int q) {
#if FP8_SR
  unsigned int key = sr_key(r, row, q);
#pragma unroll
  for (int i = 0; i < CT_VEC; ++i) p[i] = sr_round(p[i], key, i);
#endif
}
// Element j of row x (V elements) rounded as its group's vector would round it (FP8_SR only; row
// here the row's index in the microbatch):
// the group read element by element, for rows that are not whole aligned vectors.
__device__ __forceinline__ float sr_one(float v, const CT* x, int V, i64 row, int j) {
#if FP8_SR
  vec16 r;
  int q = j / CT_VEC, j0 = q * CT_VEC;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if (sizeof(CT) == 4) {
      r.w[w] = j0 + w < V ? ((const unsigned int*)x)[j0 + w] : 0u;
    } else {
      const unsigned short* h = (const unsigned short*)x;
      int i = j0 + 2 * w;
      r.w[w] = (i < V ? h[i] : 0u) | (i + 1 < V ? (unsigned int)h[i + 1] << 16 : 0u);
    }
  }
  return sr_round(v, sr_key(r, row, q), j - j0);
#else
  return v;
#endif
}

// ---------------------------------------------------------------- version 1 (any row)
// Merge CT_VEC values of one 16-byte vector into a thread's online softmax state (m, z): one
// rescale per vector instead of one per element.
__device__ __forceinline__ void merge_vec(const vec16& r, float& m, float& z) {
  float v[CT_VEC], mx = m;
#pragma unroll
  for (int i = 0; i < CT_VEC; ++i) { v[i] = vget(r, i); mx = fmaxf(mx, v[i]); }
  if (mx == NEG_INF) return;  // nothing but -inf so far
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < CT_VEC; ++i) s += expf(v[i] - mx);
  z = z * expf(m - mx) + s;
  m = mx;
}

// The block's (m, z) states merged in the fixed shuffle-tree order; lse = m + log(z) returned to
// every thread (blockDim.x a multiple of 32, at most 1024). Two barriers: the scratch can be
// reused by the next call.
__device__ __forceinline__ float block_lse(float m, float z) {
  __shared__ float sm[32], ss[32], out;
  warp_softmax_state(m, z);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) { sm[warp] = m; ss[warp] = z; }
  __syncthreads();
  if (warp == 0) {
    m = lane < nw ? sm[lane] : NEG_INF;
    z = lane < nw ? ss[lane] : 0.f;
    warp_softmax_state(m, z);
    if (lane == 0) out = m + logf(z);
  }
  __syncthreads();
  return out;
}

// Log-sum-exp of row x (V values) by one block. A row in whole aligned 16-byte vectors is read 16
// bytes per load, two loads in flight per thread; any other row one element at a time.
__device__ __forceinline__ float row_lse(const CT* x, int V) {
  float m = NEG_INF, z = 0.f;
  if (V % CT_VEC == 0 && aligned16(x)) {
    const vec16* xv = (const vec16*)x;
    int nv = V / CT_VEC, j = threadIdx.x;
    for (; j + (int)blockDim.x < nv; j += 2 * blockDim.x) {
      vec16 a = xv[j], b = xv[j + blockDim.x];
      merge_vec(a, m, z);
      merge_vec(b, m, z);
    }
    if (j < nv) merge_vec(xv[j], m, z);
  } else {
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      float v = to_f(x[j]);
      if (v > m) { z = z * expf(m - v) + 1.f; m = v; } else { z += expf(v - m); }
    }
  }
  return block_lse(m, z);
}

// Thread 0 of the block writes the row's lse and loss. A target of LOSS_IGNORE gives loss 0, any
// other outside [0, V) a NaN loss rather than a read out of bounds.
__device__ __forceinline__ void row_loss(float* losses, float* lse, const CT* x, int t, int V, float L) {
  if (threadIdx.x == 0) {
    lse[0] = L;
    losses[0] = (t >= 0 && t < V) ? L - to_f(x[t]) : t == LOSS_IGNORE ? 0.f : __int_as_float(0x7fc00000);
  }
}

// Rows of one chunk, a block each: losses, lse, targets and logits all start at the chunk's first row.
extern "C" __global__ void loss_fwd(float* losses, float* lse, const CT* logits, const int* targets,
                                    i64 N, int V) {
  pdl_wait();
  i64 row = blockIdx.x;
  const CT* x = logits + row * V;
  float L = row_lse(x, V);
  row_loss(losses + row, lse + row, x, targets[row], V, L);
}

// As loss_fwd, then logits[row] = (exp(logits - lse) - [j == target]) * dloss in place; dloss
// is read from the device (the engine's, written by k_step_check) when dloss_ptr is not null.
// Q8: instead q8[row] = fp8((exp(logits - lse) - [j == target]) * 2^FP8_TOP_EXP), logits unchanged.
template <bool Q8>
__device__ __forceinline__ void loss_bwd_row(float* losses, float* lse, CT* logits, const int* targets, int V,
                                             const float* dloss_ptr, float dloss, unsigned char* q8, float* q8_inv,
                                             i64 row0) {
  if (dloss_ptr) dloss = *dloss_ptr;
  if (Q8 && blockIdx.x == 0 && threadIdx.x == 0) *q8_inv = dloss * FP8_BOUND_INV;
  i64 row = blockIdx.x;
  CT* x = logits + row * V;
  unsigned char* o8 = Q8 ? q8 + row * V : nullptr;
  int t = targets[row];
  const float mul = t == LOSS_IGNORE ? 0.f : Q8 ? FP8_BOUND_SCALE : dloss;  // an ignored row: zeros
  float L = row_lse(x, V);
  row_loss(losses + row, lse + row, x, t, V, L);
  __syncthreads();  // thread 0 reads x[t] before it is overwritten
  if (V % CT_VEC == 0 && aligned16(x)) {
    vec16* xv = (vec16*)x;
    for (int q = threadIdx.x; q < V / CT_VEC; q += blockDim.x) {
      vec16 r = xv[q];
      float p[CT_VEC];
#pragma unroll
      for (int i = 0; i < CT_VEC; ++i) {
        int j = q * CT_VEC + i;
        p[i] = (expf(vget(r, i) - L) - (j == t ? 1.f : 0.f)) * mul;
        if (!Q8) vset(r, i, p[i]);
      }
      if (Q8) {
        sr_vec(p, r, row0 + row, q);
        store_fp8_vec(o8 + q * CT_VEC, p);
      } else {
        xv[q] = r;
      }
    }
  } else {
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      float p = expf(to_f(x[j]) - L) - (j == t ? 1.f : 0.f);
      if (Q8) o8[j] = fp8_byte(sr_one(p * mul, x, V, row0 + row, j));
      else x[j] = from_f<CT>(p * mul);
    }
  }
}

extern "C" __global__ void loss_bwd(float* losses, float* lse, CT* logits, const int* targets,
                                    i64 N, int V, const float* dloss_ptr, float dloss) {
  pdl_wait();
  loss_bwd_row<false>(losses, lse, logits, targets, V, dloss_ptr, dloss, nullptr, nullptr, 0);
}

// loss_bwd with dlogits to q8 (R, V) in FP8 (V % CT_VEC == 0 and q8 16-byte aligned, or any row
// by single bytes), *q8_inv = dloss / 2^FP8_TOP_EXP; row0: the chunk's first row in the microbatch
// (FP8_SR's random bits).
extern "C" __global__ void loss_bwd_fp8(float* losses, float* lse, CT* logits, const int* targets,
                                        i64 N, int V, const float* dloss_ptr, float dloss,
                                        unsigned char* q8, float* q8_inv, i64 row0) {
  pdl_wait();
  loss_bwd_row<true>(losses, lse, logits, targets, V, dloss_ptr, dloss, q8, q8_inv, row0);
}

// ---------------------------------------------------------------- version 2 (row in registers)
#ifndef LOSS_NV
#define LOSS_NV 8  // 16-byte vectors of the row per thread: thread i holds vectors i + k * blockDim.x
#endif
#ifndef LOSS_THREADS
#define LOSS_THREADS 1024  // the block size the launcher uses (launch bounds: the register budget)
#endif
#ifndef LOSS_PREFETCH
#define LOSS_PREFETCH 1  // stage the next row in shared memory (2 * LOSS_NV * LOSS_THREADS vectors)
#endif
#define LOSS_LOG2E 1.4426950408889634f

__device__ __forceinline__ float ex2(float x) {  // 2^x, MUFU.EX2 (relative error ~2^-22)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Element i of a 16-byte vector as float, from its 32-bit words (vget goes through memory, which
// for bf16 left the row in a local-memory array at LOSS_NV = 8).
__device__ __forceinline__ float vword(const vec16& r, int i, float*) { return __uint_as_float(r.w[i]); }
__device__ __forceinline__ float vword(const vec16& r, int i, f16*) {
  float f;
  unsigned short h = (unsigned short)(i & 1 ? r.w[i >> 1] >> 16 : r.w[i >> 1] & 0xffffu);
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float vword(const vec16& r, int i, bf16*) {
  return __uint_as_float(i & 1 ? r.w[i >> 1] & 0xffff0000u : r.w[i >> 1] << 16);
}
#define VGET(r, i) vword(r, i, (CT*)0)

// CT_VEC floats into one 16-byte vector, two 16-bit values per conversion instruction.
__device__ __forceinline__ void vpack(vec16& r, const float* p, float*) {
#pragma unroll
  for (int i = 0; i < 4; ++i) r.w[i] = __float_as_uint(p[i]);
}
__device__ __forceinline__ void vpack(vec16& r, const float* p, f16*) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r.w[i]) : "f"(p[2 * i + 1]), "f"(p[2 * i]));
}
__device__ __forceinline__ void vpack(vec16& r, const float* p, bf16*) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r.w[i]) : "f"(p[2 * i + 1]), "f"(p[2 * i]));
}

__device__ __forceinline__ void loss_cp16(vec16* smem, const vec16* gmem) {
  unsigned s;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

// Start copying this thread's vectors of row xv into its slots of buffer buf.
__device__ __forceinline__ void loss_stage(vec16* buf, const vec16* xv, int nv) {
#pragma unroll
  for (int k = 0; k < LOSS_NV; ++k) {
    int q = threadIdx.x + k * LOSS_THREADS;
    if (q < nv) loss_cp16(buf + q, xv + q);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// The row pass of version 2 over rows blockIdx.x, + gridDim.x, ... < N of the chunk (blockDim.x
// must be LOSS_THREADS, and LOSS_NV * LOSS_THREADS vectors must cover the row: the launcher's
// plan). BWD: dlogits in place, dloss_ptr as in loss_bwd; with Q8 to q8 in FP8 instead, as
// loss_bwd_fp8.
template <bool BWD, bool Q8>
__device__ __forceinline__ void loss_rows(float* losses, float* lse, CT* logits, const int* targets, i64 N,
                                          int V, const float* dloss_ptr, float dloss, unsigned char* q8,
                                          float* q8_inv, i64 row0) {
  if (BWD && dloss_ptr) dloss = *dloss_ptr;
  if (Q8 && blockIdx.x == 0 && threadIdx.x == 0) *q8_inv = dloss * FP8_BOUND_INV;
  const float mul = Q8 ? FP8_BOUND_SCALE : dloss;
  const int nv = V / CT_VEC, tid = threadIdx.x;
  vec16 r[LOSS_NV];
#if LOSS_PREFETCH
  extern __shared__ vec16 loss_buf[];  // two buffers of LOSS_NV * LOSS_THREADS vectors
  int b = 0;
  if ((i64)blockIdx.x < N) loss_stage(loss_buf, (const vec16*)(logits + (i64)blockIdx.x * V), nv);
#endif
  for (i64 row = blockIdx.x; row < N; row += gridDim.x) {
    vec16* xv = (vec16*)(logits + row * V);
#if LOSS_PREFETCH
    // this thread's copies of the row have landed (it reads no other thread's slots); the other
    // buffer was last read two rows ago, before the barriers of the last row's block_lse
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    const vec16* cur = loss_buf + b * (LOSS_NV * LOSS_THREADS);
#pragma unroll
    for (int k = 0; k < LOSS_NV; ++k) {
      int q = tid + k * LOSS_THREADS;
      if (q < nv) r[k] = cur[q];
    }
    b ^= 1;
    if (row + gridDim.x < N)
      loss_stage(loss_buf + b * (LOSS_NV * LOSS_THREADS), (const vec16*)(logits + (row + gridDim.x) * V), nv);
#else
#pragma unroll
    for (int k = 0; k < LOSS_NV; ++k) {
      int q = tid + k * LOSS_THREADS;
      if (q < nv) r[k] = xv[q];
    }
#endif
    // this thread's max, then its sum of exp(x - max): no rescaling inside the thread
    float m = NEG_INF, z = 0.f;
#pragma unroll
    for (int k = 0; k < LOSS_NV; ++k)
      if (tid + k * LOSS_THREADS < nv) {
#pragma unroll
        for (int i = 0; i < CT_VEC; ++i) m = fmaxf(m, VGET(r[k], i));
      }
    if (m != NEG_INF) {
#pragma unroll
      for (int k = 0; k < LOSS_NV; ++k)
        if (tid + k * LOSS_THREADS < nv) {
#pragma unroll
          for (int i = 0; i < CT_VEC; ++i) z += ex2((VGET(r[k], i) - m) * LOSS_LOG2E);
        }
    }
    float L = block_lse(m, z);
    int t = targets[row], qt = t / CT_VEC;
    const float mrow = t == LOSS_IGNORE ? 0.f : mul;  // an ignored row: loss 0, dlogits zeros
    if (tid == 0) {
      lse[row] = L;
      if (t < 0 || t >= V) losses[row] = t == LOSS_IGNORE ? 0.f : __int_as_float(0x7fc00000);  // as version 1
    }
    // x[t] read again (one element, from L2) by the thread that holds it, before it overwrites
    // it: picking it out of the registers by a run-time index put the row in local memory
    bool owner = t >= 0 && t < V && tid == qt % LOSS_THREADS;
    float xt = owner ? to_f(logits[row * V + t]) : 0.f;
    if (owner) losses[row] = L - xt;
    if (BWD) {
#pragma unroll
      for (int k = 0; k < LOSS_NV; ++k) {
        int q = tid + k * LOSS_THREADS;
        if (q < nv) {
          float p[CT_VEC];
#pragma unroll
          for (int i = 0; i < CT_VEC; ++i) p[i] = ex2((VGET(r[k], i) - L) * LOSS_LOG2E) * mrow;
          if (Q8) {
            sr_vec(p, r[k], row0 + row, q);
            store_fp8_vec(q8 + row * V + q * CT_VEC, p);
          } else {
            vec16 o;
            vpack(o, p, (CT*)0);
            xv[q] = o;
          }
        }
      }
      // the target's element written once more, with the one-hot: same thread, same address,
      // later in program order (a run-time index into p[] put it in local memory)
      if (owner) {
        float pt = (ex2((xt - L) * LOSS_LOG2E) - 1.f) * mrow;
        if (Q8) q8[row * V + t] = fp8_byte(sr_one(pt, logits + row * V, V, row0 + row, t));
        else logits[row * V + t] = from_f<CT>(pt);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(LOSS_THREADS)
    loss_fwd_regs(float* losses, float* lse, CT* logits, const int* targets, i64 N, int V) {
  pdl_wait();
  loss_rows<false, false>(losses, lse, logits, targets, N, V, nullptr, 0.f, nullptr, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(LOSS_THREADS)
    loss_bwd_regs(float* losses, float* lse, CT* logits, const int* targets, i64 N, int V,
                  const float* dloss_ptr, float dloss) {
  pdl_wait();
  loss_rows<true, false>(losses, lse, logits, targets, N, V, dloss_ptr, dloss, nullptr, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(LOSS_THREADS)
    loss_bwd_fp8_regs(float* losses, float* lse, CT* logits, const int* targets, i64 N, int V,
                      const float* dloss_ptr, float dloss, unsigned char* q8, float* q8_inv, i64 row0) {
  pdl_wait();
  loss_rows<true, true>(losses, lse, logits, targets, N, V, dloss_ptr, dloss, q8, q8_inv, row0);
}
