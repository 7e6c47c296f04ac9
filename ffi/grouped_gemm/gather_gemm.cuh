// The gate_up grouped GEMM with the token gather in its A loads (issue 15):
//
//   out[r, :] = x[row_token[r], :] @ w[g(r)]^T     for the rows r of each group g, in group (expert) order,
//
// x [T, K] the tokens in their own order (not permuted), row_token [M] the token each sorted row reads, w [G, N, K],
// out [M, N]; bf16 in and out, fp32 accumulation. It replaces "dispatch the (token, slot) rows into expert order,
// then grouped GEMM": the [M, K] permuted copy of the tokens is never written or read back.
//
// Why not TMA: a Hopper TMA copy moves a box of a strided tensor, so gathered rows would need one copy per row;
// one producer warp issuing 128 of them per stage ran 4.2x slower (ffi/grouped_gemm/README.md). Here a whole
// producer warpgroup issues 16-byte cp.async copies, each thread holding the source addresses of its rows, into
// the same swizzled shared-memory stages CUTLASS's cp.async warp-specialized mainloop uses; the two consumer
// warpgroups run that mainloop's wgmma loop (CollectiveMma::mma) unchanged.
//
// Work: one CTA per (N tile, M tile of a group). A one-block setup kernel (grouped_gemm.cu) writes each group's
// first row, row count and first tile; a CTA finds its group by binary search over the tile starts, and CTAs past
// the last tile exit at once (the grid is sized for the worst case, ceil(M / tile) + G tiles).
// Epilogue: the accumulators go through shared memory (the mainloop's stages, free once both consumer warpgroups
// are done) as bf16 and leave as 16-byte row-contiguous stores, predicated on the group's last row.
//
// Half tiles: the two consumer warpgroups hold rows [0, 64) and [64, 128) of the tile (CUTLASS's cooperative
// layout); where a group's last M tile has at most 64 rows, the second warpgroup issues no wgmma: it waits for each
// stage and releases it (the stage is free once both have), so the tensor cores run half the tile. (With 128-row
// tiles a group wastes half a tile on average; a 35b-a3b layer at 16K tokens has ~512 rows per expert, so about
// half its experts end in a tile of a few rows.) $JAX_DWDP_GATHER_HALF_TILES=0, read at each call, turns it off
// (for the side-by-side measurement); the stored rows are the same bits either way.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/pipeline/pipeline.hpp"
#include "grouped_gemm.h"

namespace jax_dwdp_gmm {

// kTmaB: the weight tile (B, contiguous rows) by one TMA copy per stage instead of cp.async; the stage's full barrier
// then completes on the producer threads' 128 arrivals (thread 0's carrying the TMA's byte count) and the TMA bytes.
// kSwiglu (with kTmaB): the gate_up projection with SiLU(gate) * up in the epilogue, for w in the checkpoint's layout
// (per expert, I gate rows then I up rows, N = 2I): the B tile is two TMA boxes, kTileN / 2 gate rows and the same
// features' up rows, so a CTA's accumulator holds gate and up of kTileN / 2 features side by side; out is [M, I].
// The activation reads them rounded to bf16, as the unfused path (this GEMM's bf16 output, then XLA's SwiGLU) does.
template <int kTileM, int kTileN, int kTileK, bool kTmaB = false, bool kSwiglu = false>
struct GatherGemm {
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  // CUTLASS's cp.async warp-specialized cooperative mainloop: its TiledMma (two consumer warpgroups), its swizzled
  // stage layouts and its pipeline. Only its consumer half (mma / mma_tail) is called; the loads are ours.
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, 8,
      Element, cutlass::layout::ColumnMajor, 8,
      float, TileShape, cute::Shape<cute::_1, cute::_1, cute::_1>,
      cutlass::gemm::collective::StageCountAuto,
      cutlass::gemm::KernelCpAsyncWarpSpecializedCooperative>::CollectiveOp;
  using TiledMma = typename Mainloop::TiledMma;
  using SmemLayoutA = typename Mainloop::SmemLayoutA;  // (BLK_M, BLK_K, stage)
  using SmemLayoutB = typename Mainloop::SmemLayoutB;  // (BLK_N, BLK_K, stage)
  using Pipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;

