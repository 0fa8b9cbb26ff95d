"""The launcher of optim_v1.cu's k_step_check: one warp (thread 0 does the work)."""
import numpy as np

from andrea.backends.cuda.ops import i32


def k_step_check(be, state, dloss, partials, n_micro, n_pos, beta1, beta2, weight_decay, max_norm, fp16,
                 growth_interval, max_scale):
    f64 = np.float64
    be.rt.launch("optim.cu", "k_step_check", np.float32, 1, 32,
                 (state, dloss, partials, i32(partials.size), i32(n_micro), f64(n_pos), f64(beta1), f64(beta2),
                  f64(weight_decay), f64(max_norm), i32(int(bool(fp16))), f64(growth_interval), f64(max_scale)))
