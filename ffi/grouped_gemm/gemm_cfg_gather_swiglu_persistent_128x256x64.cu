// The gather grouped GEMM with SiLU(gate) * up in its epilogue, persistent (gather_gemm.cuh): one CTA per SM over
// the (M tile, N tile) list, the next tile's loads overlapping this tile's epilogue; cooperative 128x256x64 tile.
#include "gather_gemm.cuh"
JAX_DWDP_GATHER_DEFINE_CONFIG(kGatherSwigluPersistent128x256x64, "gather_swiglu_persistent_128x256x64", 128, 256, 64,
                              true, true, true)
