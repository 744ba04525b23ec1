// CUDA kernels of lt2. Plain CUDA C++ (kernels/cuda/*.cu) behind launchers declared here;
// these headers never include libtorch so the kernels build with nvcc alone.
#pragma once
#include <string>

namespace lt2::kernels {
// True when this library was built with nvcc (LT2_CUDA=ON).
bool compiled_with_cuda();
// Name of CUDA device `index` ("NVIDIA H200"), or "" without CUDA.
std::string device_name(int index);
}  // namespace lt2::kernels
