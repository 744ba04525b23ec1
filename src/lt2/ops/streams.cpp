#include "lt2/ops/streams.h"

#include <array>
#include <mutex>

#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace lt2::ops {

#ifdef LT2_WITH_CUDA
namespace {

// Checks a CUDA runtime call of run_beside.
void check_cuda(cudaError_t err, const char* what) {
  LT2_CHECK(err == cudaSuccess, "run_beside: ", what, " failed: ", cudaGetErrorString(err));
}

// A device's second stream, with the events that fork to it (`start`) and join from it (`done`).
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, done = nullptr;
};

// The side stream of `device` (its CUDA guard is in force), made on the first call and kept for the
// process's life. Non-blocking: it never waits for the legacy default stream, only for the events.
const SideStream& side_stream(int device) {
  constexpr int kMaxDevices = 64;
  static std::array<SideStream, kMaxDevices> streams;
  static std::mutex mutex;
  LT2_CHECK(device >= 0 && device < kMaxDevices, "run_beside: CUDA device ", device, " (at most ", kMaxDevices,
            " devices)");
  std::lock_guard<std::mutex> lock(mutex);
  SideStream& s = streams[device];
  if (!s.stream) {
    check_cuda(cudaEventCreateWithFlags(&s.start, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  return s;
}

}  // namespace
#endif

void run_beside(torch::Device device, const std::function<void()>& side, const std::function<void()>& main,
                bool fork) {
#ifdef LT2_WITH_CUDA
  if (fork && device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    const int index = c10::cuda::current_device();
    const SideStream& s = side_stream(index);
    const cudaStream_t current = c10::cuda::getCurrentCUDAStream(index).stream();
    check_cuda(cudaEventRecord(s.start, current), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(s.stream, s.start, 0), "cudaStreamWaitEvent");
    {
      c10::cuda::CUDAStreamGuard on_side(c10::cuda::getStreamFromExternal(s.stream, index));
      side();
    }
    main();
    check_cuda(cudaEventRecord(s.done, s.stream), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(current, s.done, 0), "cudaStreamWaitEvent");
    return;
  }
#endif
  side();
  main();
}

}  // namespace lt2::ops
