// The expert store itself: CUDA VMM allocations and their composite virtual addresses, the copy streams and
// events, their release, and the registry of open stores (see store.h).

#include <unistd.h>

#include <algorithm>
#include <map>

#include "store.h"

namespace dwdp {

LiveCounts g_live;

namespace {

std::mutex g_mu;
std::map<int64_t, std::shared_ptr<Store>> g_stores;
int64_t g_next_id = 1;

std::string ErrorName(CUresult r) {
  const char* name = nullptr;
  if (cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) return "CUDA_ERROR_UNKNOWN";
  return name;
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

}  // namespace

// One device of the store: its primary context, copy stream and events.
static Status AddDevice(Store& s, int ordinal, const std::string& where) {
  auto d = std::make_unique<Device>();
  d->ordinal = ordinal;
  DWDP_CU(where, cuDeviceGet(&d->dev, ordinal));
  int vmm = 0;
  DWDP_CU(where, cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d->dev));
  if (!vmm) return Status{where + ": device " + std::to_string(ordinal) + " does not support CUDA VMM"};
  DWDP_CU(where, cuDevicePrimaryCtxRetain(&d->ctx, d->dev));
  s.devices.push_back(std::move(d));
  Device& dev = *s.devices.back();
  ScopedContext scope(dev.ctx);
  if (!scope.ok()) return Status{where + ": cannot make device " + std::to_string(dev.ordinal) + " current"};
  DWDP_CU(where, cuStreamCreate(&dev.copy, CU_STREAM_NON_BLOCKING));
  g_live.streams++;
  DWDP_CU(where, cuEventCreate(&dev.ready, CU_EVENT_DISABLE_TIMING));
  g_live.events++;
  if (s.hooks.time_copies) {
    dev.timing_start.assign(s.layers, nullptr);
    dev.timing_stop.assign(s.layers, nullptr);
    dev.timed.assign(s.layers, 0);
    for (int l = 0; l < s.layers; ++l) {
      DWDP_CU(where, cuEventCreate(&dev.timing_start[l], CU_EVENT_DEFAULT));
      g_live.events++;
      DWDP_CU(where, cuEventCreate(&dev.timing_stop[l], CU_EVENT_DEFAULT));
      g_live.events++;
    }
  }
  return {};
}

// Allocates rank r's block of `reg` on `ordinal` and maps it at its offset.
static Status CreateBlock(Store& s, Region& reg, const CUmemAllocationProp& prop, int r, int layer,
                          const std::string& where) {
  CUresult res = cuMemCreate(&reg.handles[r], reg.stride, &prop, 0);
  if (res != CUDA_SUCCESS) {
    reg.handles[r] = 0;
    std::string msg = Describe(where, "cuMemCreate", res) + " allocating " + std::to_string(reg.stride) +
                      " bytes on device " + std::to_string(prop.location.id) + " for layer " + std::to_string(layer);
    if (res == CUDA_ERROR_OUT_OF_MEMORY)
      msg += " (XLA preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of GPU memory; leave room for the store, "
             "e.g. XLA_PYTHON_CLIENT_PREALLOCATE=false)";
    return Status{msg};
  }
  g_live.allocations++;
  DWDP_CU(where, cuMemMap(reg.va + r * reg.stride, reg.stride, 0, reg.handles[r], 0));
  reg.mapped[r] = 1;
  g_live.mappings++;
  return {};
}

std::string Describe(const std::string& where, const char* call, CUresult r) {
  return where + ": " + call + " failed with " + ErrorName(r) + " (" + std::to_string(static_cast<int>(r)) + ")";
}

int64_t Register(std::shared_ptr<Store> s) {
  std::lock_guard<std::mutex> lock(g_mu);
  s->id = g_next_id++;
  g_stores[s->id] = s;
  return s->id;
}

std::shared_ptr<Store> Find(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_stores.find(id);
  return it == g_stores.end() ? nullptr : it->second;
}

std::shared_ptr<Store> Remove(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_stores.find(id);
  if (it == g_stores.end()) return nullptr;
  std::shared_ptr<Store> s = it->second;
  g_stores.erase(it);
  return s;
}

int64_t OpenStores() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int64_t>(g_stores.size());
}

