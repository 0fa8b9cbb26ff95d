// optim_v1.cu: k_step_check as andrea/kernels/optim.cu had it before its block helped: one
// thread reads the partials from global memory one after another and computes the powers
// itself (25 us at ANDREA-12M's step on an H200); kept to time against the package's version.
// The package file is included and its k_step_check renamed out of the way; optim_v1.py
// launches this one with one warp, as before.
#define k_step_check k_step_check_current  // the package's version, out of the way
#include "optim.cu"
#undef k_step_check

// One thread: the end-of-step bookkeeping of numpy_ref.k_step_check, in the same float64 order.
// norm = sqrt(sum partials) / (n_micro * scale) (the averaged, unscaled gradient's norm, rounded to
// float32); loss = loss sum / (n_micro * n_pos). Non-finite loss or norm: skip (fp16 halves the
// scale; an fp16 overflow with a finite loss does not count towards the bad streak); otherwise the
// clip factor and the AdamW scalars of update number step - skipped, and the scale may grow.
extern "C" __global__ void k_step_check(double* state, float* dloss, const float* partials, int P,
                                        int n_micro, double n_pos, double beta1, double beta2,
                                        double weight_decay, double max_norm, int fp16,
                                        double growth_interval, double max_scale) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double ss = 0.0;
  for (int i = 0; i < P; ++i) ss = __dadd_rn(ss, (double)partials[i]);
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
    double t = __dsub_rn(state[S_STEP], state[S_SKIPPED]);
    double mhat = __ddiv_rn(1.0, __dsub_rn(1.0, pow(beta1, t)));
    double vhat = __ddiv_rn(1.0, __dsub_rn(1.0, pow(beta2, t)));
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
