// jax_dwdp's DWDP expert store: expert weights in CUDA VMM allocations, one composite virtual address per
// (layer, weight) that shows every rank's experts contiguously to every device, and two XLA FFI custom calls that
// copy a layer's experts into an XLA buffer on a side stream while XLA computes.
//
// Design notes (see ffi/README.md for the whole picture):
// - One process drives every device of the store (PJRT's single-process multi-GPU client).
// - Rank r's block of each (layer, weight) is one cuMemCreate allocation on device r (POSIX fd handle, or
//   FABRIC when a probe allocation succeeds), mapped at offset r * stride of the (layer, weight)'s reserved VA.
//   cuMemSetAccess grants every store device read access to the whole range, so a peer block is an address.
// - dwdp_prefetch(dep) -> (gate_up, down): records an event on XLA's stream, makes the device's copy stream wait
//   for it (so the copy never overwrites memory that earlier XLA work still reads: the write-after-read guard),
//   copies every rank's block into the XLA-allocated outputs, and records a "done" event keyed by the output
//   address.
// - dwdp_wait(gate_up, down, after) -> token: makes XLA's stream wait for that done event. `after` is the
//   consuming layer's MoE input, so XLA cannot schedule the wait early; Python ties the experts' uses to the
//   token with an optimization barrier. (Outputs aliased to the expert operands would make XLA copy a program
//   parameter before the wait: a read racing the copy.)
// - Every CUDA failure returns an ffi::Error naming the call and the CUresult; the C API returns -1 and leaves
//   the message in dwdp_last_error().
// - dwdp_store_close releases every mapping, VA range, allocation handle, stream and event; live-object counters
//   let tests prove it.

#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

thread_local std::string g_last_error;

std::string ErrorName(CUresult r) {
  const char* name = nullptr;
  if (cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) return "CUDA_ERROR_UNKNOWN";
  return name;
}

std::string Describe(const std::string& where, const char* call, CUresult r) {
  return where + ": " + call + " failed with " + ErrorName(r) + " (" + std::to_string(static_cast<int>(r)) + ")";
}

// Objects alive across all stores; tests check they return to zero after close.
std::atomic<int64_t> g_live_allocations{0};
std::atomic<int64_t> g_live_mappings{0};
std::atomic<int64_t> g_live_ranges{0};
std::atomic<int64_t> g_live_streams{0};
std::atomic<int64_t> g_live_events{0};

struct Status {
  std::string message;  // empty: success
  bool ok() const { return message.empty(); }
};