void DestroyEvent(CUevent& e) {
  if (e != nullptr && cuEventDestroy(e) == CUDA_SUCCESS) g_live.events--;
  e = nullptr;
}

Status Release(Store& s) {
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
      if (res == CUDA_SUCCESS) g_live.mappings--;
      reg.mapped[r] = 0;
    }
    for (auto& h : reg.handles) {
      if (h == 0) continue;
      CUresult res = cuMemRelease(h);
      note("dwdp_store_close", "cuMemRelease", res);
      if (res == CUDA_SUCCESS) g_live.allocations--;
      h = 0;
    }
    if (reg.va != 0) {
      CUresult res = cuMemAddressFree(reg.va, reg.reserved);
      note("dwdp_store_close", "cuMemAddressFree", res);
      if (res == CUDA_SUCCESS) g_live.ranges--;
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
        if (res == CUDA_SUCCESS) g_live.streams--;
        d->copy = nullptr;
      }
    }
    note("dwdp_store_close", "cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease(d->dev));
    std::lock_guard<std::mutex> lock(d->mu);
    d->ctx = nullptr;
  }
  return Status{first};
}

Status Build(Store& s, const int* ordinals) {
  const std::string where = "dwdp_store_create";
  DWDP_CU(where, cuInit(0));
  for (int r = 0; r < s.ranks; ++r) {
    Status st = AddDevice(s, ordinals[r], where);
    if (!st.ok()) return st;
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
      g_live.ranges++;
      for (int r = 0; r < s.ranks; ++r) {
        prop.location.id = ordinals[r];
        Status st = CreateBlock(s, reg, prop, r, l, where);
        if (!st.ok()) return st;
      }
      DWDP_CU(where, cuMemSetAccess(reg.va, reg.reserved, access.data(), access.size()));
    }
  }
  return {};
}

