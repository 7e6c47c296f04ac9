// The gather grouped GEMM with SiLU(gate) * up in its epilogue (gather_gemm.cuh): cooperative, 128x256x64 tile (128
// features: their gate and up rows as two TMA boxes), cp.async for the gathered A rows.
#include "gather_gemm.cuh"
JAX_DWDP_GATHER_DEFINE_CONFIG(kGatherSwiglu128x256x64, "gather_swiglu_128x256x64", 128, 256, 64, true, true)
