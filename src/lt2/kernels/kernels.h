// CUDA kernels of lt2. Plain CUDA C++ (kernels/cuda/*.cu) behind launchers declared here;
// these headers never include libtorch so the kernels build with nvcc alone.
#pragma once

namespace lt2::kernels {
// True when this library was built with nvcc (LT2_CUDA=ON).
bool compiled_with_cuda();
}  // namespace lt2::kernels