Status BuildLocal(Store& s, int ordinal) {
  const std::string where = "dwdp_store_create_local";
  DWDP_CU(where, cuInit(0));
  Status st = AddDevice(s, ordinal, where);
  if (!st.ok()) return st;
  ScopedContext scope(s.devices[0]->ctx);
  if (!scope.ok()) return Status{where + ": cannot make device " + std::to_string(ordinal) + " current"};
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;  // exported as descriptors
  s.handle_type = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  // Every process must compute the same strides: the granularity of the allocation kind, not of the device.
  DWDP_CU(where, cuMemGetAllocationGranularity(&s.granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const int r = s.local_rank;
  s.regions.resize(static_cast<size_t>(s.layers) * s.weights);
  for (int l = 0; l < s.layers; ++l) {
    for (int w = 0; w < s.weights; ++w) {
      Region& reg = s.region(l, w);
      reg.stride = (s.block_bytes(w) + s.granularity - 1) / s.granularity * s.granularity;
      reg.reserved = reg.stride * s.ranks;
      reg.handles.assign(s.ranks, 0);
      reg.mapped.assign(s.ranks, 0);
      DWDP_CU(where, cuMemAddressReserve(&reg.va, reg.reserved, s.granularity, 0, 0));
      g_live.ranges++;
      st = CreateBlock(s, reg, prop, r, l, where);
      if (!st.ok()) return st;
      DWDP_CU(where, cuMemSetAccess(reg.va + r * reg.stride, reg.stride, &access, 1));
    }
  }
  return {};
}

Status ExportBlocks(Store& s, int* fds, int n) {
  const std::string where = "dwdp_store_export";
  if (s.local_rank < 0) return Status{where + ": the store was not created with dwdp_store_create_local"};
  if (n != static_cast<int>(s.regions.size()))
    return Status{where + ": room for " + std::to_string(n) + " descriptors, the store has " +
                  std::to_string(s.regions.size()) + " blocks (layers x weights)"};
  DeviceScope scope(*s.devices[0], where);
  if (!scope.ok()) return Status{scope.error()};
  for (int i = 0; i < n; ++i) fds[i] = -1;
  for (int i = 0; i < n; ++i) {
    int fd = -1;
    CUresult res = cuMemExportToShareableHandle(&fd, s.regions[i].handles[s.local_rank],
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (res != CUDA_SUCCESS) {
      for (int j = 0; j < i; ++j) close(fds[j]), fds[j] = -1;
      return Status{Describe(where, "cuMemExportToShareableHandle", res) + " (block " + std::to_string(i) + ")"};
    }
    fds[i] = fd;
  }
  return {};
}

Status ImportPeer(Store& s, int peer, const int* fds, int n) {
  const std::string where = "dwdp_store_import(rank " + std::to_string(peer) + ")";
  if (s.local_rank < 0) return Status{where + ": the store was not created with dwdp_store_create_local"};
  if (peer < 0 || peer >= s.ranks || peer == s.local_rank)
    return Status{where + ": not a peer rank of this store (ranks " + std::to_string(s.ranks) + ", this one " +
                  std::to_string(s.local_rank) + ")"};
  if (n != static_cast<int>(s.regions.size()))
    return Status{where + ": " + std::to_string(n) + " descriptors, the store has " +
                  std::to_string(s.regions.size()) + " blocks (layers x weights)"};
  Device& d = *s.devices[0];
  DeviceScope scope(d, where);
  if (!scope.ok()) return Status{scope.error()};
  if (s.rank_mapped(peer)) return Status{where + ": already imported"};  // (under d.mu, as the prefetch's check)
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = d.ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  // On a failure part-way, this peer's blocks imported so far are unmapped and released again: the store is as
  // before the call (a retry starts clean).
  auto undo = [&](int upto) {
    for (int j = 0; j <= upto && j < n; ++j) {
      Region& reg = s.regions[j];
      if (reg.mapped[peer] && cuMemUnmap(reg.va + peer * reg.stride, reg.stride) == CUDA_SUCCESS) g_live.mappings--;
      reg.mapped[peer] = 0;
      if (reg.handles[peer] != 0 && cuMemRelease(reg.handles[peer]) == CUDA_SUCCESS) g_live.allocations--;
      reg.handles[peer] = 0;
    }
  };
  for (int i = 0; i < n; ++i) {
    Region& reg = s.regions[i];
    CUmemGenericAllocationHandle h = 0;
    CUresult res = cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fds[i])),
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (res != CUDA_SUCCESS) {
      undo(i);
      return Status{Describe(where, "cuMemImportFromShareableHandle", res) + " (block " + std::to_string(i) + ")"};
    }
    reg.handles[peer] = h;
    g_live.allocations++;
    res = cuMemMap(reg.va + peer * reg.stride, reg.stride, 0, h, 0);
    if (res != CUDA_SUCCESS) {  // e.g. a peer of another configuration: its block is smaller than this stride
      undo(i);
      return Status{Describe(where, "cuMemMap", res) + " mapping block " + std::to_string(i) + " (" +
                    std::to_string(reg.stride) + " bytes): do all ranks use the same layers, weights and slots?"};
    }
    reg.mapped[peer] = 1;
    g_live.mappings++;
    res = cuMemSetAccess(reg.va + peer * reg.stride, reg.stride, &access, 1);
    if (res != CUDA_SUCCESS) {
      undo(i);
      return Status{Describe(where, "cuMemSetAccess", res) + " on block " + std::to_string(i) +
                    " (can device " + std::to_string(d.ordinal) + " reach the peer's GPU? DWDP needs NVLink or "
                    "PCIe P2P)"};
    }
  }
  return {};
}

}  // namespace dwdp
