#include "engine/core/error.h"

#include <cstring>

namespace cudp {

std::string Error::format(const std::string& message, const char* file, int line) {
  // Keep the path short: from the project's top-level folder on.
  const char* shown = file;
  for (const char* root : {"engine/", "kernels/", "layers/", "examples/", "tests/", "bench/"}) {
    if (const char* p = std::strstr(file, root)) {
      shown = p;
      break;
    }
  }
  return detail::str(shown, ":", line, ": ", message);
}

namespace detail {

void throw_cuda(cudaError_t code, const char* call, const char* file, int line) {
  std::string text = str(call, " failed: ", cudaGetErrorName(code), " (", cudaGetErrorString(code), ")");
  if (code == cudaErrorMemoryAllocation) throw OutOfMemoryError(code, text, file, line);
  throw CudaError(code, text, file, line);
}

}  // namespace detail
}  // namespace cudp
