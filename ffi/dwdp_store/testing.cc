// libjax_dwdp_ffi_testing.so: the two prefetches with fault injection, for the GPU tests and the one-GPU benchmark
// only (tests/store_testing.py loads it; jax_dwdp never does). Each is the production prefetch (handlers.cc,
// compiled into this library too) behind more attributes:
//   poison      1: fill every destination the copies write (copy out: the outputs; in place: the peers' slots of
//               the view) with 0xFF bytes (NaN) on the copy stream, after XLA's earlier work and before the copies,
//               so a byte the copies miss stays NaN
//   delay_ms    hold the copy stream that long before the copies (a host function on the stream), so that a read of
//               the experts that does not wait for their copy sees the poison
//   inject      the address of one int64 the test owns: when non-zero, the next prefetch takes it (resetting it to
//               0) and fails as if cuMemcpyDtoDAsync had returned that CUresult
//   skip_peers  in place only, 1: copy nothing, record the events alone (the benchmark's layer without the link)
// The poison and the delay follow XLA's stream through the row's ready event, which the production code then
// records again.

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "handlers.h"

namespace dwdp {
namespace {

struct Range {
  CUdeviceptr address;
  size_t bytes;
};

void CUDA_CB Sleep(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms)));
}

std::string Where(int64_t store, int64_t layer) {
  return "dwdp_prefetch(store " + std::to_string(store) + ", layer " + std::to_string(layer) + ")";
}

// The injected error, if one is waiting.
ffi::Error Injected(int64_t inject, const std::string& where) {
  if (inject == 0) return ffi::Error::Success();
  int64_t code = __atomic_exchange_n(reinterpret_cast<int64_t*>(static_cast<uintptr_t>(inject)), int64_t{0},
                                     __ATOMIC_SEQ_CST);
  if (code != 0)
    return ffi::Error::Internal(Describe(where, "cuMemcpyDtoDAsync (injected)", static_cast<CUresult>(code)));
  return ffi::Error::Success();
}

// Delay and poison on the row's copy stream, after XLA's work so far. `poison(row)`: the ranges to fill.
template <typename Ranges>
ffi::Error Faults(CUstream stream, int32_t ordinal, int64_t table, Ints ordinals, Ints contexts, Ints streams,
                  Ints ready, Ints done, int64_t poison, int64_t delay_ms, const std::string& where, Ranges ranges) {
  if (poison == 0 && delay_ms <= 0) return ffi::Error::Success();
  const size_t rows = ordinals.size();
  if (rows == 0 || done.size() == 0 || done.size() % rows != 0 || streams.size() != rows || ready.size() != rows)
    return ffi::Error::InvalidArgument(where + ": the store's attributes are inconsistent");
  RowGuard guard(table, ordinals, contexts, static_cast<int64_t>(done.size() / rows), ordinal, where);
  if (!guard.ok()) return ffi::Error::Internal(guard.error());
  CUstream copy = reinterpret_cast<CUstream>(static_cast<uintptr_t>(streams[guard.row()]));
  CUevent after_xla = reinterpret_cast<CUevent>(static_cast<uintptr_t>(ready[guard.row()]));
  CUresult r = cuEventRecord(after_xla, stream);
  if (r == CUDA_SUCCESS) r = cuStreamWaitEvent(copy, after_xla, 0);
  if (r != CUDA_SUCCESS) return ffi::Error::Internal(Describe(where, "cuStreamWaitEvent (testing)", r));
  if (delay_ms > 0) {
    r = cuLaunchHostFunc(copy, Sleep, reinterpret_cast<void*>(static_cast<intptr_t>(delay_ms)));
    if (r != CUDA_SUCCESS) return ffi::Error::Internal(Describe(where, "cuLaunchHostFunc (testing)", r));
  }
  if (poison != 0)
    for (const Range& range : ranges(guard.row())) {
      r = cuMemsetD8Async(range.address, 0xFF, range.bytes, copy);
      if (r != CUDA_SUCCESS) {
        cuStreamSynchronize(copy);
        return ffi::Error::Internal(Describe(where, "cuMemsetD8Async (testing)", r));
      }
    }
  return ffi::Error::Success();
}

