// layernorm_v2.cu: version 3 of the layer-norm backward (k_layernorm_bwd_fused, then two
// k_colsum_final: the package's default), through the package's own kernels and launcher with
// CudaOps.ln_bwd_version = 3 (layernorm_v2.py), to time beside the other versions in one run.
#include "layernorm.cu"
