// XLA FFI custom call "JaxDwdpGroupedGemm": the MoE expert matmul on Hopper through a CUTLASS sm90 grouped GEMM.
//
//   out[rows of group g] = x[rows of group g] @ w[g]^T     (x [M, K] bf16, w [G, N, K] bf16, out [M, N] bf16)
//
// and "JaxDwdpGroupedGemmSwiglu", the gate_up projection with SiLU(gate) * up fused into the epilogue: w's rows
// interleaved in blocks of 8 gate / 8 up rows (swiglu_epilogue.cuh), out [M, N / 2] bf16.
//
// Rows of x are sorted by group; group_sizes [G] int32 stays on the device. Each call, on XLA's stream:
//   1. a one-block setup kernel prefix-sums group_sizes and writes, per group, the problem shape (rows_g, N, K),
//      the A/B/D pointers and the strides into the workspace (an extra output buffer of the custom call);
//   2. a kernel zeroes the rows of out past sum(group_sizes) (nothing to do when the groups cover every row);
//   3. the CUTLASS grouped GEMM reads those arrays on the device (host problem shapes = nullptr).
// No host work depends on the data, so the handler is safe to record into a CUDA graph (command buffer).
// Group sizes are sanitised on the device: negative sizes count as 0 and groups are clipped to the M rows, so
// bad routing data cannot make the kernel write out of bounds.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cute/layout.hpp"
#include "grouped_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_dwdp_gmm {
namespace {

using ProblemShapeT = cute::Shape<int, int, int>;
using StrideT = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;
static_assert(sizeof(ProblemShapeT) == 12 && sizeof(StrideT) == 8, "layout assumed by the workspace");

constexpr size_t kAlign = 128;          // every workspace section starts 128-byte aligned (TMA descriptors need 64)
constexpr int kMaxSmCount = 1024;       // upper bound used when Python sizes the workspace without a device
constexpr int kSetupThreads = 1024;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Workspace layout; identical on the host (sizing) and in the handler (carving).
struct Layout {
  size_t ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, shapes, total, cutlass, bytes;
  static Layout make(int groups, size_t cutlass_bytes) {
    Layout l{};
    size_t off = 0;
    auto take = [&](size_t n) {
      size_t at = off;
      off = round_up(off + n, kAlign);
      return at;
    };
    const size_t g = static_cast<size_t>(std::max(groups, 1));
    l.ptr_a = take(g * sizeof(void*));
    l.ptr_b = take(g * sizeof(void*));
    l.ptr_d = take(g * sizeof(void*));
    l.stride_a = take(g * sizeof(StrideT));
    l.stride_b = take(g * sizeof(StrideT));
    l.stride_d = take(g * sizeof(StrideT));
    l.shapes = take(g * sizeof(ProblemShapeT));
    l.total = take(sizeof(long long));
    l.cutlass = take(cutlass_bytes);
    l.bytes = off + kAlign;  // slack to align the base pointer XLA hands us
    return l;
  }
};

const GemmConfig* const kConfigs[] = {&kCoop128x256x64C2, &kPingpong64x128x128C2, &kPingpong128x128x64C2,
                                      &kCoop128x256x64C1, &kPingpong64x128x128C1};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);
const GemmConfig* const kSwigluConfigs[] = {&kCoop128x256x64C1Swiglu, &kPingpong64x128x128C1Swiglu};
constexpr int kNumSwigluConfigs = sizeof(kSwigluConfigs) / sizeof(kSwigluConfigs[0]);

size_t cutlass_bytes_all_configs(int groups, int sm_count) {
  size_t b = 0;
  for (const GemmConfig* c : kConfigs) b = std::max(b, c->workspace_bytes(groups, sm_count));
  for (const GemmConfig* c : kSwigluConfigs) b = std::max(b, c->workspace_bytes(groups, sm_count));
  return b;
}

// Inclusive block-wide scan of one value per thread (blockDim.x == kSetupThreads).
__device__ long long block_inclusive_scan(long long v, long long* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int d = 1; d < 32; d <<= 1) {
    long long u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    long long s = lane < (kSetupThreads / 32) ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      long long u = __shfl_up_sync(0xffffffffu, s, d);
      if (lane >= d) s += u;
    }
    warp_sums[lane] = s;  // inclusive prefix of warp totals
  }
  __syncthreads();
  if (warp > 0) v += warp_sums[warp - 1];
  __syncthreads();  // warp_sums is reused by the next chunk
  return v;
}

