// Host-side queries about the CUDA kernels compiled into this build.
#include "lt2/kernels/kernels.h"

namespace lt2::kernels {

bool compiled_with_cuda() {
#ifdef LT2_WITH_CUDA
  return true;
#else
  return false;
#endif
}

#ifndef LT2_WITH_CUDA
std::string device_name(int) { return ""; }
bool device_memory(size_t*, size_t*) { return false; }
#endif

}  // namespace lt2::kernels
