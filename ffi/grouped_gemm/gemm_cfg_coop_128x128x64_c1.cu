// Cooperative, 128x128x64 tile, no cluster: half the 128x256 tile's N, twice the tiles per group.
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kCoop128x128x64C1, "coop_128x128x64_c1x1", false, 128, 128, 64, 1)