__global__ void __launch_bounds__(kSetupThreads)
    setup_groups_kernel(const int32_t* __restrict__ group_sizes, int groups, long long m, int n, int k, int n_out,
                        const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* out, const void** ptr_a,
                        const void** ptr_b, void** ptr_d, StrideT* stride_a, StrideT* stride_b, StrideT* stride_d,
                        ProblemShapeT* shapes, long long* total_rows) {
  __shared__ long long warp_sums[32];
  __shared__ long long carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < groups; base += kSetupThreads) {
    const int g = base + threadIdx.x;
    const long long size = g < groups ? max(group_sizes[g], 0) : 0;
    const long long incl = block_inclusive_scan(size, warp_sums);
    const long long c = carry;
    if (g < groups) {
      const long long start = min(c + incl - size, m);
      const long long rows = min(c + incl, m) - start;
      shapes[g] = ProblemShapeT(static_cast<int>(rows), n, k);
      ptr_a[g] = x + start * k;
      ptr_b[g] = w + static_cast<long long>(g) * n * k;
      ptr_d[g] = out + start * n_out;
      stride_a[g] = StrideT(k, cute::Int<1>{}, cute::Int<0>{});
      stride_b[g] = StrideT(k, cute::Int<1>{}, cute::Int<0>{});
      stride_d[g] = StrideT(n_out, cute::Int<1>{}, cute::Int<0>{});
    }
    __syncthreads();
    if (threadIdx.x == kSetupThreads - 1) carry = c + incl;
    __syncthreads();
  }
  if (threadIdx.x == 0) *total_rows = min(carry, m);
}

