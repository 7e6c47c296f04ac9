// Token permutation fused into the grouped GEMM's A loads: the CTA tile's A rows are gathered from the unsorted
// token matrix x [T, K] by a row index (sorted row -> token), instead of reading a materialised x[index] [M, K].
//
// Hopper's TMA cannot gather, so the producer warp issues one 2-D TMA copy per row and 64-column chunk (box
// {64, 1}) from a tensor map over x, into the row's place in the stage's A tile. The 128-byte swizzle is applied by
// TMA from the shared-memory address, so single rows written at their unswizzled row offset land exactly where a
// whole-tile load would have put them, and the wgmma consumers run unchanged. Each of the 32 lanes copies
// BLK_M / 32 rows; the elected lane acquires the stage (arming the barrier with the whole tile's bytes, as the
// stock load does) and loads B with the stock per-group TMA. Rows past the group's end load the group's first row:
// the bytes still arrive, and the epilogue never stores those rows.
//
// Built on CUTLASS's sm90 ptr-array TMA mainloop (cutlass/gemm/collective/sm90_mma_array_tma_gmma_ss_warpspecialized
// .hpp): this derives from it and replaces `load`, `load_init`, `tensors_perform_update` and the params. The kernel
// keeps per-group A tensor maps it no longer reads (their pointers are set to x). Needs cluster 1x1, a K-major
// 128-byte-swizzled A tile with BLK_K % 64 == 0 (static_asserts), and bf16 A.
#pragma once

#include <cuda.h>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"

namespace jax_dwdp_gmm {

constexpr int kGatherChunk = 64;  // bf16 columns per row copy: 128 bytes, one 128-byte swizzle row

template <class Base>
struct GatherAMainloop : Base {
  using typename Base::TensorStorage;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::TileShape;
  using typename Base::DispatchPolicy;
  static constexpr int kBlkM = cute::size<0>(TileShape{});
  static constexpr int kBlkK = cute::size<2>(TileShape{});
  static_assert(cute::size(typename DispatchPolicy::ClusterShape{}) == 1, "the row gather takes no cluster");
  static_assert(kBlkM % 32 == 0 && kBlkK % kGatherChunk == 0, "tile M must split over a warp, tile K into 64s");
  static_assert(sizeof(typename Base::ElementA) == 2, "bf16 rows of 64 columns are one 128-byte swizzle row");

  // Pre-swizzle element offset of (row, 64-column chunk, stage) in the A stages: K-major 8 x 64 swizzle atoms, tiled
  // M first, then K, then stages. The stock layout must be exactly that, or the row copies would land wrong.
  CUTE_HOST_DEVICE static constexpr int a_offset(int row, int chunk, int stage) {
    return stage * kBlkM * kBlkK + chunk * kBlkM * kGatherChunk + row * kGatherChunk;
  }
  static_assert(cute::get_nonswizzle_portion(SmemLayoutA{})(1, 0, 0) == a_offset(1, 0, 0) &&
                    cute::get_nonswizzle_portion(SmemLayoutA{})(9, 5, 0) == a_offset(9, 0, 0) + 5 &&
                    cute::get_nonswizzle_portion(SmemLayoutA{})(0, 0, 1) == a_offset(0, 0, 1) &&
                    (kBlkK == kGatherChunk ||
                     cute::get_nonswizzle_portion(SmemLayoutA{})(3, kGatherChunk, 0) == a_offset(3, 1, 0)),
                "the A stage layout is not the K-major 8 x 64 atom tiling the row gather assumes");

  struct Arguments : Base::Arguments {
    const void* gather_x = nullptr;            // x [gather_rows, gather_k] bf16, the unsorted token rows
    long long gather_rows = 0;                 // T
    int gather_k = 0;                          // K
    const int32_t* gather_index = nullptr;     // [M]: token row of each sorted row
    const long long* group_row_start = nullptr;  // [G]: first sorted row of each group (device)
  };

  struct Params : Base::Params {
    cute::TmaDescriptor gather_tmap{};  // over x: dims {K, T}, box {64, 1}, 128-byte swizzle
    const int32_t* gather_index = nullptr;
    const long long* group_row_start = nullptr;
  };

