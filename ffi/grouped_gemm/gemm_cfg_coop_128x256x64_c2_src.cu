// As coop_128x256x64_c2x1, with PyTorch's epilogue: a bf16 source operand C declared (aliasing D, beta = 0).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kCoop128x256x64C2Src, "coop_128x256x64_c2x1_src", false, 128, 256, 64, 2, 1, true)