// Zeroes out[total_rows:, :] with 16-byte stores (N % 8 == 0 keeps rows 16-byte aligned).
__global__ void zero_tail_rows_kernel(const long long* total_rows, long long m, int n, __nv_bfloat16* out) {
  const long long begin = *total_rows * n / 8, end = m * n / 8;
  uint4* o = reinterpret_cast<uint4*>(out);
  for (long long i = begin + blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < end;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    o[i] = make_uint4(0, 0, 0, 0);
}

// The gather GEMM's per-group table: first row, rows (clipped to M, negative sizes as 0) and first M tile of each
// group, tile_start[groups] = the tile count, and the rows covered (for zero_tail_rows_kernel).
__global__ void __launch_bounds__(kSetupThreads)
    setup_gather_kernel(const int32_t* __restrict__ group_sizes, int groups, long long m, int tile_rows,
                        int32_t* row_start, int32_t* rows_out, int32_t* tile_start, long long* total_rows) {
  __shared__ long long warp_sums[32];
  __shared__ long long carry_rows, carry_tiles;
  if (threadIdx.x == 0) carry_rows = carry_tiles = 0;
  __syncthreads();
  for (int base = 0; base < groups; base += kSetupThreads) {
    const int g = base + threadIdx.x;
    const long long size = g < groups ? max(group_sizes[g], 0) : 0;
    const long long incl = block_inclusive_scan(size, warp_sums);
    const long long cr = carry_rows;
    const long long start = min(cr + incl - size, m);
    const long long rows = min(cr + incl, m) - start;
    const long long tiles = (rows + tile_rows - 1) / tile_rows;
    const long long tincl = block_inclusive_scan(tiles, warp_sums);
    const long long ct = carry_tiles;
    if (g < groups) {
      row_start[g] = static_cast<int32_t>(start);
      rows_out[g] = static_cast<int32_t>(rows);
      tile_start[g] = static_cast<int32_t>(ct + tincl - tiles);
    }
    __syncthreads();
    if (threadIdx.x == kSetupThreads - 1) {
      carry_rows = cr + incl;
      carry_tiles = ct + tincl;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    tile_start[groups] = static_cast<int32_t>(carry_tiles);
    *total_rows = min(carry_rows, m);
  }
}

// The gather GEMM's workspace: row_start, rows, tile_start and the covered-row count.
struct GatherLayout {
  size_t row_start, rows, tile_start, total, bytes;
  static GatherLayout make(int groups) {
    GatherLayout l{};
    size_t off = 0;
    auto take = [&](size_t n) {
      size_t at = off;
      off = round_up(off + n, kAlign);
      return at;
    };
    const size_t g = static_cast<size_t>(std::max(groups, 1));
    l.row_start = take(g * 4);
    l.rows = take(g * 4);
    l.tile_start = take((g + 1) * 4);
    l.total = take(sizeof(long long));
    l.bytes = off + kAlign;
    return l;
  }
};

const GatherConfig* const kGatherConfigs[] = {&kGatherTmaB128x256x64, &kGatherCoop128x256x64};
constexpr int kNumGatherConfigs = sizeof(kGatherConfigs) / sizeof(kGatherConfigs[0]);
const GatherConfig* const kGatherSwigluConfigs[] = {&kGatherSwiglu128x256x64};
constexpr int kNumGatherSwigluConfigs = sizeof(kGatherSwigluConfigs) / sizeof(kGatherSwigluConfigs[0]);

int sm_count_of(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < static_cast<int>(cache.size())) {
    int c = cache[device].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int c = 0;
  if (cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  if (device >= 0 && device < static_cast<int>(cache.size())) cache[device].store(c, std::memory_order_relaxed);
  return c;
}

ffi::Error cuda_error(const std::string& who, const char* what, cudaError_t e) {
  return ffi::Error::Internal(who + ": " + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// The steps both handlers share.

// Zeroes all M rows (no group covers any row). Returns Success or the CUDA error.
ffi::Error zero_all_rows(const std::string& who, __nv_bfloat16* out, long long m, long long n_out, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(out, 0, static_cast<size_t>(m) * n_out * 2, stream);
  return e == cudaSuccess ? ffi::Error::Success() : cuda_error(who, "cudaMemsetAsync", e);
}

// x, w and out start 16-byte aligned (TMA and 16-byte copies).
bool aligned16(const void* x, const void* w, const void* out) {
  for (const void* p : {x, w, out})
    if (reinterpret_cast<uintptr_t>(p) % 16) return false;
  return true;
}

// XLA's device for this call (its FFI context, not cudaStreamGetDevice: that call is refused while XLA records the
// stream into a command buffer, cudaErrorStreamCaptureUnsupported), made current (kernels and cudaFuncSetAttribute
// act on the current device); *sm_count = its SM count.
ffi::Error make_current(const std::string& who, int32_t device, int* sm_count) {
  int current = 0;
  cudaError_t e = cudaGetDevice(&current);
  if (e != cudaSuccess) return cuda_error(who, "cudaGetDevice", e);
  if (current != device && (e = cudaSetDevice(device)) != cudaSuccess) return cuda_error(who, "cudaSetDevice", e);
  *sm_count = sm_count_of(device);
  if (*sm_count <= 0) return ffi::Error::Internal(who + ": cannot query the SM count");
  return ffi::Error::Success();
}

// Zeroes out[total_rows:, :] once the setup kernel has written total_rows.
ffi::Error launch_zero_tail(const std::string& who, const long long* total_rows, long long m, long long n_out,
                            __nv_bfloat16* out, int sm_count, cudaStream_t stream) {
  const long long vecs = m * n_out / 8;
  const int blocks = static_cast<int>(std::min<long long>((vecs + 255) / 256, 2LL * sm_count));
  zero_tail_rows_kernel<<<blocks, 256, 0, stream>>>(total_rows, m, static_cast<int>(n_out), out);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : cuda_error(who, "zero-tail kernel launch", e);
}

// Runs a configuration's kernel; the error names the config and the CUDA error, if any.
ffi::Error run_config(const std::string& who, const char* name, const char* msg) {
  if (msg) {
    cudaError_t last = cudaGetLastError();
    return ffi::Error::Internal(who + " (" + name + "): " + msg +
                                (last != cudaSuccess ? std::string("; CUDA: ") + cudaGetErrorString(last) : ""));
  }
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : cuda_error(who, name, e);
}

// kSwiglu: out [M, N / 2] = silu(gate) * up from w's interleaved gate/up rows (N % 16 == 0).
template <bool kSwiglu>
ffi::Error grouped_gemm_impl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::BF16> out,
                             ffi::ResultBuffer<ffi::U8> workspace, int32_t config) {
  const std::string who = kSwiglu ? "JaxDwdpGroupedGemmSwiglu" : "JaxDwdpGroupedGemm";
  const char* out_shape = kSwiglu ? "out [M, N / 2]" : "out [M, N]";
  auto xd = x.dimensions(), wd = w.dimensions(), gd = group_sizes.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || gd.size() != 1 || od.size() != 2)
    return ffi::Error::InvalidArgument(who + ": expects x [M, K], w [G, N, K], group_sizes [G], " + out_shape);
  const long long m = xd[0], k = xd[1], groups = wd[0], n = wd[1], n_out = kSwiglu ? n / 2 : n;
  const int n_multiple = kSwiglu ? 16 : 8;  // SwiGLU: whole 8-row gate/up block pairs (I % 8 == 0)
  if (k % 8 || n % n_multiple || k <= 0 || n <= 0)
    return ffi::Error::InvalidArgument(who + ": K must be a positive multiple of 8 (16-byte TMA rows) and N a positive "
                                       "multiple of " + std::to_string(n_multiple) + ", got K=" + std::to_string(k) +
                                       " N=" + std::to_string(n));
  if (wd[2] != k || gd[0] != groups || od[0] != m || od[1] != n_out)
    return ffi::Error::InvalidArgument(who + ": shapes do not fit x [M, K], w [G, N, K], group_sizes [G], " + out_shape);
  if (k > INT32_MAX || n > INT32_MAX || m > INT32_MAX || groups > INT32_MAX)
    return ffi::Error::InvalidArgument(who + ": dimensions exceed int32");
  const int num_configs = kSwiglu ? kNumSwigluConfigs : kNumConfigs;
  if (config < 0 || config >= num_configs)
    return ffi::Error::InvalidArgument(who + ": unknown config " + std::to_string(config));
  if (m == 0) return ffi::Error::Success();
  auto* out_ptr = reinterpret_cast<__nv_bfloat16*>(out->untyped_data());
  if (groups == 0) return zero_all_rows(who, out_ptr, m, n_out, stream);  // every row is past the (empty) groups
  if (!aligned16(x.untyped_data(), w.untyped_data(), out_ptr))
    return ffi::Error::InvalidArgument(who + ": x, w and out must be 16-byte aligned");
  int sm_count = 0;
  if (ffi::Error err = make_current(who, device, &sm_count); err.failure()) return err;

  const GemmConfig& cfg = kSwiglu ? *kSwigluConfigs[config] : *kConfigs[config];
  const size_t cutlass_bytes = cfg.workspace_bytes(static_cast<int>(groups), sm_count);
  const Layout lay = Layout::make(static_cast<int>(groups), cutlass_bytes);
  const size_t ws_bytes = workspace->size_bytes();
  if (ws_bytes < lay.bytes)
    return ffi::Error::InvalidArgument(who + ": workspace of " + std::to_string(ws_bytes) +
                                       " bytes, needs " + std::to_string(lay.bytes));
  auto* ws = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(workspace->untyped_data()), kAlign));

  GroupedArgs a;
  a.groups = static_cast<int>(groups);
  a.n = static_cast<int>(n);
  a.k = static_cast<int>(k);
  a.problem_shapes = ws + lay.shapes;
  a.ptr_a = reinterpret_cast<const void**>(ws + lay.ptr_a);
  a.ptr_b = reinterpret_cast<const void**>(ws + lay.ptr_b);
  a.ptr_d = reinterpret_cast<void**>(ws + lay.ptr_d);
  a.stride_a = ws + lay.stride_a;
  a.stride_b = ws + lay.stride_b;
  a.stride_d = ws + lay.stride_d;
  a.cutlass_workspace = ws + lay.cutlass;
  a.cutlass_workspace_bytes = cutlass_bytes;
  a.device = device;
  a.sm_count = sm_count;
  a.stream = stream;
  auto* total_rows = reinterpret_cast<long long*>(ws + lay.total);

  setup_groups_kernel<<<1, kSetupThreads, 0, stream>>>(
      group_sizes.typed_data(), a.groups, m, a.n, a.k, static_cast<int>(n_out), reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()),
      reinterpret_cast<const __nv_bfloat16*>(w.untyped_data()), out_ptr, a.ptr_a, a.ptr_b, a.ptr_d,
      static_cast<StrideT*>(a.stride_a), static_cast<StrideT*>(a.stride_b), static_cast<StrideT*>(a.stride_d),
      static_cast<ProblemShapeT*>(a.problem_shapes), total_rows);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_error(who, "setup kernel launch", e);
  if (ffi::Error err = launch_zero_tail(who, total_rows, m, n_out, out_ptr, sm_count, stream); err.failure())
    return err;
  return run_config(who, cfg.name, cfg.run(a));
}

