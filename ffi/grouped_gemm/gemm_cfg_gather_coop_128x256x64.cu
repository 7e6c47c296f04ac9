// The gather grouped GEMM (gather_gemm.cuh): cooperative, 128x256x64 tile, cp.async loads of the gathered A rows.
#include "gather_gemm.cuh"
JAX_DWDP_GATHER_DEFINE_CONFIG(kGatherCoop128x256x64, "gather_coop_128x256x64", 128, 256, 64)
