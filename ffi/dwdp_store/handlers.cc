// The two XLA FFI custom calls of the DWDP expert store (see store.h, ffi/README.md).
// - dwdp_prefetch(dep) -> (gate_up, down): records an event on XLA's stream, makes the device's copy stream wait
//   for it (so the copy never overwrites memory that earlier XLA work still reads: the write-after-read guard),
//   copies every rank's block into the XLA-allocated outputs, and records a "done" event keyed by the output
//   address.
// - dwdp_wait(gate_up, down, after) -> token: makes XLA's stream wait for that done event. `after` is the
//   consuming layer's MoE input, so XLA cannot schedule the wait early; Python ties the experts' uses to the
//   token with an optimization barrier. (Outputs aliased to the expert operands would make XLA copy a program
//   parameter before the wait: a read racing the copy.)
// Neither is marked command-buffer compatible: they do host work that must run on every execution.

#include <algorithm>
#include <chrono>
#include <thread>

#include "store.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace dwdp {
namespace {

ffi::Error Fail(const std::string& message) { return ffi::Error(ffi::ErrorCode::kInternal, message); }

void CUDA_CB DelayCopies(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }

// The store and this device's state for a handler (the caller then opens a DeviceScope on it).
ffi::Error FindDevice(int64_t store_id, int32_t ordinal, const std::string& where, std::shared_ptr<Store>* s,
                      Device** d) {
  *s = Find(store_id);
  if (!*s) return Fail(where + ": no open expert store with this id (was it closed?)");
  const int rank = (*s)->rank_of(ordinal);
  if (rank < 0) return Fail(where + ": device " + std::to_string(ordinal) + " is not one of the store's devices");
  *d = (*s)->device_of_rank(rank);
  return ffi::Error::Success();
}

// Enqueues layer `layer`'s copy into `outs` on the device's copy stream, after everything XLA enqueued on
// `stream` so far, and records its done event (under d.mu).
Status EnqueueCopy(Store& s, Device& d, int rank, CUstream stream, int layer, ffi::AnyBuffer* const outs[2],
                   const std::string& where) {
  const TestHooks& hooks = s.hooks;
  if (hooks.time_copies) d.timed[layer] = 0;
  DWDP_CU(where, cuEventRecord(d.ready, stream));  // the write-after-read guard on the destination
  DWDP_CU(where, cuStreamWaitEvent(d.copy, d.ready, 0));
  if (hooks.time_copies) DWDP_CU(where, cuEventRecord(d.timing_start[layer], d.copy));
  if (hooks.delay_copies) DWDP_CU(where, cuLaunchHostFunc(d.copy, DelayCopies, nullptr));
  if (hooks.poison)
    for (int w = 0; w < 2; ++w)
      DWDP_CU(where, cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(outs[w]->untyped_data()), 0xFF,
                                     outs[w]->size_bytes(), d.copy));
  for (int w = 0; w < 2; ++w) {
    Region& reg = s.region(layer, w);
    const size_t total = outs[w]->size_bytes();
    const size_t block = s.block_bytes(w);
    CUdeviceptr dst = reinterpret_cast<CUdeviceptr>(outs[w]->untyped_data());
    // One copy per rank block: the local block HBM -> HBM, each peer's over NVLink. (One copy spanning local
    // and peer mappings of the composite VA ran at about 80 GiB/s on two H200s, 2026-11-30; per-block copies
    // let the driver pick the peer path for each.) The local block is copied last, the peers' first.
    for (int step = 1; step <= s.ranks; ++step) {
      const int r = (rank + step) % s.ranks;
      const size_t offset = static_cast<size_t>(r) * block;
      if (offset >= total) continue;
      const size_t n = std::min(block, total - offset);
      DWDP_CU(where, cuMemcpyDtoDAsync(dst + offset, reg.va + r * reg.stride, n, d.copy));
    }
  }
  if (hooks.time_copies) {
    DWDP_CU(where, cuEventRecord(d.timing_stop[layer], d.copy));
    d.timed[layer] = 1;
  }
  CUevent done = nullptr;
  if (!d.pool.empty()) {
    done = d.pool.back();
    d.pool.pop_back();
  } else {
    DWDP_CU(where, cuEventCreate(&done, CU_EVENT_DISABLE_TIMING));
    g_live.events++;
  }
  CUresult res = cuEventRecord(done, d.copy);
  if (res != CUDA_SUCCESS) {
    d.pool.push_back(done);
    return Status{Describe(where, "cuEventRecord", res)};
  }
  const uintptr_t key = reinterpret_cast<uintptr_t>(outs[0]->untyped_data());
  auto it = d.pending.find(key);
  if (it != d.pending.end()) {  // an earlier prefetch into this address that nobody waited for
    d.pool.push_back(it->second);
    it->second = done;
  } else {
    d.pending.emplace(key, done);
  }
  return {};
}

