// CUDA kernels of lt2. Plain CUDA C++ (kernels/cuda/*.cu) behind launchers declared here;
// these headers never include libtorch so the kernels build with nvcc alone.
#pragma once
#include <string>

namespace lt2::kernels {
// True when this library was built with nvcc (LT2_CUDA=ON).
bool compiled_with_cuda();
// Name of CUDA device `index` ("NVIDIA H200"), or "" without CUDA.
std::string device_name(int index);
// Free and total memory of the current CUDA device, in bytes; false without CUDA or a device.
bool device_memory(size_t* free_bytes, size_t* total_bytes);
}  // namespace lt2::kernels