ffi::Error TestingPrefetch(CUstream stream, int32_t ordinal, ffi::AnyBuffer dep, int64_t store, int64_t layer,
                           int64_t table, Ints ordinals, Ints ranks, Ints contexts, Ints streams, Ints ready,
                           Ints done, Ints timing, Ints sources, Ints block_bytes,
                           ffi::Result<ffi::AnyBuffer> gate_up, ffi::Result<ffi::AnyBuffer> down, int64_t poison,
                           int64_t delay_ms, int64_t inject) {
  const std::string where = Where(store, layer);
  if (ffi::Error e = Injected(inject, where); e.failure()) return e;
  auto outputs = [&](int64_t) {
    return std::vector<Range>{{reinterpret_cast<CUdeviceptr>(gate_up->untyped_data()), gate_up->size_bytes()},
                              {reinterpret_cast<CUdeviceptr>(down->untyped_data()), down->size_bytes()}};
  };
  if (ffi::Error e = Faults(stream, ordinal, table, ordinals, contexts, streams, ready, done, poison, delay_ms, where,
                            outputs);
      e.failure())
    return e;
  return Prefetch(stream, ordinal, dep, store, layer, table, ordinals, ranks, contexts, streams, ready, done, timing,
                  sources, block_bytes, gate_up, down);
}

ffi::Error TestingPrefetchInPlace(CUstream stream, int32_t ordinal, ffi::AnyBuffer dep, ffi::AnyBuffer target,
                                  int64_t store, int64_t table, Ints ordinals, Ints ranks, Ints contexts,
                                  Ints streams, Ints ready, Ints done, Ints timing, Ints sources, Ints block_bytes,
                                  Ints total_bytes, Ints view_layout, ffi::Result<ffi::AnyBuffer> token,
                                  int64_t poison, int64_t delay_ms, int64_t inject, int64_t skip_peers) {
  const std::string where = "dwdp_prefetch_in_place(store " + std::to_string(store) + ")";
  InPlaceTarget t(ordinal, target.untyped_data(), ordinals, sources, timing, block_bytes, view_layout, where);
  if (!t.ok()) return ffi::Error::InvalidArgument(t.error());
  const std::string at = where + " of layer " + std::to_string(t.layer());
  if (ffi::Error e = Injected(inject, at); e.failure()) return e;
  if (total_bytes.size() != 2 || ranks.size() != ordinals.size())
    return ffi::Error::InvalidArgument(at + ": the store's in-place attributes are inconsistent");
  const int64_t n = static_cast<int64_t>(t.sources().size() / 2);
  auto peer_slots = [&](int64_t row) {  // the view's ranges at the peers' offsets, as far as E experts reach
    std::vector<Range> out;
    for (int w = 0; w < 2; ++w)
      for (int64_t p = 0; p < n; ++p) {
        const size_t offset = static_cast<size_t>(p * block_bytes[w]);
        if (p == ranks[row] || offset >= static_cast<size_t>(total_bytes[w])) continue;
        out.push_back({t.views()[w] + offset,
                       std::min(static_cast<size_t>(block_bytes[w]), static_cast<size_t>(total_bytes[w]) - offset)});
      }
    return out;
  };
  if (ffi::Error e = Faults(stream, ordinal, table, ordinals, contexts, streams, ready, done, poison, delay_ms, at,
                            peer_slots);
      e.failure())
    return e;
  if (skip_peers == 0)
    return PrefetchInPlace(stream, ordinal, dep, target, store, table, ordinals, ranks, contexts, streams, ready,
                           done, timing, sources, block_bytes, total_bytes, view_layout, token);
  const size_t total[2] = {static_cast<size_t>(total_bytes[0]), static_cast<size_t>(total_bytes[1])};
  return PrefetchInto(stream, ordinal, store, t.layer(), table, ordinals, ranks, contexts, streams, ready, done,
                      t.timing(), t.sources(), block_bytes, t.views(), 0, total, /*own=*/false, /*copy_peers=*/false,
                      view_layout);
}

}  // namespace
}  // namespace dwdp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpStoreTestingPrefetch, dwdp::TestingPrefetch,
                              dwdp::PrefetchBinding()
                                  .Attr<int64_t>("poison")
                                  .Attr<int64_t>("delay_ms")
                                  .Attr<int64_t>("inject"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpStoreTestingPrefetchInPlace, dwdp::TestingPrefetchInPlace,
                              dwdp::PrefetchInPlaceBinding()
                                  .Attr<int64_t>("poison")
                                  .Attr<int64_t>("delay_ms")
                                  .Attr<int64_t>("inject")
                                  .Attr<int64_t>("skip_peers"));