  static constexpr int kTileRows = kTileM;  // rows per M tile (the setup kernel counts tiles of this size)
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kChunk = 8;                          // bf16 per 16-byte copy
  static constexpr int kChunksPerRow = kTileK / kChunk;     // 8: one 128-byte row slice per k tile
  static constexpr int kRowsPerPass = kProducerThreads / kChunksPerRow;  // 16
  static constexpr int kARows = kTileM / kRowsPerPass;      // rows of A each producer thread copies
  static constexpr int kBRows = kTileN / kRowsPerPass;
  static constexpr int kEpiStride = kTileN + 8;             // padded bf16 row of the staged output tile
  static_assert(kTileK == 64 && kTileM % kRowsPerPass == 0 && kTileN % kRowsPerPass == 0, "tile shape");
  static_assert(cute::size(TiledMma{}) == kConsumerThreads, "two consumer warpgroups");
  static_assert((kEpiStride * sizeof(Element)) % 16 == 0, "16-byte rows in the staged tile");

  struct SharedStorage {
    union Tensors {
      typename Mainloop::TensorStorage mainloop;
      cute::array_aligned<Element, kTileM * kEpiStride> epilogue;
    } tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };
  static_assert(sizeof(typename Mainloop::TensorStorage) >= sizeof(Element) * kTileM * kEpiStride,
                "the staged output tile must fit in the mainloop's stages");
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static constexpr bool kUseTmaB = kTmaB;
  static constexpr bool kFuseSwiglu = kSwiglu;
  static_assert(!kSwiglu || kTmaB, "the fused SwiGLU variant loads its two weight boxes by TMA");
  static constexpr int kBoxRows = kSwiglu ? kTileN / 2 : kTileN;  // weight rows per TMA box (two boxes with kSwiglu)
  static constexpr int kOutCols = kSwiglu ? kTileN / 2 : kTileN;  // output columns per CTA
  using SmemLayoutBox = decltype(cute::tile_to_shape(typename Mainloop::SmemLayoutAtomB{},
                                                     cute::make_shape(cute::Int<kBoxRows>{}, cute::Int<kTileK>{})));
  static constexpr uint32_t kTmaBytesB = kTileN * kTileK * sizeof(Element);

  // The weights as one [G * N, K] row-major matrix; a CTA's B tile starts at row g * N + n_blk * kTileN (a box past
  // its expert's last row reads the next expert's rows, or zeros past the end: those columns are never stored).
  static auto make_tma_b(const Element* w, int rows, int k) {
    using namespace cute;
    Tensor gB = make_tensor(make_gmem_ptr(w), make_layout(make_shape(rows, k), make_stride(static_cast<int64_t>(k), _1{})));
    return make_tma_copy(SM90_TMA_LOAD{}, gB, SmemLayoutBox{});
  }
  using TmaB = decltype(make_tma_b(nullptr, 1, 8));

  struct Params {
    GatherArgs a;
    TmaB tma_b;
  };
};

// One 16-byte cp.async into shared memory; zero-fills when !pred (src is then not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(smem);
  const int bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}

// The consumer half of one tile: CUTLASS's wgmma mainloop, or, for a warpgroup none of whose 64 rows is in the tile
// (`compute` false), the same pipeline steps without the wgmma (wait for each stage, release it; accum zeros).
template <class G, class Accum>
__device__ __forceinline__ void consume_tile(typename G::Pipeline& pipeline, typename G::PipelineState state,
                                             Accum& accum, int k_tiles, int mma_thread, bool compute,
                                             typename G::Mainloop::TensorStorage& stages) {
  typename G::Mainloop mainloop;
  if (compute) {
    mainloop.mma(pipeline, state, accum, k_tiles, mma_thread, stages, typename G::Mainloop::Params{});
    mainloop.mma_tail(pipeline, state, k_tiles);
  } else {
    for (int kt = 0; kt < k_tiles; ++kt) {
      pipeline.consumer_wait(state);
      pipeline.consumer_release(state);
      ++state;
    }
    cute::clear(accum);
  }
}

