// libjax_dwdp_ffi_testing.so: a prefetch with fault injection, for the GPU tests only (tests/store_testing.py loads
// it; jax_dwdp never does). It is dwdp_prefetch (handlers.cc, compiled into this library too) behind three more
// attributes:
//   poison    1: fill every destination with 0xFF bytes (NaN) on the copy stream, after XLA's earlier work and
//             before the copies, so a byte the copies miss stays NaN
//   delay_ms  hold the copy stream that long before the copies (a host function on the stream), so that a read of
//             the experts that does not wait for their copy sees the poison
//   inject    the address of one int64 the test owns: when non-zero, the next prefetch takes it (resetting it to 0)
//             and fails as if cuMemcpyDtoDAsync had returned that CUresult
// The poison and the delay are enqueued under the same row lock as the production handler's copies; they use the
// row's ready event to follow XLA's stream, which the production handler then records again.

#include <chrono>
#include <thread>

#include "handlers.h"

namespace dwdp {
namespace {

void CUDA_CB Sleep(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms)));
}

ffi::Error TestingPrefetch(CUstream stream, int32_t ordinal, ffi::AnyBuffer dep, int64_t store, int64_t layer,
                           int64_t table, Ints ordinals, Ints ranks, Ints contexts, Ints streams, Ints ready,
                           Ints done, Ints timing, Ints sources, Ints block_bytes,
                           ffi::Result<ffi::AnyBuffer> gate_up, ffi::Result<ffi::AnyBuffer> down, int64_t poison,
                           int64_t delay_ms, int64_t inject) {
  const std::string where = "dwdp_prefetch(store " + std::to_string(store) + ", layer " + std::to_string(layer) + ")";
  if (inject != 0) {
    int64_t code = __atomic_exchange_n(reinterpret_cast<int64_t*>(static_cast<uintptr_t>(inject)), int64_t{0},
                                       __ATOMIC_SEQ_CST);
    if (code != 0)
      return ffi::Error::Internal(Describe(where, "cuMemcpyDtoDAsync (injected)", static_cast<CUresult>(code)));
  }
  if (poison != 0 || delay_ms > 0) {
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
      for (ffi::AnyBuffer* out : {&(*gate_up), &(*down)}) {
        r = cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(out->untyped_data()), 0xFF, out->size_bytes(), copy);
        if (r != CUDA_SUCCESS) {
          cuStreamSynchronize(copy);
          return ffi::Error::Internal(Describe(where, "cuMemsetD8Async (testing)", r));
        }
      }
  }
  return Prefetch(stream, ordinal, dep, store, layer, table, ordinals, ranks, contexts, streams, ready, done, timing,
                  sources, block_bytes, gate_up, down);
}

}  // namespace
}  // namespace dwdp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDwdpStoreTestingPrefetch, dwdp::TestingPrefetch,
                              dwdp::PrefetchBinding()
                                  .Attr<int64_t>("poison")
                                  .Attr<int64_t>("delay_ms")
                                  .Attr<int64_t>("inject"));
