// Ping-pong, 64x128x128 tile, no cluster, A rows gathered in the loads (small groups).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kPingpong64x128x128C1Gather, "pingpong_64x128x128_c1x1", true, 64, 128, 128, 1, false, true)