// out [M, N] = x[row_token] @ w[g]^T per group: the gate_up projection reading the tokens where they are; kSwiglu:
// out [M, N / 2] = silu(gate) * up, w's rows per expert N / 2 gate rows then N / 2 up rows (the checkpoint's layout).
template <bool kSwiglu>
ffi::Error gather_gemm_impl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x,
                            ffi::Buffer<ffi::S32> row_token, ffi::Buffer<ffi::BF16> w,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::BF16> out,
                            ffi::ResultBuffer<ffi::U8> workspace, int32_t config) {
  const std::string who = kSwiglu ? "JaxDwdpGatherGroupedGemmSwiglu" : "JaxDwdpGatherGroupedGemm";
  auto xd = x.dimensions(), td = row_token.dimensions(), wd = w.dimensions(), gd = group_sizes.dimensions(),
       od = out->dimensions();
  if (xd.size() != 2 || td.size() != 1 || wd.size() != 3 || gd.size() != 1 || od.size() != 2)
    return ffi::Error::InvalidArgument(who + ": expects x [T, K], row_token [M], w [G, N, K], group_sizes [G], "
                                       "out [M, N] (SwiGLU: [M, N / 2])");
  const long long tokens = xd[0], k = xd[1], m = td[0], groups = wd[0], n = wd[1], n_out = kSwiglu ? n / 2 : n;
  const int n_multiple = kSwiglu ? 16 : 8;
  if (k % 8 || n % n_multiple || k <= 0 || n <= 0)
    return ffi::Error::InvalidArgument(who + ": K must be a positive multiple of 8 (16-byte rows) and N of " +
                                       std::to_string(n_multiple) + ", got K=" + std::to_string(k) +
                                       " N=" + std::to_string(n));
  if (wd[2] != k || gd[0] != groups || od[0] != m || od[1] != n_out)
    return ffi::Error::InvalidArgument(who + ": shapes do not fit x [T, K], row_token [M], w [G, N, K], "
                                       "group_sizes [G], out [M, N]");
  if (k > INT32_MAX || n > INT32_MAX || m > INT32_MAX || tokens > INT32_MAX || groups > INT32_MAX)
    return ffi::Error::InvalidArgument(who + ": dimensions exceed int32");
  const int num_configs = kSwiglu ? kNumGatherSwigluConfigs : kNumGatherConfigs;
  if (config < 0 || config >= num_configs)
    return ffi::Error::InvalidArgument(who + ": unknown config " + std::to_string(config));
  if (m == 0) return ffi::Error::Success();
  auto* out_ptr = reinterpret_cast<__nv_bfloat16*>(out->untyped_data());
  if (groups == 0 || tokens == 0) return zero_all_rows(who, out_ptr, m, n_out, stream);  // no group / no token
  if (!aligned16(x.untyped_data(), w.untyped_data(), out_ptr))
    return ffi::Error::InvalidArgument(who + ": x, w and out must be 16-byte aligned");
  int sm_count = 0;
  if (ffi::Error err = make_current(who, device, &sm_count); err.failure()) return err;

  const GatherConfig& cfg = kSwiglu ? *kGatherSwigluConfigs[config] : *kGatherConfigs[config];
  const GatherLayout lay = GatherLayout::make(static_cast<int>(groups));
  if (workspace->size_bytes() < lay.bytes)
    return ffi::Error::InvalidArgument(who + ": workspace of " + std::to_string(workspace->size_bytes()) +
                                       " bytes, needs " + std::to_string(lay.bytes));
  auto* ws = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(workspace->untyped_data()), kAlign));
  GatherArgs a;
  a.x = x.untyped_data();
  a.row_token = row_token.typed_data();
  a.w = w.untyped_data();
  a.out = out_ptr;
  a.m = m;
  a.tokens = static_cast<int>(tokens);
  a.n = static_cast<int>(n);
  a.k = static_cast<int>(k);
  a.groups = static_cast<int>(groups);
  a.row_start = reinterpret_cast<int32_t*>(ws + lay.row_start);
  a.rows = reinterpret_cast<int32_t*>(ws + lay.rows);
  a.tile_start = reinterpret_cast<int32_t*>(ws + lay.tile_start);
  const char* half = std::getenv("JAX_DWDP_GATHER_HALF_TILES");  // read at each call: "0" turns the skip off
  a.half_tiles = !(half && std::string(half) == "0");
  a.stream = stream;
  auto* total_rows = reinterpret_cast<long long*>(ws + lay.total);

  setup_gather_kernel<<<1, kSetupThreads, 0, stream>>>(group_sizes.typed_data(), a.groups, m, cfg.tile_rows,
                                                       const_cast<int32_t*>(a.row_start), const_cast<int32_t*>(a.rows),
                                                       const_cast<int32_t*>(a.tile_start), total_rows);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_error(who, "setup kernel launch", e);
  if (ffi::Error err = launch_zero_tail(who, total_rows, m, n_out, out_ptr, sm_count, stream); err.failure())
    return err;
  return run_config(who, cfg.name, cfg.run(a));
}

}  // namespace
}  // namespace jax_dwdp_gmm

