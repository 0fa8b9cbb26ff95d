"""loss_v1.cu's launch: the classifier's row pass as one block of 512 threads per row (the
kernels k_loss_fwd / k_loss_bwd of that file), the version before the row was held in
registers. The chunking and the three matrix products are the package's."""
import numpy as np

from andrea.backends.cuda.ops import _loss_checks
from andrea.backends.cuda.runtime import check, cp, i32, i64


def k_loss_fwd(be, losses, lse, logits, inp, wte, targets):
    x, tg, lf, lsef, z_all, N, V, C, ct = _loss_checks("k_loss_fwd", losses, lse, logits, inp, wte, targets)
    R = z_all.shape[0]
    for r0 in range(0, N, R):
        n = min(R, N - r0)
        z = z_all[:n]
        be.blas.gemm(z, x[r0:r0 + n], wte, False, True, n, V, C, C, C, V)
        be.rt.launch("loss.cu", "k_loss_fwd", ct, n, 512,
                     (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V)))


def k_loss_bwd(be, losses, lse, dinp, dwte, logits, inp, wte, targets, dloss, accumulate=True):
    x, tg, lf, lsef, z_all, N, V, C, ct = _loss_checks("k_loss_bwd", losses, lse, logits, inp, wte, targets)
    check("k_loss_bwd", "dinp", dinp, inp.shape, ct)
    check("k_loss_bwd", "dwte", dwte, (V, C), np.float32)
    if isinstance(dloss, cp.ndarray):
        check("k_loss_bwd", "dloss", dloss, (1,), np.float32)
        dl = (dloss, np.float32(0))
    else:
        dl = (np.uint64(0), np.float32(dloss))
    dx, R = dinp.reshape(N, C), z_all.shape[0]
    beta = 1.0 if accumulate else 0.0
    for r0 in range(0, N, R):
        n = min(R, N - r0)
        z = z_all[:n]
        be.blas.gemm(z, x[r0:r0 + n], wte, False, True, n, V, C, C, C, V)
        be.rt.launch("loss.cu", "k_loss_bwd", ct, n, 512,
                     (lf[r0:r0 + n], lsef[r0:r0 + n], z, tg[r0:r0 + n], i64(n), i32(V)) + dl)
        be.blas.gemm(dx[r0:r0 + n], z, wte, False, False, n, C, V, V, C, C, beta=beta)
        be.blas.gemm(dwte, z, x[r0:r0 + n], True, False, V, C, n, V, C, C, beta=1.0)