#define DWDP_CU(where, call)                                       \
  do {                                                             \
    CUresult _r = (call);                                          \
    if (_r != CUDA_SUCCESS) return Status{Describe(where, #call, _r)}; \
  } while (0)

class ScopedContext {
 public:
  explicit ScopedContext(CUcontext ctx) : pushed_(cuCtxPushCurrent(ctx) == CUDA_SUCCESS) {}
  ~ScopedContext() {
    if (pushed_) {
      CUcontext ignored;
      cuCtxPopCurrent(&ignored);
    }
  }
  bool ok() const { return pushed_; }

 private:
  bool pushed_;
};

struct Device {
  int ordinal = -1;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;  // the primary context (the one XLA uses), retained
  CUstream copy = nullptr;  // the copy stream
  CUevent ready = nullptr;  // recorded on XLA's stream by each prefetch
  bool closing = false;     // set (under mu) by close before anything is released; handlers then refuse
  std::mutex mu;
  std::vector<CUevent> pool;                        // idle "done" events
  std::unordered_map<uintptr_t, CUevent> pending;   // prefetch destination -> done event
  std::vector<CUevent> timing_start, timing_stop;   // per layer, when timing is on
  std::vector<char> timed;                          // layer has a recorded pair
};

struct Region {  // one (layer, weight): every rank's block in one reserved VA range
  CUdeviceptr va = 0;
  size_t reserved = 0;
  size_t stride = 0;  // bytes between rank blocks (block rounded up to the allocation granularity)
  std::vector<CUmemGenericAllocationHandle> handles;
  std::vector<char> mapped;
};

struct Store {
  int64_t id = 0;
  int ranks = 0, layers = 0, weights = 0, slots = 0, experts = 0;
  bool timing = false;
  bool poison = false;  // fill each prefetch destination with 0xFF bytes (NaN in bf16/fp32) before the copy
  bool delay = false;   // (tests) hold the copy stream 20 ms before each prefetch's copies: a read that does not
                        // wait for the copy then sees the poison
  size_t granularity = 0;
  CUmemAllocationHandleType handle_type = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  std::vector<size_t> expert_bytes;  // per weight
  std::vector<std::unique_ptr<Device>> devices;  // per rank
  std::vector<Region> regions;                   // layer * weights + weight
  std::atomic<int> inject{0};                    // a CUresult the next prefetch reports as a failure

  size_t block_bytes(int w) const { return static_cast<size_t>(slots) * expert_bytes[w]; }
  Region& region(int layer, int w) { return regions[static_cast<size_t>(layer) * weights + w]; }
  int rank_of(int ordinal) const {
    for (int r = 0; r < ranks; ++r)
      if (devices[r]->ordinal == ordinal) return r;
    return -1;
  }
};

std::mutex g_mu;
std::map<int64_t, std::shared_ptr<Store>> g_stores;
int64_t g_next_id = 1;

std::shared_ptr<Store> Find(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_stores.find(id);
  return it == g_stores.end() ? nullptr : it->second;
}

void DestroyEvent(CUevent& e) {
  if (e != nullptr && cuEventDestroy(e) == CUDA_SUCCESS) g_live_events--;
  e = nullptr;
}

// Releases everything a store holds. Returns the first failure's message (it keeps releasing after one).
std::string Release(Store& s) {
  std::string first;
  auto note = [&](const std::string& where, const char* call, CUresult r) {
    if (r != CUDA_SUCCESS && first.empty()) first = Describe(where, call, r);
  };
  // First make every handler refuse (under each device's lock, so none is half-way through enqueuing), then wait
  // for every stream of every device (XLA's included): nothing may still read or write the memory.
  for (auto& d : s.devices) {
    if (d->ctx == nullptr) continue;
    std::lock_guard<std::mutex> lock(d->mu);
    d->closing = true;
    ScopedContext scope(d->ctx);
    note("dwdp_store_close", "cuCtxSynchronize", cuCtxSynchronize());
  }
  for (auto& reg : s.regions) {
    for (size_t r = 0; r < reg.mapped.size(); ++r) {
      if (!reg.mapped[r]) continue;
      CUresult res = cuMemUnmap(reg.va + r * reg.stride, reg.stride);
      note("dwdp_store_close", "cuMemUnmap", res);
      if (res == CUDA_SUCCESS) g_live_mappings--;
      reg.mapped[r] = 0;
    }
    for (auto& h : reg.handles) {
      if (h == 0) continue;
      CUresult res = cuMemRelease(h);
      note("dwdp_store_close", "cuMemRelease", res);
      if (res == CUDA_SUCCESS) g_live_allocations--;
      h = 0;
    }
    if (reg.va != 0) {
      CUresult res = cuMemAddressFree(reg.va, reg.reserved);
      note("dwdp_store_close", "cuMemAddressFree", res);
      if (res == CUDA_SUCCESS) g_live_ranges--;
      reg.va = 0;
    }
  }
  for (auto& d : s.devices) {
    if (d->ctx == nullptr) continue;
    {
      ScopedContext scope(d->ctx);
      std::lock_guard<std::mutex> lock(d->mu);
      for (auto& e : d->pool) DestroyEvent(e);
      for (auto& kv : d->pending) DestroyEvent(kv.second);
      for (auto& e : d->timing_start) DestroyEvent(e);
      for (auto& e : d->timing_stop) DestroyEvent(e);
      d->pool.clear();
      d->pending.clear();
      DestroyEvent(d->ready);
      if (d->copy != nullptr) {
        CUresult res = cuStreamDestroy(d->copy);
        note("dwdp_store_close", "cuStreamDestroy", res);
        if (res == CUDA_SUCCESS) g_live_streams--;
        d->copy = nullptr;
      }
    }
    note("dwdp_store_close", "cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease(d->dev));
    std::lock_guard<std::mutex> lock(d->mu);
    d->ctx = nullptr;
  }
  return first;
}

// Never fails: without FABRIC it falls back to POSIX file descriptors.
void ProbeHandleType(Store& s, CUmemAllocationProp prop) {
  // FABRIC handles work across nodes but need IMEX; take them only when a probe allocation succeeds.
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  size_t gran = 0;
  if (cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS) {
    CUmemGenericAllocationHandle probe = 0;
    if (cuMemCreate(&probe, gran, &prop, 0) == CUDA_SUCCESS) {
      cuMemRelease(probe);
      s.handle_type = CU_MEM_HANDLE_TYPE_FABRIC;
      return;
    }
  }
  s.handle_type = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

Status Build(Store& s, const int* ordinals) {
  const std::string where = "dwdp_store_create";
  DWDP_CU(where, cuInit(0));
  for (int r = 0; r < s.ranks; ++r) {
    auto d = std::make_unique<Device>();
    d->ordinal = ordinals[r];
    DWDP_CU(where, cuDeviceGet(&d->dev, ordinals[r]));
    int vmm = 0;
    DWDP_CU(where, cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d->dev));
    if (!vmm) return Status{where + ": device " + std::to_string(ordinals[r]) + " does not support CUDA VMM"};
    DWDP_CU(where, cuDevicePrimaryCtxRetain(&d->ctx, d->dev));
    s.devices.push_back(std::move(d));
    Device& dev = *s.devices.back();
    ScopedContext scope(dev.ctx);
    if (!scope.ok()) return Status{where + ": cannot make device " + std::to_string(dev.ordinal) + " current"};
    DWDP_CU(where, cuStreamCreate(&dev.copy, CU_STREAM_NON_BLOCKING));
    g_live_streams++;
    DWDP_CU(where, cuEventCreate(&dev.ready, CU_EVENT_DISABLE_TIMING));
    g_live_events++;
    if (s.timing) {
      dev.timing_start.assign(s.layers, nullptr);
      dev.timing_stop.assign(s.layers, nullptr);
      dev.timed.assign(s.layers, 0);
      for (int l = 0; l < s.layers; ++l) {
        DWDP_CU(where, cuEventCreate(&dev.timing_start[l], CU_EVENT_DEFAULT));
        g_live_events++;
        DWDP_CU(where, cuEventCreate(&dev.timing_stop[l], CU_EVENT_DEFAULT));
        g_live_events++;
      }
    }
  }
  for (int a = 0; a < s.ranks; ++a)
    for (int b = 0; b < s.ranks; ++b) {
      if (a == b) continue;
      int can = 0;
      DWDP_CU(where, cuDeviceCanAccessPeer(&can, s.devices[a]->dev, s.devices[b]->dev));
      if (!can)
        return Status{where + ": device " + std::to_string(s.devices[a]->ordinal) + " cannot access device " +
                      std::to_string(s.devices[b]->ordinal) + "'s memory (no peer access: DWDP needs NVLink or PCIe P2P)"};
    }

  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinals[0];
  {
    ScopedContext scope(s.devices[0]->ctx);
    ProbeHandleType(s, prop);
  }
  prop.requestedHandleTypes = s.handle_type;
  s.granularity = 0;
  for (int r = 0; r < s.ranks; ++r) {
    prop.location.id = ordinals[r];
    size_t gran = 0;
    DWDP_CU(where, cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    s.granularity = std::max(s.granularity, gran);
  }

  std::vector<CUmemAccessDesc> access(s.ranks);
  for (int r = 0; r < s.ranks; ++r) {
    access[r].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[r].location.id = ordinals[r];
    access[r].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  s.regions.resize(static_cast<size_t>(s.layers) * s.weights);
  for (int l = 0; l < s.layers; ++l) {
    for (int w = 0; w < s.weights; ++w) {
      Region& reg = s.region(l, w);
      const size_t block = s.block_bytes(w);
      reg.stride = (block + s.granularity - 1) / s.granularity * s.granularity;
      reg.reserved = reg.stride * s.ranks;
      reg.handles.assign(s.ranks, 0);
      reg.mapped.assign(s.ranks, 0);
      DWDP_CU(where, cuMemAddressReserve(&reg.va, reg.reserved, s.granularity, 0, 0));
      g_live_ranges++;
      for (int r = 0; r < s.ranks; ++r) {
        prop.location.id = ordinals[r];
        CUresult res = cuMemCreate(&reg.handles[r], reg.stride, &prop, 0);
        if (res != CUDA_SUCCESS) {
          reg.handles[r] = 0;
          std::string msg = Describe(where, "cuMemCreate", res) + " allocating " + std::to_string(reg.stride) +
                            " bytes on device " + std::to_string(ordinals[r]) + " for layer " + std::to_string(l);
          if (res == CUDA_ERROR_OUT_OF_MEMORY)
            msg += " (XLA preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of GPU memory; leave room for the store, "
                   "e.g. XLA_PYTHON_CLIENT_PREALLOCATE=false)";
          return Status{msg};
        }
        g_live_allocations++;
        DWDP_CU(where, cuMemMap(reg.va + r * reg.stride, reg.stride, 0, reg.handles[r], 0));
        reg.mapped[r] = 1;
        g_live_mappings++;
      }
      DWDP_CU(where, cuMemSetAccess(reg.va, reg.reserved, access.data(), access.size()));
    }
  }
  return {};
}

// ---- the custom calls --------------------------------------------------------------------------------------

void CUDA_CB DelayCopies(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }

ffi::Error Fail(const std::string& message) { return ffi::Error(ffi::ErrorCode::kInternal, message); }

// In a handler: on a CUDA failure, return on_error(message naming the call and the CUresult).
#define DWDP_FFI_CU(on_error, where, call)                                  \
  do {                                                                      \
    CUresult _r = (call);                                                   \
    if (_r != CUDA_SUCCESS) return on_error(Describe(where, #call, _r));    \
  } while (0)

// The store and this device's state for a handler (the caller then takes d->mu and checks `closing`).
ffi::Error FindDevice(int64_t store_id, int32_t ordinal, const std::string& where, std::shared_ptr<Store>* s,
                      Device** d) {
  *s = Find(store_id);
  if (!*s) return Fail(where + ": no open expert store with this id (was it closed?)");
  const int rank = (*s)->rank_of(ordinal);
  if (rank < 0) return Fail(where + ": device " + std::to_string(ordinal) + " is not one of the store's devices");
  *d = (*s)->devices[rank].get();
  return ffi::Error::Success();
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
  ffi::AnyBuffer* outs[2] = {&(*gate_up), &(*down)};
  for (int w = 0; w < 2; ++w) {
    const size_t want = static_cast<size_t>(s->experts) * s->expert_bytes[w];
    if (outs[w]->size_bytes() != want)
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        where + ": output " + std::to_string(w) + " has " + std::to_string(outs[w]->size_bytes()) +
                            " bytes, expected " + std::to_string(want) + " (experts x expert bytes)");
  }
  Device& d = *dp;
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.ctx == nullptr || d.closing) return Fail(where + ": the store is closing");
  if (int injected = s->inject.exchange(0); injected != 0)
    return Fail(Describe(where, "cuMemcpyDtoDAsync (injected)", static_cast<CUresult>(injected)));
  ScopedContext scope(d.ctx);
  if (!scope.ok()) return Fail(where + ": cannot make device " + std::to_string(ordinal) + " current");

  if (s->timing) d.timed[layer] = 0;
  // On a failure once the copy stream has work, drain it before returning: XLA frees the outputs of a failed call,
  // and no copy may still be writing them.
  auto drain = [&](const std::string& message) {
    cuStreamSynchronize(d.copy);
    return Fail(message);
  };
  // The copy starts after all work XLA enqueued before this call (write-after-read guard on the destination).
  DWDP_FFI_CU(drain, where, cuEventRecord(d.ready, stream));
  DWDP_FFI_CU(drain, where, cuStreamWaitEvent(d.copy, d.ready, 0));
  if (s->timing) DWDP_FFI_CU(drain, where, cuEventRecord(d.timing_start[layer], d.copy));
  if (s->delay) DWDP_FFI_CU(drain, where, cuLaunchHostFunc(d.copy, DelayCopies, nullptr));
  if (s->poison)
    for (int w = 0; w < 2; ++w)
      DWDP_FFI_CU(drain, where, cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(outs[w]->untyped_data()), 0xFF,
                                         outs[w]->size_bytes(), d.copy));
  for (int w = 0; w < 2; ++w) {
    Region& reg = s->region(static_cast<int>(layer), w);
    const size_t total = outs[w]->size_bytes();
    const size_t block = s->block_bytes(w);
    CUdeviceptr dst = reinterpret_cast<CUdeviceptr>(outs[w]->untyped_data());
    // One copy per rank block: the local block HBM -> HBM, each peer's over NVLink. (One copy spanning local
    // and peer mappings of the composite VA ran at about 80 GiB/s on two H200s, 2026-11-30; per-block copies
    // let the driver pick the peer path for each.) The local block is copied last, the peers' first.
    for (int step = 1; step <= s->ranks; ++step) {
      const int r = (rank + step) % s->ranks;
      const size_t offset = static_cast<size_t>(r) * block;
      if (offset >= total) continue;
      const size_t n = std::min(block, total - offset);
      DWDP_FFI_CU(drain, where, cuMemcpyDtoDAsync(dst + offset, reg.va + r * reg.stride, n, d.copy));
    }
  }
  if (s->timing) {
    DWDP_FFI_CU(drain, where, cuEventRecord(d.timing_stop[layer], d.copy));
    d.timed[layer] = 1;
  }
  CUevent done = nullptr;
  if (!d.pool.empty()) {
    done = d.pool.back();
    d.pool.pop_back();
  } else {
    DWDP_FFI_CU(drain, where, cuEventCreate(&done, CU_EVENT_DISABLE_TIMING));
    g_live_events++;
  }
  CUresult res = cuEventRecord(done, d.copy);
  if (res != CUDA_SUCCESS) {
    d.pool.push_back(done);
    return drain(Describe(where, "cuEventRecord", res));
  }
  const uintptr_t key = reinterpret_cast<uintptr_t>(outs[0]->untyped_data());
  auto it = d.pending.find(key);
  if (it != d.pending.end()) {  // an earlier prefetch into this address that nobody waited for
    d.pool.push_back(it->second);
    it->second = done;
  } else {
    d.pending.emplace(key, done);
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
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.ctx == nullptr || d.closing) return Fail(where + ": the store is closing");
  ScopedContext scope(d.ctx);
  if (!scope.ok()) return Fail(where + ": cannot make device " + std::to_string(ordinal) + " current");
  const uintptr_t key = reinterpret_cast<uintptr_t>(gate_up.untyped_data());
  auto it = d.pending.find(key);
  if (it == d.pending.end())
    return Fail(where + ": its input was not written by dwdp_prefetch on device " + std::to_string(ordinal) +
                " (or was already waited for)");
  DWDP_FFI_CU(Fail, where, cuStreamWaitEvent(stream, it->second, 0));
  d.pool.push_back(it->second);
  d.pending.erase(it);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpPrefetch, PrefetchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // dep
                                  .Attr<int64_t>("store")
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::AnyBuffer>()   // gate_up [E, 2I, H]
                                  .Ret<ffi::AnyBuffer>());  // down [E, H, I]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpWait, WaitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // gate_up
                                  .Arg<ffi::AnyBuffer>()  // down
                                  .Arg<ffi::AnyBuffer>()  // after: the consuming MoE's input
                                  .Attr<int64_t>("store")
                                  .Ret<ffi::AnyBuffer>());  // token (never written)

// ---- the C API (called through ctypes) ---------------------------------------------------------------------

extern "C" {

const char* dwdp_last_error() { return g_last_error.c_str(); }

static int SetError(const std::string& message) {
  g_last_error = message;
  return -1;
}

int dwdp_store_create(int ranks, const int* ordinals, int layers, int weights, const uint64_t* expert_bytes,
                      int slots, int experts, int flags, int64_t* out_id) {
  if (ranks < 1 || layers < 1 || weights < 1 || slots < 1 || experts < 1 || experts > ranks * slots)
    return SetError("dwdp_store_create: bad sizes (ranks " + std::to_string(ranks) + ", layers " +
                    std::to_string(layers) + ", weights " + std::to_string(weights) + ", slots " +
                    std::to_string(slots) + ", experts " + std::to_string(experts) + ")");
  for (int w = 0; w < weights; ++w)
    if (expert_bytes[w] == 0) return SetError("dwdp_store_create: weight " + std::to_string(w) + " has 0 bytes");
  for (int a = 0; a < ranks; ++a)
    for (int b = a + 1; b < ranks; ++b)
      if (ordinals[a] == ordinals[b])
        return SetError("dwdp_store_create: device " + std::to_string(ordinals[a]) + " is given for two ranks");
  try {
    auto s = std::make_shared<Store>();
    s->ranks = ranks;
    s->layers = layers;
    s->weights = weights;
    s->slots = slots;
    s->experts = experts;
    s->timing = (flags & 1) != 0;
    s->poison = (flags & 2) != 0;
    s->delay = (flags & 4) != 0;
    s->expert_bytes.assign(expert_bytes, expert_bytes + weights);
    Status st = Build(*s, ordinals);
    if (!st.ok()) {
      Release(*s);  // nothing acquired so far survives a failed create
      return SetError(st.message);
    }
    std::lock_guard<std::mutex> lock(g_mu);
    s->id = g_next_id++;
    g_stores[s->id] = s;
    *out_id = s->id;
    return 0;
  } catch (const std::bad_alloc&) {
    return SetError("dwdp_store_create: out of host memory");
  } catch (const std::exception& e) {
    return SetError(std::string("dwdp_store_create: ") + e.what());
  }
}

// Copies `bytes` from device pointer `src` (on the rank's device) into rank `rank`'s block of (layer, weight).
int dwdp_store_fill(int64_t id, int layer, int weight, int rank, uint64_t src, uint64_t bytes) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return SetError("dwdp_store_fill: no open expert store " + std::to_string(id));
  if (layer < 0 || layer >= s->layers || weight < 0 || weight >= s->weights || rank < 0 || rank >= s->ranks)
    return SetError("dwdp_store_fill: (layer " + std::to_string(layer) + ", weight " + std::to_string(weight) +
                    ", rank " + std::to_string(rank) + ") is out of range");
  if (bytes != s->block_bytes(weight))
    return SetError("dwdp_store_fill: layer " + std::to_string(layer) + " weight " + std::to_string(weight) +
                    " rank " + std::to_string(rank) + ": got " + std::to_string(bytes) + " bytes, expected " +
                    std::to_string(s->block_bytes(weight)));
  Device& d = *s->devices[rank];
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.ctx == nullptr || d.closing) return SetError("dwdp_store_fill: the store is closing");
  ScopedContext scope(d.ctx);
  if (!scope.ok()) return SetError("dwdp_store_fill: cannot make device " + std::to_string(d.ordinal) + " current");
  const std::string where = "dwdp_store_fill";
  Region& reg = s->region(layer, weight);
  CUresult r = cuMemcpyDtoDAsync(reg.va + rank * reg.stride, static_cast<CUdeviceptr>(src), bytes, d.copy);
  if (r != CUDA_SUCCESS) return SetError(Describe(where, "cuMemcpyDtoDAsync", r));
  r = cuStreamSynchronize(d.copy);
  if (r != CUDA_SUCCESS) return SetError(Describe(where, "cuStreamSynchronize", r));
  return 0;
}

int dwdp_store_close(int64_t id) {
  std::shared_ptr<Store> s;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_stores.find(id);
    if (it == g_stores.end()) return 0;  // closing twice is fine
    s = it->second;
    g_stores.erase(it);
  }
  std::string err = Release(*s);
  return err.empty() ? 0 : SetError(err);
}

// Copy time (ms) of the last prefetch of `layer` on rank `rank`'s device; -1 when none was timed.
int dwdp_store_copy_ms(int64_t id, int rank, int layer, float* ms) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return SetError("dwdp_store_copy_ms: no open expert store " + std::to_string(id));
  if (rank < 0 || rank >= s->ranks || layer < 0 || layer >= s->layers)
    return SetError("dwdp_store_copy_ms: rank or layer out of range");
  *ms = -1.0f;
  if (!s->timing) return 0;
  Device& d = *s->devices[rank];
  std::lock_guard<std::mutex> lock(d.mu);
  if (!d.timed[layer]) return 0;
  ScopedContext scope(d.ctx);
  CUresult r = cuEventSynchronize(d.timing_stop[layer]);
  if (r != CUDA_SUCCESS) return SetError(Describe("dwdp_store_copy_ms", "cuEventSynchronize", r));
  r = cuEventElapsedTime(ms, d.timing_start[layer], d.timing_stop[layer]);
  if (r != CUDA_SUCCESS) return SetError(Describe("dwdp_store_copy_ms", "cuEventElapsedTime", r));
  return 0;
}