// Exported with default visibility (the library is built with hidden visibility so that its CUTLASS template
// instances never bind to another library's, e.g. PyTorch's, in the same process).
#define JAX_DWDP_GMM_EXPORT extern "C" __attribute__((visibility("default")))
JAX_DWDP_GMM_EXPORT XLA_FFI_Error* JaxDwdpGroupedGemm(XLA_FFI_CallFrame* call_frame);
JAX_DWDP_GMM_EXPORT XLA_FFI_Error* JaxDwdpGroupedGemmNoGraph(XLA_FFI_CallFrame* call_frame);
JAX_DWDP_GMM_EXPORT size_t JaxDwdpGroupedGemmWorkspaceBytes(int32_t groups, int32_t sm_count);
JAX_DWDP_GMM_EXPORT int32_t JaxDwdpGroupedGemmNumConfigs();
JAX_DWDP_GMM_EXPORT const char* JaxDwdpGroupedGemmConfigName(int32_t i);
JAX_DWDP_GMM_EXPORT XLA_FFI_Error* JaxDwdpGroupedGemmSwiglu(XLA_FFI_CallFrame* call_frame);
JAX_DWDP_GMM_EXPORT XLA_FFI_Error* JaxDwdpGroupedGemmSwigluNoGraph(XLA_FFI_CallFrame* call_frame);
JAX_DWDP_GMM_EXPORT int32_t JaxDwdpGroupedGemmSwigluNumConfigs();
JAX_DWDP_GMM_EXPORT const char* JaxDwdpGroupedGemmSwigluConfigName(int32_t i);
JAX_DWDP_GMM_EXPORT XLA_FFI_Error* JaxDwdpGatherGroupedGemm(XLA_FFI_CallFrame* call_frame);
JAX_DWDP_GMM_EXPORT XLA_FFI_Error* JaxDwdpGatherGroupedGemmSwiglu(XLA_FFI_CallFrame* call_frame);
JAX_DWDP_GMM_EXPORT size_t JaxDwdpGatherGroupedGemmWorkspaceBytes(int32_t groups);
JAX_DWDP_GMM_EXPORT int32_t JaxDwdpGatherGroupedGemmNumConfigs();
JAX_DWDP_GMM_EXPORT const char* JaxDwdpGatherGroupedGemmConfigName(int32_t i);
JAX_DWDP_GMM_EXPORT int32_t JaxDwdpGatherGroupedGemmSwigluNumConfigs();
JAX_DWDP_GMM_EXPORT const char* JaxDwdpGatherGroupedGemmSwigluConfigName(int32_t i);

