// linear.cu: the linear layers of attention, k_attn_qkv_fwd/_bwd (W_QKV) and k_attn_out_fwd/_bwd
// (W_O). Each is cuBLAS for the products (out = inp @ w^T; dinp += dout @ w; dw += dout^T @ inp,
// float32 accumulation, see andrea/backends/cuda.py) plus the bias kernels of common.cuh:
// k_bias_add after the forward product, k_colsum_partial/_final for the bias gradient.
// This file holds nothing else so that each operation of DESIGN.md has a file to point to.
#include "common.cuh"
