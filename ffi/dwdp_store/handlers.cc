// The XLA FFI custom calls of the DWDP expert store (interface: handlers.h; the picture: ffi/README.md).
// - dwdp_prefetch_in_place(dep, target) -> token: records the ready event on XLA's stream and makes the device's
//   copy stream wait for it (so the copy never overwrites a slot that earlier XLA work, the layer two back, still
//   reads: the write-after-read guard), copies the peers' blocks into the slots of the compute view `target` (the
//   layer is the one whose view that is; the rank's own block is mapped there, never copied), and records a done
//   event whose table slot names the view's gate_up address. Its attributes hold every layer, so the call can sit
//   inside the program of the layer before, which one compilation serves for all layers.
// - dwdp_prefetch(dep) -> (gate_up, down): the same into XLA-allocated outputs, the rank's own block copied too:
//   for blocks that are not a multiple of the allocation granularity (no contiguous view).
// - dwdp_wait(gate_up, down, after) -> token: makes XLA's stream wait for the done event of that address. `after` is
//   the input of the consuming MoE's first grouped matmul, so XLA schedules the wait right before that matmul; Python ties the experts' uses to the
//   token with an optimization barrier. (Outputs aliased to the expert operands would make XLA copy a program
//   parameter before the wait: a read racing the copy.)
// None is marked command-buffer compatible: they do host work that must run on every execution.
// Everything else of the store (allocation, mapping, export / import, streams, events, release) is Python's, through
// cuda.bindings (jax_dwdp/parallel/cuda_vmm.py).

#include "handlers.h"

#include <algorithm>

namespace dwdp {
namespace {

ffi::Error Fail(const std::string& message) { return ffi::Error(ffi::ErrorCode::kInternal, message); }
ffi::Error Invalid(const std::string& message) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, message); }

template <typename T>
T Handle(int64_t value) {  // a CUDA handle (a pointer type) from its integer value, as Python passes it
  return reinterpret_cast<T>(static_cast<uintptr_t>(value));
}

CUdeviceptr Address(int64_t value) { return static_cast<CUdeviceptr>(static_cast<uint64_t>(value)); }

std::string ErrorName(CUresult r) {
  const char* name = nullptr;
  if (cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) return "CUDA_ERROR_UNKNOWN";
  return name;
}

// Enqueues the copy of layer's blocks (sources) into dst[w] (E experts, total[w] bytes) on `copy`, after everything
// XLA enqueued on `stream` so far, and records `finished` after it; "" or the failure. The peers' blocks first;
// rank `rank`'s own block last, unless `own` is false (in place: the view maps it, nothing moves). `peers` false
// copies no peer block (the test library's timing probe: the events alone).
std::string EnqueueCopy(CUstream stream, CUstream copy, CUevent ready, CUevent start, CUevent stop, CUevent finished,
                        int64_t rank, int64_t ranks, Ints sources, Ints block_bytes, const CUdeviceptr dst[2],
                        const size_t total[2], bool own, bool peers, const std::string& where) {
  auto failed = [&](const char* call, CUresult r) { return r == CUDA_SUCCESS ? "" : Describe(where, call, r); };
  std::string e;
  if (!(e = failed("cuEventRecord", cuEventRecord(ready, stream))).empty()) return e;  // the write-after-read guard
  if (!(e = failed("cuStreamWaitEvent", cuStreamWaitEvent(copy, ready, 0))).empty()) return e;
  if (start != nullptr && !(e = failed("cuEventRecord", cuEventRecord(start, copy))).empty()) return e;
  for (int w = 0; w < 2; ++w) {
    const size_t block = static_cast<size_t>(block_bytes[w]);
    // One copy per rank block: each peer's over NVLink, the local one HBM -> HBM. (One copy spanning local and
    // peer mappings of the composite VA ran at about 80 GiB/s on two H200s; per-block copies let the driver pick
    // the peer path for each.) The last rank's padding slots lie past `total` and are never copied.
    for (int64_t step = 1; step <= ranks; ++step) {
      const int64_t r = (rank + step) % ranks;
      if (r == rank ? !own : !peers) continue;
      const size_t offset = static_cast<size_t>(r) * block;
      if (offset >= total[w]) continue;
      const size_t n = std::min(block, total[w] - offset);
      CUresult res = cuMemcpyDtoDAsync(dst[w] + offset, Address(sources[w * ranks + r]), n, copy);
      if (!(e = failed("cuMemcpyDtoDAsync", res)).empty()) return e;
    }
  }
  if (stop != nullptr && !(e = failed("cuEventRecord", cuEventRecord(stop, copy))).empty()) return e;
  return failed("cuEventRecord", cuEventRecord(finished, copy));
}

}  // namespace