#define JAX_DWDP_GMM_BINDING                                 \
  ffi::Ffi::Bind()                                           \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()              \
      .Ctx<ffi::DeviceOrdinal>()                             \
      .Arg<ffi::Buffer<ffi::BF16>>() /* x [M, K] */          \
      .Arg<ffi::Buffer<ffi::BF16>>() /* w [G, N, K] */       \
      .Arg<ffi::Buffer<ffi::S32>>()  /* group_sizes [G] */   \
      .Ret<ffi::Buffer<ffi::BF16>>() /* out [M, N] (SwiGLU: [M, N / 2]) */ \
      .Ret<ffi::Buffer<ffi::U8>>()   /* workspace */         \
      .Attr<int32_t>("config")

// Recordable into XLA command buffers (CUDA graphs): only stream work, nothing on the host reads the data.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpGroupedGemm, jax_dwdp_gmm::grouped_gemm_impl<false>, JAX_DWDP_GMM_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
// The same handler without the trait: XLA then runs it outside command buffers (a fallback switch).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpGroupedGemmNoGraph, jax_dwdp_gmm::grouped_gemm_impl<false>, JAX_DWDP_GMM_BINDING);
// The fused gate_up + SwiGLU projection (out [M, N / 2]), with and without the trait.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpGroupedGemmSwiglu, jax_dwdp_gmm::grouped_gemm_impl<true>, JAX_DWDP_GMM_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpGroupedGemmSwigluNoGraph, jax_dwdp_gmm::grouped_gemm_impl<true>,
                              JAX_DWDP_GMM_BINDING);

