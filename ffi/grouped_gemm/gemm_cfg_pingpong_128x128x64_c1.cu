// Ping-pong, 128x128x64 tile, no cluster: each consumer warpgroup owns a whole tile, so one tile's epilogue runs
// while the other warpgroup's mainloop does (short K: the down projection, K = I).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kPingpong128x128x64C1, "pingpong_128x128x64_c1x1", true, 128, 128, 64, 1)
