// The DWDP expert store's XLA FFI custom calls (handlers.cc), as the test-only library (testing.cc) reuses them.
//
// Python (jax_dwdp/parallel/cuda_vmm.py, through cuda.bindings) owns every CUDA object of a store: the VMM
// allocations and their mappings, the primary contexts, the copy streams and the events. The custom calls get what
// they use as attributes (PrefetchBinding / WaitBinding: the custom call's whole interface; the Python side is
// ExpertStore.prefetch / wait in jax_dwdp/parallel/dwdp_ffi.py) plus one small host table, owned by Python, for the
// state that changes while programs run:
//
//   per device row (the store's devices in this process, attribute `ordinals` order), 2 + K int64 words:
//     word 0        a pthread spinlock: held by a handler while it enqueues, and by Python while it closes the store
//                   or forgets unwaited prefetches (so neither sees the other half-way)
//     word 1        1 once Python has begun to close the store: the handlers then refuse (its streams and events
//                   are about to be destroyed)
//     word 2 + k    the destination (gate_up) address of the prefetch whose "done" event is done[row * K + k], or 0:
//                   how dwdp_wait, which one compiled program runs for every layer, finds the event of its buffer
//
// The layout is mirrored by cuda_vmm.TABLE_* in Python.
#pragma once

#include <cuda.h>
#include <pthread.h>

#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace dwdp {

namespace ffi = xla::ffi;
using Ints = ffi::Span<const int64_t>;

constexpr int64_t kLockWord = 0, kClosedWord = 1, kFirstSlotWord = 2;

// "where: call failed with CUDA_ERROR_NAME (code)": the one form every CUDA failure is reported in.
std::string Describe(const std::string& where, const char* call, CUresult r);

// One device row of the table, locked for the guard's life, with the row's context current. ok() is false, with
// error() saying why, when the device is not one of the store's, the store is closing, or the context cannot be
// made current.
class RowGuard {
 public:
  RowGuard(int64_t table, Ints ordinals, Ints contexts, int64_t slots, int32_t ordinal, const std::string& where);
  ~RowGuard();
  RowGuard(const RowGuard&) = delete;
  RowGuard& operator=(const RowGuard&) = delete;

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  int64_t row() const { return row_; }
  int64_t* slots() const { return words_ + kFirstSlotWord; }  // K pending destination addresses

 private:
  int64_t* words_ = nullptr;
  int64_t row_ = -1;
  bool locked_ = false, pushed_ = false;
  std::string error_;
};

// The copy both prefetches enqueue (handlers.cc): dst_by_row[row * dst_stride + w] is where the device's row
// writes weight w (total[w] bytes; dst_stride 0: every row writes dst_by_row[0, 2)); `own`: copy the rank's own
// block too; `copy_peers`: copy the peers' blocks (false only in the test library's probe of the events alone).
// `view_layout` (in place; empty copying out, see InPlaceTarget): a prefetch into a slot set that holds another
// layer's experts not yet waited for is refused (it would overwrite them before they are read).
ffi::Error PrefetchInto(CUstream stream, int32_t ordinal, int64_t store, int64_t layer, int64_t table, Ints ordinals,
                        Ints ranks, Ints contexts, Ints streams, Ints ready, Ints done, Ints timing, Ints sources,
                        Ints block_bytes, const CUdeviceptr dst_by_row[], size_t dst_stride, const size_t total[2],
                        bool own, bool copy_peers, Ints view_layout);

// In place, which layer a prefetch fills: its `target` operand is that layer's gate_up view on the calling device,
// so one compiled program (a decoder layer's, which prefetches the next layer) serves every layer. view_layout =
// [slot sets, bytes of one layer's views on a row, layers, then each row's first view address]: row `row` sees
// layer l's weight w at view_layout[3 + row] + l * bytes + w * N * block_bytes[0]. `sources` and `timing` hold
// every layer (sources[(l * 2 + w) * N + r], timing[(l * rows + row) * 2 + {0, 1}]); layer() gives the layer's
// part of each. ok() is false, with error() saying why, when the target is no layer's view on this device.
class InPlaceTarget {
 public:
  InPlaceTarget(int32_t ordinal, const void* target, Ints ordinals, Ints sources, Ints timing, Ints block_bytes,
                Ints view_layout, const std::string& where);
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  int64_t layer() const { return layer_; }
  const CUdeviceptr* views() const { return views_; }  // the row's views of the layer's two weights
  Ints sources() const { return sources_; }            // the layer's [2 * N]
  Ints timing() const { return timing_; }              // the layer's [2 * rows]