// Waits for every copy the store has enqueued and forgets prefetches nobody waited for (an error path dropped
// them): after this, no copy writes into memory XLA may have freed.
int dwdp_store_sync(int64_t id) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return 0;
  std::string first;
  for (auto& dp : s->devices) {
    Device& d = *dp;
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.ctx == nullptr || d.closing) continue;
    ScopedContext scope(d.ctx);
    CUresult r = cuStreamSynchronize(d.copy);
    if (r != CUDA_SUCCESS && first.empty()) first = Describe("dwdp_store_sync", "cuStreamSynchronize", r);
    for (auto& kv : d.pending) d.pool.push_back(kv.second);
    d.pending.clear();
  }
  return first.empty() ? 0 : SetError(first);
}

// Makes the next dwdp_prefetch on this store fail as if a CUDA call had returned `code` (tests only).
int dwdp_store_inject_error(int64_t id, int code) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return SetError("dwdp_store_inject_error: no open expert store " + std::to_string(id));
  s->inject.store(code);
  return 0;
}

// Store facts: handle type (0 POSIX fd, 1 fabric) and allocation granularity.
int dwdp_store_info(int64_t id, int* fabric, uint64_t* granularity) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return SetError("dwdp_store_info: no open expert store " + std::to_string(id));
  *fabric = s->handle_type == CU_MEM_HANDLE_TYPE_FABRIC ? 1 : 0;
  *granularity = s->granularity;
  return 0;
}

