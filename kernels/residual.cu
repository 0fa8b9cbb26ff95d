// residual.cu: the residual connection. Forward writes out = a + b; backward adds dout into both
// input gradients. No __restrict__: the engine may pass aliased buffers, and each element is then
// read after the write before it, as NumPy's two `+=` do.
#include "common.cuh"

extern "C" __global__ void k_residual_add(CT* out, const CT* a, const CT* b, i64 n) {
  pdl_wait();
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    out[i] = from_f<CT>(to_f(a[i]) + to_f(b[i]));
}

extern "C" __global__ void k_residual_add_bwd(CT* da, CT* db, const CT* dout, i64 n) {
  pdl_wait();
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    da[i] = from_f<CT>(to_f(da[i]) + to_f(dout[i]));
    db[i] = from_f<CT>(to_f(db[i]) + to_f(dout[i]));
  }
}