std::string Describe(const std::string& where, const char* call, CUresult r) {
  return where + ": " + call + " failed with " + ErrorName(r) + " (" + std::to_string(static_cast<int>(r)) + ")";
}

RowGuard::RowGuard(int64_t table, Ints ordinals, Ints contexts, int64_t slots, int32_t ordinal,
                   const std::string& where) {
  for (size_t i = 0; i < ordinals.size(); ++i)
    if (ordinals[i] == ordinal) {
      row_ = static_cast<int64_t>(i);
      break;
    }
  if (row_ < 0) {
    error_ = where + ": device " + std::to_string(ordinal) + " is not one of the store's devices";
    return;
  }
  if (table == 0 || contexts.size() != ordinals.size() || slots < 1) {
    error_ = where + ": the store's attributes are inconsistent (table, contexts, done events)";
    return;
  }
  words_ = Handle<int64_t*>(table) + row_ * (kFirstSlotWord + slots);
  pthread_spin_lock(reinterpret_cast<pthread_spinlock_t*>(words_ + kLockWord));
  locked_ = true;
  if (words_[kClosedWord] != 0) {
    error_ = where + ": the store is closed";
    return;
  }
  CUresult r = cuCtxPushCurrent(Handle<CUcontext>(contexts[row_]));
  if (r != CUDA_SUCCESS) {
    error_ = Describe(where, "cuCtxPushCurrent", r);
    return;
  }
  pushed_ = true;
}

RowGuard::~RowGuard() {
  if (pushed_) {
    CUcontext ignored;
    cuCtxPopCurrent(&ignored);
  }
  if (locked_) pthread_spin_unlock(reinterpret_cast<pthread_spinlock_t*>(words_ + kLockWord));
}

// The prefetch both forms share: the checks, the device's row, a done-event slot keyed by the row's gate_up
// destination (the address dwdp_wait is given), the copy into dst_by_row[row * dst_stride + w]. `own`: whether the
// rank's own block is copied too.
ffi::Error PrefetchInto(CUstream stream, int32_t ordinal, int64_t store, int64_t layer, int64_t table, Ints ordinals,
                        Ints ranks, Ints contexts, Ints streams, Ints ready, Ints done, Ints timing, Ints sources,
                        Ints block_bytes, const CUdeviceptr dst_by_row[], size_t dst_stride, const size_t total[2],
                        bool own, bool copy_peers, Ints view_layout) {
  const std::string where = "dwdp_prefetch(store " + std::to_string(store) + ", layer " + std::to_string(layer) + ")";
  const size_t rows = ordinals.size();
  if (rows == 0 || ranks.size() != rows || streams.size() != rows || ready.size() != rows || done.size() == 0 ||
      done.size() % rows != 0 || timing.size() != 2 * rows || block_bytes.size() != 2 || sources.size() == 0 ||
      sources.size() % 2 != 0)
    return Invalid(where + ": the store's attributes are inconsistent (one entry per device row, two weights)");
  const int64_t n = static_cast<int64_t>(sources.size() / 2);
  const int64_t slots = static_cast<int64_t>(done.size() / rows);
  for (int w = 0; w < 2; ++w)
    if (block_bytes[w] <= 0 || total[w] > static_cast<size_t>(n * block_bytes[w]))
      return Invalid(where + ": weight " + std::to_string(w) + " has " + std::to_string(total[w]) +
                     " bytes, more than the " + std::to_string(n) + " rank blocks of " +
                     std::to_string(block_bytes[w]) + " bytes hold");

  RowGuard guard(table, ordinals, contexts, slots, ordinal, where);
  if (!guard.ok()) return Fail(guard.error());
  const int64_t row = guard.row();
  const int64_t rank = ranks[row];
  if (rank < 0 || rank >= n) return Invalid(where + ": rank " + std::to_string(rank) + " of " + std::to_string(n));
  const CUdeviceptr* dst = dst_by_row + row * dst_stride;

  // The done event's slot: the one an earlier prefetch into this address that nobody waited for holds (copy out:
  // that buffer is gone, XLA gave its memory to this output; in place: the same layer prefetched again), else a
  // free one.
  const int64_t key = static_cast<int64_t>(dst[0]);
  int64_t* pending = guard.slots();
  int64_t slot = -1;
  for (int64_t k = 0; k < slots && slot < 0; ++k)
    if (pending[k] == key) slot = k;
  for (int64_t k = 0; k < slots && slot < 0; ++k)
    if (pending[k] == 0) slot = k;
  if (slot < 0)
    return Fail(where + ": " + std::to_string(slots) + " prefetches on device " + std::to_string(ordinal) +
                " are not waited for (store.sync() forgets them)");
  if (view_layout.size() != 0) {
    if (view_layout.size() != rows + 3 || view_layout[0] < 2 || view_layout[1] <= 0)
      return Invalid(where + ": the store's view layout is inconsistent");
    const uint64_t sets = static_cast<uint64_t>(view_layout[0]), bytes = static_cast<uint64_t>(view_layout[1]);
    const uint64_t base = static_cast<uint64_t>(view_layout[3 + row]);
    for (int64_t k = 0; k < slots; ++k) {
      const uint64_t other = static_cast<uint64_t>(pending[k]);
      if (other == 0 || pending[k] == key || other < base) continue;
      const uint64_t other_layer = (other - base) / bytes;
      if (other_layer % sets == static_cast<uint64_t>(layer) % sets)
        return Fail(where + ": layer " + std::to_string(other_layer) + "'s experts, in the same slot set (" +
                    std::to_string(other_layer % sets) + " of " + std::to_string(sets) +
                    "), are prefetched and not yet waited for: this copy would overwrite them before they are read "
                    "(a prefetch depth of d needs d + 1 slot sets)");
    }
  }

  CUstream copy = Handle<CUstream>(streams[row]);
  std::string error = EnqueueCopy(stream, copy, Handle<CUevent>(ready[row]), Handle<CUevent>(timing[2 * row]),
                                  Handle<CUevent>(timing[2 * row + 1]), Handle<CUevent>(done[row * slots + slot]),
                                  rank, n, sources, block_bytes, dst, total, own, copy_peers, where);
  if (!error.empty()) {
    // XLA frees the outputs of a failed call, and a failed in-place copy leaves its slots half-written: no copy may
    // still be writing, and no wait may find them.
    cuStreamSynchronize(copy);
    pending[slot] = 0;
    return Fail(error);
  }
  pending[slot] = key;
  return ffi::Error::Success();
}

