// Cooperative, 128x256x64 tile, 2x1 cluster: PyTorch's choice for large grouped bf16 GEMMs on sm90.
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kCoop128x256x64C2, "coop_128x256x64_c2x1", false, 128, 256, 64, 2)