 private:
  int64_t layer_ = -1;
  CUdeviceptr views_[2] = {0, 0};
  Ints sources_, timing_;
  std::string error_;
};

// The attributes both prefetches take after their own leading ones, in this order (their handlers' parameters
// follow it): the table, the per-row CUDA objects, the timing events, the blocks' sources and sizes.
template <typename Binding>
auto CopyAttributes(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("table")
      .template Attr<Ints>("ordinals")
      .template Attr<Ints>("ranks")
      .template Attr<Ints>("contexts")
      .template Attr<Ints>("streams")
      .template Attr<Ints>("ready")
      .template Attr<Ints>("done")
      .template Attr<Ints>("timing")
      .template Attr<Ints>("sources")
      .template Attr<Ints>("block_bytes");
}

ffi::Error Prefetch(CUstream stream, int32_t ordinal, ffi::AnyBuffer dep, int64_t store, int64_t layer,
                    int64_t table, Ints ordinals, Ints ranks, Ints contexts, Ints streams, Ints ready, Ints done,
                    Ints timing, Ints sources, Ints block_bytes, ffi::Result<ffi::AnyBuffer> gate_up,
                    ffi::Result<ffi::AnyBuffer> down);

// dwdp_prefetch(dep) -> (gate_up [E, 2I, H], down [E, H, I]). Per row (the device's position in `ordinals`):
// contexts / streams / ready its primary context, copy stream and ready event; done[row * K, (row + 1) * K) its
// done events; timing[2 * row, 2 * row + 2) this layer's start / stop events (0: not timed). sources[w * N + r]:
// where rank r's block of weight w of this layer is (N ranks); block_bytes[w] its size. All handles and addresses
// are the integer values of the CUDA objects.
inline auto PrefetchBinding() {
  return CopyAttributes(ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<CUstream>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()  // dep: orders the copy after the work that produced it
      .Attr<int64_t>("store")
      .Attr<int64_t>("layer"))
      .Ret<ffi::AnyBuffer>()   // gate_up
      .Ret<ffi::AnyBuffer>();  // down
}

ffi::Error PrefetchInPlace(CUstream stream, int32_t ordinal, ffi::AnyBuffer dep, ffi::AnyBuffer target,
                           int64_t store, int64_t table, Ints ordinals, Ints ranks, Ints contexts, Ints streams,
                           Ints ready, Ints done, Ints timing, Ints sources, Ints block_bytes, Ints total_bytes,
                           Ints view_layout, ffi::Result<ffi::AnyBuffer> token);

// dwdp_prefetch_in_place(dep, target) -> token: copies the peers' blocks of the layer whose gate_up view `target` is
// (InPlaceTarget) into that view's slots; the rank's own block is mapped there and never copied. The attributes
// are the same for every layer: Prefetch's, with `sources` and `timing` for every layer, plus total_bytes[w], the
// bytes of E experts of weight w, and view_layout. The done event is keyed by the target's address (dwdp_wait's
// gate_up operand is that view).
inline auto PrefetchInPlaceBinding() {
  return CopyAttributes(ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<CUstream>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()  // dep
      .Arg<ffi::AnyBuffer>()  // target: the layer's gate_up view (never read)
      .Attr<int64_t>("store"))
      .Attr<Ints>("total_bytes")
      .Attr<Ints>("view_layout")
      .Ret<ffi::AnyBuffer>();  // token (never written)
}

ffi::Error Wait(CUstream stream, int32_t ordinal, ffi::AnyBuffer gate_up, ffi::AnyBuffer down, ffi::AnyBuffer after,
                int64_t store, int64_t table, Ints ordinals, Ints contexts, Ints done,
                ffi::Result<ffi::AnyBuffer> after_out);

// dwdp_wait(gate_up, down, after) -> after: XLA's stream waits for the done event of the prefetch that wrote gate_up.
// The output aliases `after` (Python's input_output_aliases): the consumer reads it, which keeps and orders the call.
inline auto WaitBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<CUstream>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()  // gate_up
      .Arg<ffi::AnyBuffer>()  // down
      .Arg<ffi::AnyBuffer>()  // after: the input of the MoE's first grouped matmul
      .Attr<int64_t>("store")
      .Attr<int64_t>("table")
      .Attr<Ints>("ordinals")
      .Attr<Ints>("contexts")
      .Attr<Ints>("done")
      .Ret<ffi::AnyBuffer>();  // after, aliased (never written)
}

}  // namespace dwdp
