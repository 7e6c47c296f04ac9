// Shared declarations of the grouped GEMM FFI library (jax_dwdp_gmm): the per-group argument arrays the
// device-side setup kernel fills, and one runner per compiled CUTLASS configuration.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jax_dwdp_gmm {

// Per-call device arrays (inside the workspace the caller hands in). All pointers are device pointers.
struct GroupedArgs {
  int groups = 0;
  int n = 0;
  int k = 0;
  void* problem_shapes = nullptr;  // cute::Shape<int, int, int>[groups]: (rows_g, N, K)
  const void** ptr_a = nullptr;    // x + start_g * K
  const void** ptr_b = nullptr;    // w + g * N * K
  void** ptr_d = nullptr;          // out + start_g * N_out (N_out = N, or N / 2 for the fused SwiGLU)
  void* stride_a = nullptr;        // cute::Stride<int64_t, _1, _0>[groups]: (K, 1, 0)
  void* stride_b = nullptr;        // (K, 1, 0)
  void* stride_d = nullptr;        // (N_out, 1, 0)
  void* cutlass_workspace = nullptr;
  size_t cutlass_workspace_bytes = 0;
  int device = 0;
  int sm_count = 0;
  cudaStream_t stream = nullptr;
};

// One compiled CUTLASS kernel. `run` returns nullptr on success, else a static message naming the failed step.
struct GemmConfig {
  const char* name;
  size_t (*workspace_bytes)(int groups, int sm_count);
  const char* (*run)(const GroupedArgs& args);
};

// Defined in the gemm_cfg_*.cu files (one template instantiation each, compiled in parallel).
extern const GemmConfig kCoop128x256x64C2;
extern const GemmConfig kPingpong64x128x128C2;
extern const GemmConfig kPingpong128x128x64C2;
extern const GemmConfig kCoop128x256x64C1;
extern const GemmConfig kPingpong64x128x128C1;
// The same tiles with the fused SwiGLU epilogue (out has N / 2 columns; swiglu_epilogue.cuh).
extern const GemmConfig kCoop128x256x64C1Swiglu;
extern const GemmConfig kPingpong64x128x128C1Swiglu;

// The gather grouped GEMM (gather_gemm.cuh): out[r] = x[row_token[r]] @ w[g(r)]^T for the rows r of each group.
struct GatherArgs {
  const void* x = nullptr;            // [tokens, K] bf16, the tokens in their own order
  const int32_t* row_token = nullptr; // [M]: the token each sorted row reads (outside [0, tokens): zeros)
  const void* w = nullptr;            // [G, N, K] bf16
  void* out = nullptr;                // [M, N] bf16, rows in group order
  long long m = 0;
  int tokens = 0;
  int n = 0;
  int k = 0;
  int groups = 0;
  const int32_t* tile_start = nullptr;  // [G + 1]: the first M tile of each group (device; the setup kernel's)
  const int32_t* row_start = nullptr;   // [G]: the first row of each group
  const int32_t* rows = nullptr;        // [G]: the rows of each group (clipped to M)
  int half_tiles = 1;                   // a warpgroup with none of the tile's rows skips its wgmma (gather_gemm.cuh)
  cudaStream_t stream = nullptr;
};

struct GatherConfig {
  const char* name;
  int tile_rows;  // rows per M tile
  const char* (*run)(const GatherArgs& args);
};

extern const GatherConfig kGatherCoop128x256x64;
extern const GatherConfig kGatherTmaB128x256x64;
extern const GatherConfig kGatherSwiglu128x256x64;  // SiLU(gate) * up fused (out [M, N / 2])

}  // namespace jax_dwdp_gmm