ffi::Error PrefetchImpl(CUstream stream, int32_t ordinal, ffi::AnyBuffer /*dep*/, int64_t store_id, int64_t layer,
                        ffi::Result<ffi::AnyBuffer> gate_up, ffi::Result<ffi::AnyBuffer> down) {
  const std::string where = "dwdp_prefetch(store " + std::to_string(store_id) + ", layer " + std::to_string(layer) + ")";
  std::shared_ptr<Store> s;
  Device* dp = nullptr;
  if (ffi::Error e = FindDevice(store_id, ordinal, where, &s, &dp); e.failure()) return e;
  const int rank = s->rank_of(ordinal);
  if (layer < 0 || layer >= s->layers)
    return Fail(where + ": layer out of range [0, " + std::to_string(s->layers) + ")");
  if (s->weights != 2) return Fail(where + ": the store holds " + std::to_string(s->weights) + " weights, expected 2");
  ffi::AnyBuffer* const outs[2] = {&(*gate_up), &(*down)};
  for (int w = 0; w < 2; ++w) {
    const size_t want = static_cast<size_t>(s->experts) * s->expert_bytes[w];
    if (outs[w]->size_bytes() != want)
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        where + ": output " + std::to_string(w) + " has " + std::to_string(outs[w]->size_bytes()) +
                            " bytes, expected " + std::to_string(want) + " (experts x expert bytes)");
  }
  Device& d = *dp;
  DeviceScope scope(d, where);
  if (!scope.ok()) return Fail(scope.error());
  for (int r = 0; r < s->ranks; ++r)  // under d.mu: ImportPeer maps a peer's blocks holding it
    if (!s->rank_mapped(r))
      return Fail(where + ": rank " + std::to_string(r) + "'s blocks are not mapped here yet (dwdp_store_import)");
  if (int injected = s->hooks.inject.exchange(0); injected != 0)
    return Fail(Describe(where, "cuMemcpyDtoDAsync (injected)", static_cast<CUresult>(injected)));
  Status st = EnqueueCopy(*s, d, rank, stream, static_cast<int>(layer), outs, where);
  if (!st.ok()) {
    // XLA frees the outputs of a failed call: no copy may still be writing them.
    cuStreamSynchronize(d.copy);
    return Fail(st.message);
  }
  return ffi::Error::Success();
}

ffi::Error WaitImpl(CUstream stream, int32_t ordinal, ffi::AnyBuffer gate_up, ffi::AnyBuffer /*down*/,
                    ffi::AnyBuffer /*after*/, int64_t store_id, ffi::Result<ffi::AnyBuffer> /*token*/) {
  // The expert buffers are read-only operands (no output aliases them, so XLA never copies them first: the
  // address below is the one dwdp_prefetch wrote). Python ties their uses to the token with an optimization
  // barrier, so nothing reads them before this wait.
  const std::string where = "dwdp_wait(store " + std::to_string(store_id) + ")";
  std::shared_ptr<Store> s;
  Device* dp = nullptr;
  if (ffi::Error e = FindDevice(store_id, ordinal, where, &s, &dp); e.failure()) return e;
  Device& d = *dp;
  DeviceScope scope(d, where);
  if (!scope.ok()) return Fail(scope.error());
  const uintptr_t key = reinterpret_cast<uintptr_t>(gate_up.untyped_data());
  auto it = d.pending.find(key);
  if (it == d.pending.end())
    return Fail(where + ": its input was not written by dwdp_prefetch on device " + std::to_string(ordinal) +
                " (or was already waited for)");
  CUresult r = cuStreamWaitEvent(stream, it->second, 0);
  if (r != CUDA_SUCCESS) return Fail(Describe(where, "cuStreamWaitEvent", r));
  d.pool.push_back(it->second);
  d.pending.erase(it);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dwdp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpPrefetch, dwdp::PrefetchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // dep
                                  .Attr<int64_t>("store")
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::AnyBuffer>()   // gate_up [E, 2I, H]
                                  .Ret<ffi::AnyBuffer>());  // down [E, H, I]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpWait, dwdp::WaitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // gate_up
                                  .Arg<ffi::AnyBuffer>()  // down
                                  .Arg<ffi::AnyBuffer>()  // after: the consuming MoE's input
                                  .Attr<int64_t>("store")
                                  .Ret<ffi::AnyBuffer>());  // token (never written)