// Whether consumer thread `mma_thread`'s warpgroup holds any of the tile's `rows` (warpgroup w: rows 64 w ...).
template <class G>
__device__ __forceinline__ bool warpgroup_computes(const GatherArgs& p, int mma_thread, int rows) {
  constexpr int kTileM = cute::size<0>(typename G::TileShape{});
  static_assert(kTileM == 128, "two consumer warpgroups of 64 rows each");
  return !p.half_tiles || (mma_thread / 128) * (kTileM / 2) < rows;
}

template <class G>
__global__ void __launch_bounds__(G::kThreads, 1) gather_gemm_kernel(const __grid_constant__ typename G::Params params) {
  const GatherArgs& p = params.a;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename G::Element;
  constexpr int kTileM = size<0>(typename G::TileShape{});
  constexpr int kTileN = size<1>(typename G::TileShape{});
  constexpr int kTileK = size<2>(typename G::TileShape{});
  extern __shared__ __align__(128) char smem_raw[];
  auto& ss = *reinterpret_cast<typename G::SharedStorage*>(smem_raw);

  const int tile = blockIdx.y, n_blk = blockIdx.x;
  const int32_t* tile_start = p.tile_start;
  if (tile >= tile_start[p.groups]) return;  // the whole CTA: past the last tile
  int lo = 0, hi = p.groups;                 // tile_start[lo] <= tile < tile_start[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tile_start[mid] <= tile) lo = mid; else hi = mid;
  }
  const int g = lo;
  const int row0 = p.row_start[g] + (tile - tile_start[g]) * kTileM;
  const int rows = min(kTileM, p.row_start[g] + p.rows[g] - row0);
  const int k_tiles = (p.k + kTileK - 1) / kTileK;

  const int warp_group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  typename G::Pipeline::Params pp;
  pp.role = warp_group == 0 ? G::Pipeline::ThreadCategory::Producer : G::Pipeline::ThreadCategory::Consumer;
  pp.producer_arv_count = G::kProducerThreads;
  pp.consumer_arv_count = G::kConsumerThreads;
  typename G::Pipeline pipeline(ss.pipeline, pp);
  __syncthreads();

  if (warp_group == 0) {
    // Producer warpgroup: thread t copies 16-byte chunk t % 8 of rows t / 8 + 16 i of the A and B tiles.
    const int t = threadIdx.x;
    const int c = t % G::kChunksPerRow, r0 = t / G::kChunksPerRow;
    const Element* a_src[G::kARows];
    bool a_ok[G::kARows];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < G::kARows; ++i) {
      const int r = r0 + G::kRowsPerPass * i;
      const int32_t tok = r < rows ? p.row_token[row0 + r] : -1;
      const bool ok = tok >= 0 && tok < p.tokens;  // a row past the group, or a bad token index: zeros
      a_ok[i] = ok;
      a_src[i] = reinterpret_cast<const Element*>(p.x) + (ok ? static_cast<int64_t>(tok) * p.k : 0) + c * G::kChunk;
    }
    constexpr int kBRows = G::kUseTmaB ? 1 : G::kBRows;
    const Element* b_base = reinterpret_cast<const Element*>(p.w) + static_cast<int64_t>(g) * p.n * p.k;
    const Element* b_src[kBRows];
    bool b_ok[kBRows];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kBRows; ++j) {
      const int nr = n_blk * kTileN + r0 + G::kRowsPerPass * j;
      b_ok[j] = nr < p.n;
      b_src[j] = b_base + (b_ok[j] ? static_cast<int64_t>(nr) * p.k : 0) + c * G::kChunk;
    }
    Tensor sA = make_tensor(make_smem_ptr(ss.tensors.mainloop.smem_A.data()), typename G::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(ss.tensors.mainloop.smem_B.data()), typename G::SmemLayoutB{});
    // TMA views of this CTA's weight rows, (box rows, BLK_K, k) coordinates: one box of kTileN rows, or (kSwiglu)
    // the gate box and the up box of the same kTileN / 2 features.
    Tensor mB = params.tma_b.get_tma_tensor(make_shape(p.groups * p.n, p.k));
    const int box0 = g * p.n + n_blk * G::kBoxRows;
    Tensor gB0 = local_tile(domain_offset(make_coord(box0, 0), mB),
                            make_shape(Int<G::kBoxRows>{}, Int<kTileK>{}), make_coord(0, _));
    Tensor gB1 = local_tile(domain_offset(make_coord(box0 + (G::kFuseSwiglu ? p.n / 2 : 0), 0), mB),
                            make_shape(Int<G::kBoxRows>{}, Int<kTileK>{}), make_coord(0, _));
    Element* smem_b = ss.tensors.mainloop.smem_B.data();
    typename G::PipelineState state = cutlass::make_producer_start_state<typename G::Pipeline>();
    CUTLASS_PRAGMA_NO_UNROLL
    for (int kt = 0; kt < k_tiles; ++kt) {
      pipeline.producer_acquire(state);
      const int stage = state.index();
      const int col = kt * kTileK + c * G::kChunk;
      const bool kin = col < p.k;  // K % 8 == 0: a chunk is wholly in or out
      const int off = kin ? kt * kTileK : 0;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < G::kARows; ++i)
        cp_async_16(&sA(r0 + G::kRowsPerPass * i, c * G::kChunk, stage), a_src[i] + off, a_ok[i] && kin);
      if constexpr (G::kUseTmaB) {
        auto* bar = pipeline.producer_get_barrier(state);
        cutlass::arch::cpasync_barrier_arrive(bar);  // this thread's A copies
        if (t == 0) {  // its arrival carries the TMA's bytes
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, G::kTmaBytesB);
          CUTLASS_PRAGMA_UNROLL
          for (int box = 0; box < (G::kFuseSwiglu ? 2 : 1); ++box) {
            Tensor sBox = make_tensor(make_smem_ptr(smem_b + stage * kTileN * kTileK + box * G::kBoxRows * kTileK),
                                      typename G::SmemLayoutBox{});
            auto [tBg, tBs] = tma_partition(params.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sBox),
                                            group_modes<0, 2>(box == 0 ? gB0 : gB1));
            copy(params.tma_b.with(*bar), tBg(_, kt), tBs);
          }
        } else {
          pipeline.producer_commit(state);
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBRows; ++j)
          cp_async_16(&sB(r0 + G::kRowsPerPass * j, c * G::kChunk, stage), b_src[j] + off, b_ok[j] && kin);
        pipeline.producer_commit(state, cutlass::arch::cpasync_barrier_arrive);
      }
      ++state;
    }
    pipeline.producer_tail(state);
  } else {
    // Consumer warpgroups: CUTLASS's wgmma mainloop, then the epilogue through shared memory.
    const int mma_thread = threadIdx.x - G::kProducerThreads;
    typename G::TiledMma tiled_mma;
    Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(typename G::TileShape{}));
    typename G::PipelineState state;
    consume_tile<G>(pipeline, state, accum, k_tiles, mma_thread, warpgroup_computes<G>(p, mma_thread, rows),
                    ss.tensors.mainloop);
    // Both consumer warpgroups are done reading the stages before they are overwritten.
    cutlass::arch::NamedBarrier::sync(G::kConsumerThreads, 1);
    Tensor sC = make_tensor(make_smem_ptr(ss.tensors.epilogue.data()),
                            make_layout(make_shape(Int<kTileM>{}, Int<kTileN>{}), make_stride(Int<G::kEpiStride>{}, _1{})));
    Tensor tCsC = tiled_mma.get_thread_slice(mma_thread).partition_C(sC);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) tCsC(i) = Element(accum(i));
    cutlass::arch::NamedBarrier::sync(G::kConsumerThreads, 1);
    constexpr int kOutChunks = G::kOutCols / G::kChunk;
    const int out_ld = G::kFuseSwiglu ? p.n / 2 : p.n;
    const Element* epi = ss.tensors.epilogue.data();
    Element* out = reinterpret_cast<Element*>(p.out);
