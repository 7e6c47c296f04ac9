// jax_dwdp's DWDP expert store: the state shared by its three parts.
//   vmm.cc       the store itself: CUDA VMM allocations, the composite virtual addresses, streams and events
//                (Build / Release), the registry of open stores, live-object counters
//   handlers.cc  the two XLA FFI custom calls, dwdp_prefetch and dwdp_wait
//   c_api.cc     the C functions Python calls through ctypes (create, fill, close, sync, facts, test hooks)
//
// Design notes (see ffi/README.md for the whole picture):
// - One process drives every device of the store (PJRT's single-process multi-GPU client), or (BuildLocal) one
//   process per device: the store then holds one device, allocates only its own rank's blocks, exports them as
//   POSIX file descriptors (ExportBlocks) and maps the peers' blocks from theirs (ImportPeer); the descriptors
//   travel between the processes in Python (jax_dwdp/parallel/fd_exchange.py).
// - Rank r's block of each (layer, weight) is one cuMemCreate allocation on device r (POSIX fd handle, or
//   FABRIC when a probe allocation succeeds), mapped at offset r * stride of the (layer, weight)'s reserved VA.
//   cuMemSetAccess grants every store device read access to the whole range, so a peer block is an address.
// - Every failure is a Status naming the call and the CUresult; the handlers turn it into an ffi::Error, the C
//   API into -1 with the message in dwdp_last_error().
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace dwdp {

// The one error type: empty message = success.
struct Status {
  std::string message;
  bool ok() const { return message.empty(); }
};

std::string Describe(const std::string& where, const char* call, CUresult r);

// In a function returning Status: on a CUDA failure, return a Status naming the call and the CUresult.
#define DWDP_CU(where, call)                                               \
  do {                                                                     \
    CUresult _r = (call);                                                  \
    if (_r != CUDA_SUCCESS) return ::dwdp::Status{::dwdp::Describe(where, #call, _r)}; \
  } while (0)

// Objects alive across all stores; tests check they return to zero after close.
struct LiveCounts {
  std::atomic<int64_t> allocations{0}, mappings{0}, ranges{0}, streams{0}, events{0};
};
extern LiveCounts g_live;

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

// Switches for tests and benchmarks, set once at creation (flag bits of dwdp_store_create), plus the injected
// error of dwdp_store_inject_error. None of them is on in normal use.
struct TestHooks {
  static constexpr int kTimeCopies = 1;          // record each layer's copy time (dwdp_store_copy_ms)
  static constexpr int kPoisonDestinations = 2;  // fill each prefetch destination with 0xFF (NaN) before the copy
  static constexpr int kDelayCopies = 4;         // hold the copy stream 20 ms before each prefetch's copies, so a
                                                 // read that does not wait for the copy sees the poison
  bool time_copies = false, poison = false, delay_copies = false;
  std::atomic<int> inject{0};  // a CUresult the next prefetch reports as a failure
};

struct Device {
  int ordinal = -1;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;  // the primary context (the one XLA uses), retained
  CUstream copy = nullptr;  // the copy stream
  CUevent ready = nullptr;  // recorded on XLA's stream by each prefetch
  bool closing = false;     // set (under mu) by close before anything is released; handlers then refuse
  std::mutex mu;
  std::vector<CUevent> pool;                       // idle "done" events
  std::unordered_map<uintptr_t, CUevent> pending;  // prefetch destination -> done event
  std::vector<CUevent> timing_start, timing_stop;  // per layer, with TestHooks::time_copies
  std::vector<char> timed;                         // layer has a recorded pair
};

// One store operation on device d: d.mu held and d's context current for the scope's life. ok() is false, with
// error() saying why, when the store is closing or the context cannot be made current.
class DeviceScope {
 public:
  DeviceScope(Device& d, const std::string& where) : lock_(d.mu) {
    if (d.ctx == nullptr || d.closing) {
      error_ = where + ": the store is closing";
      return;
    }
    scope_.emplace(d.ctx);
    if (!scope_->ok()) error_ = where + ": cannot make device " + std::to_string(d.ordinal) + " current";
  }
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  std::lock_guard<std::mutex> lock_;  // released last: members are destroyed in reverse order
  std::optional<ScopedContext> scope_;
  std::string error_;
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
  int local_rank = -1;        // one process per device: this process's rank, its device devices[0]; else -1
  TestHooks hooks;
  size_t granularity = 0;
  CUmemAllocationHandleType handle_type = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  std::vector<size_t> expert_bytes;              // per weight
  std::vector<std::unique_ptr<Device>> devices;  // per rank
  std::vector<Region> regions;                   // layer * weights + weight

  size_t block_bytes(int w) const { return static_cast<size_t>(slots) * expert_bytes[w]; }
  Region& region(int layer, int w) { return regions[static_cast<size_t>(layer) * weights + w]; }
  // Whether rank r's blocks are mapped here (allocated here, or imported from its process): every region's.
  bool rank_mapped(int r) const {
    for (const Region& reg : regions)
      if (!reg.mapped[r]) return false;
    return true;
  }
  int rank_of(int ordinal) const {
    if (local_rank >= 0) return !devices.empty() && devices[0]->ordinal == ordinal ? local_rank : -1;
    for (int r = 0; r < ranks && r < static_cast<int>(devices.size()); ++r)
      if (devices[r]->ordinal == ordinal) return r;
    return -1;
  }
  // The device that holds rank r's blocks in this process; nullptr for a peer process's rank.
  Device* device_of_rank(int r) {
    if (local_rank >= 0) return r == local_rank && !devices.empty() ? devices[0].get() : nullptr;
    return r >= 0 && r < static_cast<int>(devices.size()) ? devices[r].get() : nullptr;
  }
};

// Acquires every device context, stream, event, allocation and mapping of `s` (sizes already set).
Status Build(Store& s, const int* ordinals);
// One process per device (s.local_rank set): this device's context, stream and events, the reserved ranges, and
// this rank's blocks (POSIX fd handles), mapped and readable by this device. The peers' ranges stay unmapped
// until ImportPeer.
Status BuildLocal(Store& s, int ordinal);
// This rank's block of every (layer, weight), in region order (layer * weights + weight), as new POSIX file
// descriptors the caller owns (n == layers * weights). On failure none is left open.
Status ExportBlocks(Store& s, int* fds, int n);
// Maps rank `peer`'s blocks from its exported descriptors (ExportBlocks' order) into this device's ranges. The
// descriptors stay the caller's (the imported handles hold their own reference).
Status ImportPeer(Store& s, int peer, const int* fds, int n);
// Releases everything a store holds, after waiting for its devices; keeps releasing after a failure and returns
// the first one.
Status Release(Store& s);
void DestroyEvent(CUevent& e);

// The registry of open stores, keyed by id.
int64_t Register(std::shared_ptr<Store> s);
std::shared_ptr<Store> Find(int64_t id);
std::shared_ptr<Store> Remove(int64_t id);  // nullptr when not open
int64_t OpenStores();

}  // namespace dwdp