ffi::Error Prefetch(CUstream stream, int32_t ordinal, ffi::AnyBuffer /*dep*/, int64_t store, int64_t layer,
                    int64_t table, Ints ordinals, Ints ranks, Ints contexts, Ints streams, Ints ready, Ints done,
                    Ints timing, Ints sources, Ints block_bytes, ffi::Result<ffi::AnyBuffer> gate_up,
                    ffi::Result<ffi::AnyBuffer> down) {
  // Whichever row the ordinal finds writes this device's outputs (dst_stride 0).
  const CUdeviceptr dst[2] = {reinterpret_cast<CUdeviceptr>(gate_up->untyped_data()),
                              reinterpret_cast<CUdeviceptr>(down->untyped_data())};
  const size_t total[2] = {gate_up->size_bytes(), down->size_bytes()};
  return PrefetchInto(stream, ordinal, store, layer, table, ordinals, ranks, contexts, streams, ready, done, timing,
                      sources, block_bytes, dst, 0, total, /*own=*/true, /*copy_peers=*/true, Ints());
}

InPlaceTarget::InPlaceTarget(int32_t ordinal, const void* target, Ints ordinals, Ints sources, Ints timing,
                             Ints block_bytes, Ints view_layout, const std::string& where) {
  const size_t rows = ordinals.size();
  if (rows == 0 || view_layout.size() != rows + 3 || view_layout[1] <= 0 || view_layout[2] <= 0 ||
      block_bytes.size() != 2 || block_bytes[0] <= 0) {
    error_ = where + ": the store's view layout is inconsistent";
    return;
  }
  const uint64_t layers = static_cast<uint64_t>(view_layout[2]);
  if (sources.size() == 0 || sources.size() % (2 * layers) != 0 || timing.size() != 2 * rows * layers) {
    error_ = where + ": the store's sources / timing do not hold " + std::to_string(layers) + " layers";
    return;
  }
  size_t row = rows;
  for (size_t i = 0; i < rows; ++i)
    if (ordinals[i] == ordinal) row = i;
  if (row == rows) {
    error_ = where + ": device " + std::to_string(ordinal) + " is not one of the store's devices";
    return;
  }
  const uint64_t address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(target));
  const uint64_t base = static_cast<uint64_t>(view_layout[3 + row]), bytes = static_cast<uint64_t>(view_layout[1]);
  if (address < base || (address - base) % bytes != 0 || (address - base) / bytes >= layers) {
    error_ = where + ": its target is not a layer's gate_up view of the store on device " + std::to_string(ordinal) +
             " (pass store.layer_experts(layer)[0])";
    return;
  }
  layer_ = static_cast<int64_t>((address - base) / bytes);
  const size_t n = sources.size() / (2 * layers);
  views_[0] = static_cast<CUdeviceptr>(address);
  views_[1] = static_cast<CUdeviceptr>(address + n * static_cast<uint64_t>(block_bytes[0]));
  sources_ = Ints(sources.begin() + layer_ * 2 * n, 2 * n);
  timing_ = Ints(timing.begin() + layer_ * 2 * rows, 2 * rows);
}

