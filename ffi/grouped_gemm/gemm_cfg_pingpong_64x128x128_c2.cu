// Ping-pong, 64x128x128 tile, 2x1 cluster: PyTorch's choice when groups are small (few rows per expert).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kPingpong64x128x128C2, "pingpong_64x128x128_c2x1", true, 64, 128, 128, 2)
