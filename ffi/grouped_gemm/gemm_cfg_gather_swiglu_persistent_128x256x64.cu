// The persistent form of the gather + SwiGLU grouped GEMM (gather_gemm.cuh): one CTA per SM taking work units from
// a global counter, the next unit's loads under this unit's epilogue, the activation stored by bulk async copies.
#include "gather_gemm.cuh"
JAX_DWDP_GATHER_DEFINE_CONFIG(kGatherSwigluPersistent128x256x64, "gather_swiglu_persistent_128x256x64", 128, 256, 64,
                              true, true, true)