  // The tensor map over x, encoded on the host for each call (x moves between calls).
  static cute::TmaDescriptor encode_gather_map(const void* x, long long rows, int k) {
    cute::TmaDescriptor map{};
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k) * 2};  // bytes between rows
    const cuuint32_t box[2] = {kGatherChunk, 1};
    const cuuint32_t element_strides[2] = {1, 1};
    CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(x), dims, strides, box, element_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? map : cute::TmaDescriptor{};  // all zero: `gather_map_ok` says no
  }

  static bool gather_map_ok(const cute::TmaDescriptor& map) {
    const char* p = reinterpret_cast<const char*>(&map);
    for (size_t i = 0; i < sizeof(map); ++i)
      if (p[i]) return true;
    return false;
  }

  // The stock checks, and that x's tensor map can be encoded (16-byte aligned x and rows, K and T in range).
  template <class ProblemShape>
  static bool can_implement(ProblemShape problem_shapes, Arguments const& args) {
    return Base::can_implement(problem_shapes, args) && args.gather_x && args.gather_index &&
           args.group_row_start && args.gather_rows > 0 && args.gather_k > 0 &&
           gather_map_ok(encode_gather_map(args.gather_x, args.gather_rows, args.gather_k));
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shapes, args, workspace);
    p.gather_tmap = encode_gather_map(args.gather_x, args.gather_rows, args.gather_k);
    p.gather_index = args.gather_index;
    p.group_row_start = args.group_row_start;
    return p;
  }

  // (gA, gB, (group, rows of the group)): the kernel hands the third element back to `load` for every tile.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    auto ab = Base::load_init(problem_shape_MNKL, params);
    return cute::make_tuple(cute::get<0>(ab), cute::get<1>(ab), cute::make_tuple(int32_t(0), int32_t(0)));
  }

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& in, Params const&,
                                                     ProblemShape_MNKL problem_shape_mnkl, int32_t next_batch) {
    return cute::make_tuple(cute::get<0>(in), cute::get<1>(in),
                            cute::make_tuple(next_batch, static_cast<int32_t>(cute::get<0>(problem_shape_mnkl))));
  }

  template <class TensorA, class TensorB, class GroupInfo, class TensorMapA, class TensorMapB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, GroupInfo> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t /*block_rank_in_cluster*/, TensorStorage& shared_tensors) {
    using namespace cute;
    constexpr int kRowsPerLane = kBlkM / 32;
    const int lane = thread_idx % 32;
    const int group = get<0>(get<2>(load_inputs));
    const int group_rows = get<1>(get<2>(load_inputs));
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;

    // This lane's rows of the tile and the token row each one reads.
    const long long first = params.group_row_start[group];
    int32_t token[kRowsPerLane];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = static_cast<int>(m_coord) * kBlkM + lane + 32 * i;
      token[i] = params.gather_index[first + (r < group_rows ? r : 0)];
    }

    const bool leader = cute::elect_one_sync();
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    Tensor gB = get<1>(load_inputs)(_, _, n_coord, _, l_coord);
    auto block_tma_b = params.tma_load_b.get_slice(0);
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);
    auto* smem_a = shared_tensors.smem_A.data();

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      if (leader) pipeline.producer_acquire(smem_pipe_write);  // waits for the stage, arms the barrier (A + B bytes)
      __syncwarp();                                           // no lane writes the stage before it is free
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int k0 = *k_tile_iter * kBlkK;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRowsPerLane; ++i) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kBlkK / kGatherChunk; ++c) {
          SM90_TMA_LOAD_2D::copy(&params.gather_tmap, reinterpret_cast<uint64_t*>(barrier),
                                 static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL),
                                 smem_a + a_offset(lane + 32 * i, c, stage), k0 + c * kGatherChunk, token[i]);
        }
      }
      if (leader)
        copy(params.tma_load_b.with(get<1>(input_tensormaps), *barrier, uint16_t(0)), tBgB(_, _, _, *k_tile_iter),
             tBsB(_, _, _, stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

}  // namespace jax_dwdp_gmm