// Free and total memory of a device, as the driver sees it (tests: memory comes back after close).
int dwdp_device_memory(int ordinal, uint64_t* free_bytes, uint64_t* total_bytes) {
  CUdevice dev;
  CUcontext ctx;
  CUresult r = cuInit(0);
  if (r == CUDA_SUCCESS) r = cuDeviceGet(&dev, ordinal);
  if (r != CUDA_SUCCESS) return SetError(Describe("dwdp_device_memory", "cuDeviceGet", r));
  r = cuDevicePrimaryCtxRetain(&ctx, dev);
  if (r != CUDA_SUCCESS) return SetError(Describe("dwdp_device_memory", "cuDevicePrimaryCtxRetain", r));
  size_t f = 0, t = 0;
  {
    ScopedContext scope(ctx);
    r = cuMemGetInfo(&f, &t);
  }
  cuDevicePrimaryCtxRelease(dev);
  if (r != CUDA_SUCCESS) return SetError(Describe("dwdp_device_memory", "cuMemGetInfo", r));
  *free_bytes = f;
  *total_bytes = t;
  return 0;
}

// Live CUDA objects across all stores: allocations, mappings, VA ranges, streams, events, open stores.
void dwdp_live_objects(int64_t* out) {
  out[0] = g_live_allocations.load();
  out[1] = g_live_mappings.load();
  out[2] = g_live_ranges.load();
  out[3] = g_live_streams.load();
  out[4] = g_live_events.load();
  std::lock_guard<std::mutex> lock(g_mu);
  out[5] = static_cast<int64_t>(g_stores.size());
}

}  // extern "C"
