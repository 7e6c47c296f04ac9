// A stand-in libcuda.so.1 for tests/test_store_cuda_bindings.py: the driver functions the expert store calls, with
// the real C signatures, so that cuda.bindings (which loads libcuda.so.1 and resolves every function through
// cuGetProcAddress_v2) marshals the store's Python arguments exactly as it would for the NVIDIA driver. Each function
// checks what it can of its arguments (a context current where one is needed, sizes that are granularity
// multiples, a mapping inside a reserved range, an imported descriptor that is open, nothing released twice) and
// counts live objects; dwdp_stub_live() reads the counts. No GPU memory exists: addresses are numbers.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef uintptr_t Handle;
enum { OK = 0, INVALID_VALUE = 1, INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_PERMITTED = 800, NOT_FOUND = 500 };
#define GRANULARITY (2u << 20)

typedef struct {
  int type;
  int requestedHandleTypes;
  struct { int type; int id; } location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} Prop;
typedef struct { struct { int type; int id; } location; int flags; } AccessDesc;

static long live_contexts, live_streams, live_events, live_handles, live_ranges, live_maps;
static __thread int depth;  // contexts pushed on this thread
static uint64_t next_id = 0x1000, next_va = 0x7f0000000000ull;

void dwdp_stub_live(long* out) {
  out[0] = live_contexts; out[1] = live_streams; out[2] = live_events;
  out[3] = live_handles; out[4] = live_ranges; out[5] = live_maps;
}

CUresult cuDriverGetVersion(int* v) { *v = 13000; return OK; }
CUresult cuInit(unsigned flags) { return flags == 0 ? OK : INVALID_VALUE; }
CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, uint64_t flags, int* status) {
  Dl_info info;
  dladdr((void*)cuInit, &info);
  void* self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  *pfn = dlsym(self, symbol);
  if (status) *status = *pfn ? 0 : 1;
  return *pfn ? OK : NOT_FOUND;
}
CUresult cuGetErrorName(CUresult r, const char** s) {
  *s = r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : r == 400 ? "CUDA_ERROR_INVALID_HANDLE" : "CUDA_ERROR_INVALID_VALUE";
  return OK;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  *d = ordinal;
  return ordinal >= 0 && ordinal < 2 ? OK : INVALID_VALUE;
}
CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice d) { *v = attribute == 102; return OK; }
CUresult cuDeviceCanAccessPeer(int* can, CUdevice a, CUdevice b) { *can = a != b; return OK; }
CUresult cuDevicePrimaryCtxRetain(Handle* ctx, CUdevice d) { *ctx = 0x100 + d; live_contexts++; return OK; }
CUresult cuDevicePrimaryCtxRelease(CUdevice d) { live_contexts--; return OK; }
CUresult cuCtxPushCurrent(Handle ctx) { if (ctx < 0x100) return INVALID_CONTEXT; depth++; return OK; }
CUresult cuCtxPopCurrent(Handle* ctx) { if (!depth) return INVALID_CONTEXT; depth--; *ctx = 0x100; return OK; }
CUresult cuCtxSynchronize(void) { return depth ? OK : INVALID_CONTEXT; }
CUresult cuStreamCreate(Handle* s, unsigned flags) {
  if (!depth || flags != 1) return INVALID_CONTEXT;  // a non-blocking stream, in a current context
  *s = next_id++;
  live_streams++;
  return OK;
}
CUresult cuStreamDestroy(Handle s) { if (!depth || !s) return INVALID_CONTEXT; live_streams--; return OK; }
CUresult cuStreamSynchronize(Handle s) { return s ? OK : INVALID_HANDLE; }
CUresult cuEventCreate(Handle* e, unsigned flags) {
  if (!depth || (flags != 0 && flags != 2)) return INVALID_CONTEXT;
  *e = next_id++;
  live_events++;
  return OK;
}
CUresult cuEventDestroy(Handle e) { if (!depth || !e) return INVALID_CONTEXT; live_events--; return OK; }
CUresult cuEventSynchronize(Handle e) { return e ? OK : INVALID_HANDLE; }
CUresult cuEventElapsedTime(float* ms, Handle a, Handle b) { return INVALID_HANDLE; }  // never recorded here
CUresult cuMemGetAllocationGranularity(size_t* g, const Prop* p, int option) {
  if (p->type != 1 || p->location.type != 1 || option != 1) return INVALID_VALUE;
  if (p->requestedHandleTypes == 8) return NOT_PERMITTED;  // no FABRIC (no IMEX), as on the H200 hosts
  *g = GRANULARITY;
  return OK;
}
CUresult cuMemCreate(Handle* h, size_t size, const Prop* p, uint64_t flags) {
  if (size % GRANULARITY || flags || p->requestedHandleTypes != 1 || p->location.id < 0 || p->location.id > 1)
    return INVALID_VALUE;
  *h = next_id++;
  live_handles++;
  return OK;
}
CUresult cuMemRelease(Handle h) { if (!h) return INVALID_VALUE; live_handles--; return OK; }
CUresult cuMemAddressReserve(uint64_t* va, size_t size, size_t align, uint64_t addr, uint64_t flags) {
  if (size % GRANULARITY || align != GRANULARITY || addr || flags) return INVALID_VALUE;
  *va = next_va;
  next_va += 1ull << 36;
  live_ranges++;
  return OK;
}
CUresult cuMemAddressFree(uint64_t va, size_t size) {
  if (va % GRANULARITY || size % GRANULARITY) return INVALID_VALUE;
  live_ranges--;
  return OK;
}
CUresult cuMemMap(uint64_t va, size_t size, size_t offset, Handle h, uint64_t flags) {
  if (va % GRANULARITY || size % GRANULARITY || offset || !h || flags) return INVALID_VALUE;
  live_maps++;
  return OK;
}
CUresult cuMemUnmap(uint64_t va, size_t size) {
  if (va % GRANULARITY || size % GRANULARITY) return INVALID_VALUE;
  live_maps--;
  return OK;
}
CUresult cuMemSetAccess(uint64_t va, size_t size, const AccessDesc* desc, size_t count) {
  if (va % GRANULARITY || size % GRANULARITY || !count) return INVALID_VALUE;
  for (size_t i = 0; i < count; ++i)
    if (desc[i].location.type != 1 || desc[i].location.id < 0 || desc[i].location.id > 1 || desc[i].flags != 3)
      return INVALID_VALUE;
  return OK;
}
CUresult cuMemExportToShareableHandle(void* out, Handle h, int type, uint64_t flags) {
  if (!h || type != 1 || flags) return INVALID_VALUE;
  *(int*)out = memfd_create("stub-vmm-block", 0);
  return *(int*)out >= 0 ? OK : INVALID_VALUE;
}
CUresult cuMemImportFromShareableHandle(Handle* h, void* os_handle, int type) {
  struct stat st;
  if (type != 1 || fstat((int)(intptr_t)os_handle, &st) != 0) return INVALID_VALUE;  // the fd itself, as a pointer
  *h = next_id++;
  live_handles++;
  return OK;
}
CUresult cuMemcpyDtoDAsync(uint64_t dst, uint64_t src, size_t n, Handle stream) {
  return depth && stream && dst && src ? OK : INVALID_VALUE;
}
CUresult cuMemGetInfo(size_t* free_bytes, size_t* total) {
  if (!depth) return INVALID_CONTEXT;
  *free_bytes = 1ull << 36;
  *total = 1ull << 37;
  return OK;
}
