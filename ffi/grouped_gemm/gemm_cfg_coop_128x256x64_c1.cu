// Cooperative, 128x256x64 tile, no cluster (each CTA loads its own B tiles: no TMA multicast).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kCoop128x256x64C1, "coop_128x256x64_c1x1", false, 128, 256, 64, 1)
