// Cooperative, 128x256x64 tile, no cluster, A rows gathered in the loads (automatic from 64 rows per group).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kCoop128x256x64C1Gather, "coop_128x256x64_c1x1", false, 128, 256, 64, 1, false, true)
