// Fused SwiGLU epilogue for the MoE gate_up projection: D[m, j] = silu(gate[m, j]) * up[m, j], from fp32 accumulators.
//
// The weight's rows are interleaved in blocks of 8 (`jax_dwdp.kernels.interleave_gate_up`): GEMM column 16b + r is
// gate row 8b + r and column 16b + 8 + r is up row 8b + r (r < 8). An SM90 wgmma accumulator fragment gives each
// thread, per 8-column chunk c of its atom, the column pair (8c + 2q, 8c + 2q + 1) of two rows (q = lane % 4). Chunk
// 2c is then a gate block and chunk 2c + 1 the matching up block, both in the same thread's registers: no shuffle
// and no shared memory. Each thread writes its two adjacent outputs as one bf16x2 store, straight from registers
// (like CUTLASS's DefaultEpilogueArray, whose interface this keeps so that Sm90TmaWarpSpecializedAdapter wraps it).
// D has N / 2 columns: row stride and pointer come from the per-group arrays the setup kernel fills.
//
// Measured on an H200 (2026-11-30; benchmarks/RESULTS.md, "Variants measured slower"): 0.92-1.08x of the unfused
// CUTLASS GEMM + XLA activation on the MoE gate_up shapes, 0.95-1.04x on the whole routed-expert block, i.e. no gain; a variant
// that transposed 32-bit words within each quad for 16-byte stores measured slower (0.75-1.00x). So the model keeps
// the checkpoint layout and the unfused path by default; this kernel is opt-in (`set_fused_swiglu`).
#pragma once

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/default_epilogue_array.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

namespace jax_dwdp_gmm {

constexpr int kSwigluBlock = 8;  // rows per gate / up block in the interleaved weight (one wgmma column chunk)

// The stock no-smem ptr-array epilogue whose interface (arguments, params, workspace, can_implement) this reuses.
template <class StrideD>
using SwigluEpilogueBase = cutlass::epilogue::collective::DefaultEpilogueArray<
    void, StrideD, StrideD,
    cutlass::epilogue::thread::LinearCombination<cutlass::bfloat16_t, 1, float, float,
                                                 cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling,
                                                 cutlass::FloatRoundStyle::round_to_nearest, cutlass::bfloat16_t>,
    cutlass::epilogue::PtrArrayNoSmemWarpSpecialized>;

// Wrapped by cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter (a CUTLASS detail type: the
// build pins nvidia-cutlass==4.2.0.0 in ffi/build_backend.py; recheck on an upgrade).
template <class StrideD>  // a pointer type: one stride per group
class SwigluEpilogueArray : public SwigluEpilogueBase<StrideD> {
  using Base = SwigluEpilogueBase<StrideD>;

 public:
  using typename Base::InternalStrideD;
  using typename Base::Params;

  CUTLASS_HOST_DEVICE SwigluEpilogueArray(Params const& params) : Base(params), params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    static_assert(is_static<BlockShapeMNK>::value, "tile shape must be static");
    // The SM90 wgmma fp32 accumulator fragment: ((2 columns, 2 row halves, N_atom / 8 chunks), MMA_M, MMA_N), where
    // the third value mode steps 8 columns. Gate chunk 2c pairs with up chunk 2c + 1.
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "unexpected accumulator fragment rank");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "unexpected wgmma accumulator");
    static_assert(size<0, 2>(FrgLayout{}) % 2 == 0, "the atom's N must hold whole gate/up block pairs (N % 16)");
    static_assert(size<1>(BlockShapeMNK{}) % (2 * kSwigluBlock) == 0, "tile N must hold whole gate/up block pairs");

    const int M = static_cast<int>(get<0>(problem_shape_mnkl));
    const int N = static_cast<int>(get<1>(problem_shape_mnkl));  // GEMM columns = 2 x output columns
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    const InternalStrideD stride_d = params_.dD[l_coord];
    const int64_t ld = get<0>(stride_d);
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(params_.ptr_D[l_coord]);

    // Tile-relative (m, n) of every accumulator element (same partitioning as the accumulators).
    Tensor tCcD = tiled_mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(take<0, 2>(blk_shape_MNK)));
    const int m0 = static_cast<int>(m_coord) * size<0>(BlockShapeMNK{});
    const int n0 = static_cast<int>(n_coord) * size<1>(BlockShapeMNK{});

    CUTLASS_PRAGMA_UNROLL
    for (int mn = 0; mn < size<2>(FrgLayout{}); ++mn) {
      CUTLASS_PRAGMA_UNROLL
      for (int mm = 0; mm < size<1>(FrgLayout{}); ++mm) {
        CUTLASS_PRAGMA_UNROLL
        for (int half = 0; half < 2; ++half) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<0, 2>(FrgLayout{}) / 2; ++c) {
            auto crd = tCcD(make_coord(0, half, 2 * c), mm, mn);
            const int m = m0 + get<0>(crd);
            const int n = n0 + get<1>(crd);  // a gate column: n % 16 < 8, and n % 2 == 0
            // N % 16 == 0 (checked by the handler), so n < N also puts n + 1 and the up columns n + 8, n + 9 inside.
            if (m < M && n < N) {
              const float g0 = accumulators(make_coord(0, half, 2 * c), mm, mn);
              const float g1 = accumulators(make_coord(1, half, 2 * c), mm, mn);
              const float u0 = accumulators(make_coord(0, half, 2 * c + 1), mm, mn);
              const float u1 = accumulators(make_coord(1, half, 2 * c + 1), mm, mn);
              const int j = (n / (2 * kSwigluBlock)) * kSwigluBlock + n % (2 * kSwigluBlock);
              // silu from ex2.approx and rcp.approx (__expf, __fdividef: a few fp32 ulps, below the bf16 output's
              // rounding step), as gather_gemm.cuh's epilogue. For g below about -87.3, 1 + exp(-g) exceeds 2^126,
              // where __fdividef returns 0, and below about -88.7 exp overflows to inf (g / inf = -0): silu(g) there
              // is under 1e-36 in size, so 0 is within the bf16 output's rounding
              const float a0 = __fdividef(g0, 1.0f + __expf(-g0)) * u0;
              const float a1 = __fdividef(g1, 1.0f + __expf(-g1)) * u1;
              *reinterpret_cast<__nv_bfloat162*>(out + m * ld + j) = __floats2bfloat162_rn(a0, a1);
            }
          }
        }
      }
    }
  }

 private:
  Params params_;  // the base keeps its own copy private
};

}  // namespace jax_dwdp_gmm
