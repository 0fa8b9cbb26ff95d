// layernorm_v3.cu: version 4 of the layer-norm backward (k_layernorm_bwd_tree: rows filling the
// lanes' slots, a grid sized to the SMs, its own reduction tree), through the package's own
// kernels and launcher with CudaOps.ln_bwd_version = 4 (layernorm_v3.py), to time beside
// version 3 (main, layernorm_v2) and layernorm_v4 in one run.
#include "layernorm.cu"
