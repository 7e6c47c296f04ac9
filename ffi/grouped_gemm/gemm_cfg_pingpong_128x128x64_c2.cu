// Ping-pong, 128x128x64 tile, 2x1 cluster: overlaps one tile's epilogue with the next tile's mainloop (short K).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kPingpong128x128x64C2, "pingpong_128x128x64_c2x1", true, 128, 128, 64, 2)