#pragma unroll 4
    for (int idx = mma_thread; idx < kTileM * kOutChunks; idx += G::kConsumerThreads) {
      const int r = idx / kOutChunks, cc = idx % kOutChunks;
      const int col = n_blk * G::kOutCols + cc * G::kChunk;
      if (r >= rows || col >= out_ld) continue;
      uint4 v = *reinterpret_cast<const uint4*>(epi + r * G::kEpiStride + cc * G::kChunk);
      if constexpr (G::kFuseSwiglu) {  // silu(gate) * up in fp32 from the bf16-rounded gate (v) and up (u); silu from
        // ex2.approx and rcp.approx (__expf, __fdividef: a few fp32 ulps, below the bf16 output's rounding step) rather
        // than expf and an IEEE division (~30 instructions a value; this epilogue is not overlapped with a mainloop)
        const uint4 u = *reinterpret_cast<const uint4*>(epi + r * G::kEpiStride + kTileN / 2 + cc * G::kChunk);
        const __nv_bfloat162* gv = reinterpret_cast<const __nv_bfloat162*>(&v);
        const __nv_bfloat162* uv = reinterpret_cast<const __nv_bfloat162*>(&u);
        uint4 o;
        __nv_bfloat162* ov = reinterpret_cast<__nv_bfloat162*>(&o);
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < 4; ++e) {
          const float2 gf = __bfloat1622float2(gv[e]), uf = __bfloat1622float2(uv[e]);
          ov[e] = __floats2bfloat162_rn(__fdividef(gf.x, 1.0f + __expf(-gf.x)) * uf.x,
                                        __fdividef(gf.y, 1.0f + __expf(-gf.y)) * uf.y);
        }
        v = o;
      }
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row0 + r) * out_ld + col) = v;
    }
  }
