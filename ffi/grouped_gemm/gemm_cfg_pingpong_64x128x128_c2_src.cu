// As pingpong_64x128x128_c2x1, with PyTorch's epilogue: a bf16 source operand C declared (aliasing D, beta = 0).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kPingpong64x128x128C2Src, "pingpong_64x128x128_c2x1_src", true, 64, 128, 128, 2, 1, true)
