// Cooperative, 128x256x64 tile, 1x2 cluster: the two CTAs of an M tile's neighbouring N tiles (one group) share
// the A tile by TMA multicast (issue 15: the down projection's A is re-read by each of its N / 256 tiles).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kCoop128x256x64C1x2, "coop_128x256x64_c1x2", false, 128, 256, 64, 1, false, 2)