#endif
}

template <class G>
const char* run_gather_gemm(const GatherArgs& a) {
  static_assert(G::kSmemBytes <= 227 * 1024, "shared memory");
  cudaError_t e = cudaFuncSetAttribute(gather_gemm_kernel<G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       G::kSmemBytes);
  if (e != cudaSuccess) return "cudaFuncSetAttribute (shared memory) failed";
  constexpr int kTileM = cute::size<0>(typename G::TileShape{});
  const long long m_tiles = (a.m + kTileM - 1) / kTileM + a.groups;  // each group adds at most one partial tile
  if (m_tiles > 65535) return "too many rows for the gather GEMM's grid (M / 128 + G > 65535)";
  const int out_cols = G::kFuseSwiglu ? a.n / 2 : a.n;
  const dim3 grid((out_cols + G::kOutCols - 1) / G::kOutCols, static_cast<unsigned>(m_tiles));
  typename G::Params params{a, G::make_tma_b(reinterpret_cast<const typename G::Element*>(a.w), a.groups * a.n, a.k)};
  gather_gemm_kernel<G><<<grid, G::kThreads, G::kSmemBytes, a.stream>>>(params);
  return nullptr;
}

}  // namespace jax_dwdp_gmm

#define JAX_DWDP_GATHER_DEFINE_CONFIG(var, name, ...)                                     \
  namespace jax_dwdp_gmm {                                                                \
  using var##Impl = GatherGemm<__VA_ARGS__>;                                              \
  const GatherConfig var = {name, var##Impl::kTileRows, &run_gather_gemm<var##Impl>};     \
  }
