// The C API of the DWDP expert store, called from Python through ctypes (jax_dwdp/parallel/dwdp_ffi.py). Every
// function returns 0, or -1 with the message in dwdp_last_error() (per thread).

#include <new>

#include "store.h"

using namespace dwdp;

namespace {

thread_local std::string g_last_error;

int SetError(const std::string& message) {
  g_last_error = message;
  return -1;
}

// A store's sizes and test switches, before Build / BuildLocal acquires anything.
std::shared_ptr<Store> NewStore(int ranks, int layers, int weights, const uint64_t* expert_bytes, int slots,
                                int experts, int flags) {
  auto s = std::make_shared<Store>();
  s->ranks = ranks;
  s->layers = layers;
  s->weights = weights;
  s->slots = slots;
  s->experts = experts;
  s->hooks.time_copies = (flags & TestHooks::kTimeCopies) != 0;
  s->hooks.poison = (flags & TestHooks::kPoisonDestinations) != 0;
  s->hooks.delay_copies = (flags & TestHooks::kDelayCopies) != 0;
  s->expert_bytes.assign(expert_bytes, expert_bytes + weights);
  return s;
}

}  // namespace

extern "C" {

const char* dwdp_last_error() { return g_last_error.c_str(); }

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
    auto s = NewStore(ranks, layers, weights, expert_bytes, slots, experts, flags);
    Status st = Build(*s, ordinals);
    if (!st.ok()) {
      Release(*s);  // nothing acquired so far survives a failed create
      return SetError(st.message);
    }
    *out_id = Register(s);
    return 0;
  } catch (const std::bad_alloc&) {
    return SetError("dwdp_store_create: out of host memory");
  } catch (const std::exception& e) {
    return SetError(std::string("dwdp_store_create: ") + e.what());
  }
}

// One process per device: rank `rank` of `ranks`, on device `ordinal`; this rank's blocks only (see BuildLocal).
int dwdp_store_create_local(int ranks, int rank, int ordinal, int layers, int weights, const uint64_t* expert_bytes,
                            int slots, int experts, int flags, int64_t* out_id) {
  if (ranks < 1 || rank < 0 || rank >= ranks || layers < 1 || weights < 1 || slots < 1 || experts < 1 ||
      experts > ranks * slots)
    return SetError("dwdp_store_create_local: bad sizes (ranks " + std::to_string(ranks) + ", rank " +
                    std::to_string(rank) + ", layers " + std::to_string(layers) + ", weights " +
                    std::to_string(weights) + ", slots " + std::to_string(slots) + ", experts " +
                    std::to_string(experts) + ")");
  for (int w = 0; w < weights; ++w)
    if (expert_bytes[w] == 0) return SetError("dwdp_store_create_local: weight " + std::to_string(w) + " has 0 bytes");
  try {
    auto s = NewStore(ranks, layers, weights, expert_bytes, slots, experts, flags);
    s->local_rank = rank;
    Status st = BuildLocal(*s, ordinal);
    if (!st.ok()) {
      Release(*s);
      return SetError(st.message);
    }
    *out_id = Register(s);
    return 0;
  } catch (const std::bad_alloc&) {
    return SetError("dwdp_store_create_local: out of host memory");
  } catch (const std::exception& e) {
    return SetError(std::string("dwdp_store_create_local: ") + e.what());
  }
}

// This rank's blocks as n = layers * weights new POSIX descriptors (region order), the caller's to close.
int dwdp_store_export(int64_t id, int* fds, int n) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return SetError("dwdp_store_export: no open expert store " + std::to_string(id));
  Status st = ExportBlocks(*s, fds, n);
  return st.ok() ? 0 : SetError(st.message);
}

// Maps rank `peer`'s blocks from the descriptors it exported (which stay the caller's).
int dwdp_store_import(int64_t id, int peer, const int* fds, int n) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return SetError("dwdp_store_import: no open expert store " + std::to_string(id));
  Status st = ImportPeer(*s, peer, fds, n);
  return st.ok() ? 0 : SetError(st.message);
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
  Device* dp = s->device_of_rank(rank);
  if (dp == nullptr)
    return SetError("dwdp_store_fill: rank " + std::to_string(rank) + "'s blocks belong to another process");
  Device& d = *dp;
  const std::string where = "dwdp_store_fill";
  DeviceScope scope(d, where);
  if (!scope.ok()) return SetError(scope.error());
  Region& reg = s->region(layer, weight);
  CUresult r = cuMemcpyDtoDAsync(reg.va + rank * reg.stride, static_cast<CUdeviceptr>(src), bytes, d.copy);
  if (r != CUDA_SUCCESS) return SetError(Describe(where, "cuMemcpyDtoDAsync", r));
  r = cuStreamSynchronize(d.copy);
  if (r != CUDA_SUCCESS) return SetError(Describe(where, "cuStreamSynchronize", r));
  return 0;
}

int dwdp_store_close(int64_t id) {
  std::shared_ptr<Store> s = Remove(id);
  if (!s) return 0;  // closing twice is fine
  Status st = Release(*s);
  return st.ok() ? 0 : SetError(st.message);
}

// Copy time (ms) of the last prefetch of `layer` on rank `rank`'s device; -1 when none was timed.
int dwdp_store_copy_ms(int64_t id, int rank, int layer, float* ms) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return SetError("dwdp_store_copy_ms: no open expert store " + std::to_string(id));
  if (rank < 0 || rank >= s->ranks || layer < 0 || layer >= s->layers)
    return SetError("dwdp_store_copy_ms: rank or layer out of range");
  *ms = -1.0f;
  Device* dp = s->device_of_rank(rank);
  if (!s->hooks.time_copies || dp == nullptr) return 0;
  Device& d = *dp;
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

// Store facts: handle type (0 POSIX fd, 1 fabric) and allocation granularity.
int dwdp_store_info(int64_t id, int* fabric, uint64_t* granularity) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return SetError("dwdp_store_info: no open expert store " + std::to_string(id));
  *fabric = s->handle_type == CU_MEM_HANDLE_TYPE_FABRIC ? 1 : 0;
  *granularity = s->granularity;
  return 0;
}

// ---- test hooks -------------------------------------------------------------------------------------------

// Makes the next dwdp_prefetch on this store fail as if a CUDA call had returned `code` (tests only).
int dwdp_store_inject_error(int64_t id, int code) {
  std::shared_ptr<Store> s = Find(id);
  if (!s) return SetError("dwdp_store_inject_error: no open expert store " + std::to_string(id));
  s->hooks.inject.store(code);
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
  out[0] = g_live.allocations.load();
  out[1] = g_live.mappings.load();
  out[2] = g_live.ranges.load();
  out[3] = g_live.streams.load();
  out[4] = g_live.events.load();
  out[5] = OpenStores();
}

}  // extern "C"
