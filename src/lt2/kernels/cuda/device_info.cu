// Device queries through the CUDA runtime (no libtorch).
#include <cuda_runtime.h>

#include "lt2/kernels/kernels.h"

namespace lt2::kernels {

std::string device_name(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return "";
  return prop.name;
}

}  // namespace lt2::kernels
