// The gather grouped GEMM (gather_gemm.cuh): cooperative, 128x256x64 tile, cp.async for the gathered A rows, one TMA
// copy per stage for the weight tile.
#include "gather_gemm.cuh"
JAX_DWDP_GATHER_DEFINE_CONFIG(kGatherTmaB128x256x64, "gather_tmab_128x256x64", 128, 256, 64, true)