ffi::Error PrefetchInPlace(CUstream stream, int32_t ordinal, ffi::AnyBuffer /*dep*/, ffi::AnyBuffer target,
                           int64_t store, int64_t table, Ints ordinals, Ints ranks, Ints contexts, Ints streams,
                           Ints ready, Ints done, Ints timing, Ints sources, Ints block_bytes, Ints total_bytes,
                           Ints view_layout, ffi::Result<ffi::AnyBuffer> /*token*/) {
  const std::string where = "dwdp_prefetch_in_place(store " + std::to_string(store) + ")";
  if (total_bytes.size() != 2 || total_bytes[0] <= 0 || total_bytes[1] <= 0)
    return Invalid(where + ": the store's in-place attributes are inconsistent (two weights' total bytes)");
  InPlaceTarget t(ordinal, target.untyped_data(), ordinals, sources, timing, block_bytes, view_layout, where);
  if (!t.ok()) return Invalid(t.error());
  const size_t total[2] = {static_cast<size_t>(total_bytes[0]), static_cast<size_t>(total_bytes[1])};
  return PrefetchInto(stream, ordinal, store, t.layer(), table, ordinals, ranks, contexts, streams, ready, done,
                      t.timing(), t.sources(), block_bytes, t.views(), 0, total, /*own=*/false, /*copy_peers=*/true,
                      view_layout);
}

ffi::Error Wait(CUstream stream, int32_t ordinal, ffi::AnyBuffer gate_up, ffi::AnyBuffer /*down*/,
                ffi::AnyBuffer /*after*/, int64_t store, int64_t table, Ints ordinals, Ints contexts, Ints done,
                ffi::Result<ffi::AnyBuffer> /*after_out*/) {
  // The expert buffers are read-only operands (no output aliases them, so XLA never copies them first: the address
  // below is the one dwdp_prefetch wrote). Python ties their uses to the output with an optimization barrier, so
  // nothing reads them before this wait.
  const std::string where = "dwdp_wait(store " + std::to_string(store) + ")";
  const size_t rows = ordinals.size();
  if (rows == 0 || done.size() == 0 || done.size() % rows != 0)
    return Invalid(where + ": the store's attributes are inconsistent (one entry per device row)");
  const int64_t slots = static_cast<int64_t>(done.size() / rows);
  RowGuard guard(table, ordinals, contexts, slots, ordinal, where);
  if (!guard.ok()) return Fail(guard.error());
  const int64_t key = static_cast<int64_t>(reinterpret_cast<uintptr_t>(gate_up.untyped_data()));
  int64_t* pending = guard.slots();
  for (int64_t k = 0; k < slots; ++k) {
    if (pending[k] != key) continue;
    CUresult r = cuStreamWaitEvent(stream, Handle<CUevent>(done[guard.row() * slots + k]), 0);
    if (r != CUDA_SUCCESS) return Fail(Describe(where, "cuStreamWaitEvent", r));
    pending[k] = 0;
    return ffi::Error::Success();
  }
  return Fail(where + ": its input was not written by dwdp_prefetch on device " + std::to_string(ordinal) +
              " (or was already waited for)");
}

}  // namespace dwdp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpStorePrefetch, dwdp::Prefetch, dwdp::PrefetchBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpStoreWait, dwdp::Wait, dwdp::WaitBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpStorePrefetchInPlace, dwdp::PrefetchInPlace, dwdp::PrefetchInPlaceBinding());
