// One CUTLASS 3.x sm90 grouped GEMM (ptr-array, TMA, warp-specialized) for the MoE expert matmul:
//   D_g[M_g, N] = A_g[M_g, K] @ B_g[N, K]^T, bf16 in/out, fp32 accumulation,
// or, with kSwiglu, the fused gate_up projection D_g[M_g, N / 2] = silu(gate) * up (swiglu_epilogue.cuh),
// with per-group shapes and pointers read on the device (host problem shapes = nullptr: no host sync).
// Included by one gemm_cfg_*.cu per configuration, so that each heavy instantiation compiles in parallel.
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "grouped_gemm.h"
#include "swiglu_epilogue.cuh"

namespace jax_dwdp_gmm {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using StrideRowMajor = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;

template <bool kPingpong, int kTileM, int kTileN, int kTileK, int kClusterM, bool kSwiglu = false>
struct GroupedGemm {
  using Element = cutlass::bfloat16_t;
  using Accum = float;
  using LayoutA = cutlass::layout::RowMajor;     // x rows, K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // w[g] is [N, K] with K contiguous: a column-major K x N
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(Element);  // 16-byte TMA alignment: K % 8 == 0, N % 8 == 0

  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;
  using KernelSchedule = std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

  // No source operand (C = void): D = accumulator, converted to bf16. (Declaring a bf16 C aliasing D with beta = 0,
  // as PyTorch does, measured the same on an H200, 2026-11-30: benchmarks/history/RESULTS-2026-11-to-12.md.)
  using TmaEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Accum, Accum,
      void, LayoutD*, kAlign,
      Element, LayoutD*, kAlign,
      EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, Accum, void, Accum>>::CollectiveOp;
  // The fused SwiGLU epilogue writes from registers (no shared memory, so the mainloop gets more stages).
  using SwigluEpilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SwigluEpilogueArray<StrideRowMajor*>>;
  using CollectiveEpilogue = std::conditional_t<kSwiglu, SwigluEpilogue, TmaEpilogue>;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA*, kAlign,
      Element, LayoutB*, kAlign,
      Accum, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // The setup kernel writes these types without seeing the kernel: make sure they are the ones it writes.
  static_assert(std::is_same_v<typename Kernel::InternalStrideA, StrideRowMajor>, "unexpected A stride type");
  static_assert(std::is_same_v<typename Kernel::InternalStrideB, StrideRowMajor>, "unexpected B stride type");
  static_assert(std::is_same_v<typename Kernel::InternalStrideD, StrideRowMajor>, "unexpected D stride type");
  static_assert(sizeof(StrideRowMajor) == 8, "stride arrays are laid out as 8 bytes per group");
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) == 12, "problem shapes are 3 x int32");

  static typename Gemm::Arguments arguments(const GroupedArgs& a) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = a.device;
    hw.sm_count = a.sm_count;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {a.groups, static_cast<typename ProblemShape::UnderlyingProblemShape*>(a.problem_shapes), nullptr},
        {reinterpret_cast<const Element**>(a.ptr_a), static_cast<StrideRowMajor*>(a.stride_a),
         reinterpret_cast<const Element**>(a.ptr_b), static_cast<StrideRowMajor*>(a.stride_b)},
        {{}, nullptr, nullptr, reinterpret_cast<Element**>(a.ptr_d), static_cast<StrideRowMajor*>(a.stride_d)},
        hw};
    if constexpr (!kSwiglu) {
      auto& fusion = args.epilogue.thread;
      fusion.alpha = 1.0f;
      fusion.beta = 0.0f;
      fusion.alpha_ptr = nullptr;
      fusion.beta_ptr = nullptr;
      fusion.alpha_ptr_array = nullptr;
      fusion.beta_ptr_array = nullptr;
      fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
      fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
    }
    return args;
  }

  static size_t workspace_bytes(int groups, int sm_count) {
    GroupedArgs a;
    a.groups = groups;
    a.sm_count = sm_count;
    return Gemm::get_workspace_size(arguments(a));
  }

  static const char* run(const GroupedArgs& a) {
    typename Gemm::Arguments args = arguments(a);
    if (Gemm::get_workspace_size(args) > a.cutlass_workspace_bytes) return "CUTLASS workspace too small";
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS can_implement failed";
    if (gemm.initialize(args, a.cutlass_workspace, a.stream) != cutlass::Status::kSuccess)
      return "CUTLASS initialize failed";
    if (gemm.run(a.stream) != cutlass::Status::kSuccess) return "CUTLASS run (kernel launch) failed";
    return nullptr;
  }
};

}  // namespace jax_dwdp_gmm

#define JAX_DWDP_GMM_DEFINE_CONFIG(var, name, ...)                                      \
  namespace jax_dwdp_gmm {                                                              \
  using var##Impl = GroupedGemm<__VA_ARGS__>;                                           \
  const GemmConfig var = {name, &var##Impl::workspace_bytes, &var##Impl::run};          \
  }