// The gate_up projection with the token gather in its loads (gather_gemm.cuh), and with SiLU(gate) * up fused.
#define JAX_DWDP_GATHER_BINDING                                  \
  ffi::Ffi::Bind()                                               \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                  \
      .Ctx<ffi::DeviceOrdinal>()                                 \
      .Arg<ffi::Buffer<ffi::BF16>>() /* x [T, K] */              \
      .Arg<ffi::Buffer<ffi::S32>>()  /* row_token [M] */         \
      .Arg<ffi::Buffer<ffi::BF16>>() /* w [G, N, K] */           \
      .Arg<ffi::Buffer<ffi::S32>>()  /* group_sizes [G] */       \
      .Ret<ffi::Buffer<ffi::BF16>>() /* out [M, N] or [M, N/2] */ \
      .Ret<ffi::Buffer<ffi::U8>>()   /* workspace */             \
      .Attr<int32_t>("config")
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpGatherGroupedGemm, jax_dwdp_gmm::gather_gemm_impl<false>, JAX_DWDP_GATHER_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpGatherGroupedGemmSwiglu, jax_dwdp_gmm::gather_gemm_impl<true>,
                              JAX_DWDP_GATHER_BINDING);

extern "C" {

// Bytes of the workspace output for `groups` groups on a device with at most `sm_count` SMs (any config).
// sm_count <= 0 uses a generous upper bound. Host-only: no CUDA call.
size_t JaxDwdpGroupedGemmWorkspaceBytes(int32_t groups, int32_t sm_count) {
  using namespace jax_dwdp_gmm;
  const int sms = sm_count > 0 ? sm_count : kMaxSmCount;
  return Layout::make(groups, cutlass_bytes_all_configs(groups, sms)).bytes;
}

int32_t JaxDwdpGroupedGemmNumConfigs() { return jax_dwdp_gmm::kNumConfigs; }

const char* JaxDwdpGroupedGemmConfigName(int32_t i) {
  return i >= 0 && i < jax_dwdp_gmm::kNumConfigs ? jax_dwdp_gmm::kConfigs[i]->name : nullptr;
}

int32_t JaxDwdpGroupedGemmSwigluNumConfigs() { return jax_dwdp_gmm::kNumSwigluConfigs; }

const char* JaxDwdpGroupedGemmSwigluConfigName(int32_t i) {
  return i >= 0 && i < jax_dwdp_gmm::kNumSwigluConfigs ? jax_dwdp_gmm::kSwigluConfigs[i]->name : nullptr;
}

// Bytes of the gather GEMM's workspace output for `groups` groups. Host-only.
size_t JaxDwdpGatherGroupedGemmWorkspaceBytes(int32_t groups) {
  return jax_dwdp_gmm::GatherLayout::make(groups).bytes;
}

int32_t JaxDwdpGatherGroupedGemmNumConfigs() { return jax_dwdp_gmm::kNumGatherConfigs; }

const char* JaxDwdpGatherGroupedGemmConfigName(int32_t i) {
  return i >= 0 && i < jax_dwdp_gmm::kNumGatherConfigs ? jax_dwdp_gmm::kGatherConfigs[i]->name : nullptr;
}

int32_t JaxDwdpGatherGroupedGemmSwigluNumConfigs() { return jax_dwdp_gmm::kNumGatherSwigluConfigs; }

const char* JaxDwdpGatherGroupedGemmSwigluConfigName(int32_t i) {
  return i >= 0 && i < jax_dwdp_gmm::kNumGatherSwigluConfigs ? jax_dwdp_gmm::kGatherSwigluConfigs[i]->name : nullptr;
}

}  // extern "C"
