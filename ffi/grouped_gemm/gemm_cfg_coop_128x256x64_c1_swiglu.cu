// Cooperative, 128x256x64 tile, no cluster, fused SwiGLU epilogue (automatic from 64 rows per group).
#include "gemm_kernel.cuh"
JAX_DWDP_GMM_DEFINE_CONFIG(kCoop128x256x64C1Swiglu, "coop_128x256x64_c1x1", false, 128, 256, 64, 1, true)
