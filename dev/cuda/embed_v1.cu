// embed_v1.cu: the embedding backward as it was before its keys were sorted by rank: every B*T
// sorted by the one-block bitonic sort (k_embed_sort, still in andrea/kernels/embed.cu for sizes
// where the rank count costs more). The kernels are the package's; embed_v1.py launches the
// bitonic sort at every size.
#include "embed.cu"
