// Device queries through the CUDA runtime (no libtorch).
#include <cuda_runtime.h>

#include "lt2/kernels/kernels.h"

namespace lt2::kernels {

std::string device_name(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return "";
  return prop.name;
}

bool device_memory(size_t* free_bytes, size_t* total_bytes) {
  return cudaMemGetInfo(free_bytes, total_bytes) == cudaSuccess;
}

}  // namespace lt2::kernels
