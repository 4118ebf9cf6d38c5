#include "engine/core/error.h"

#include <cstring>

#include "engine/core/memory.h"

namespace cudp {

std::string Error::format(const std::string& message, const char* file, int line) {
  // Keep the path short and free of the build machine's: from the project's top-level folder on
  // (the first such folder in the path, so tests/data/x.cpp stays whole).
  const char* shown = file;
  for (const char* root : {"/engine/", "/kernels/", "/layers/", "/data/", "/examples/", "/tests/",
                           "/bench/", "/fuzz/"}) {
    const char* p = std::strstr(file, root);
    if (p && (shown == file || p + 1 < shown)) shown = p + 1;
  }
  // The message first: it is what a user reads; the location follows for a bug report.
  return detail::str(message, " (at ", shown, ":", line, ")");
}

namespace detail {

void throw_cuda(cudaError_t code, const char* call, const char* file, int line) {
  std::string text = str(call, " failed: ", cudaGetErrorName(code), " (", cudaGetErrorString(code), ")");
  if (code == cudaErrorMemoryAllocation) {
    // An allocation outside cuda::device_allocate (a kernel's workspace): name at least the device,
    // what the caller said the memory is for, and what to change.
    int device = -1;
    const bool known = cudaGetDevice(&device) == cudaSuccess;
    cudaGetLastError();
    const std::string purpose = cuda::AllocationPurpose::current_what();
    const std::string advice = cuda::AllocationPurpose::current_advice();
    text += str(known ? str(" on cuda:", device) : std::string(),
                purpose.empty() ? std::string() : " for " + purpose, ". ",
                advice.empty() ? "Reduce the batch size (--batch-size) or free tensors." : advice);
    throw OutOfMemoryError(code, text, file, line);
  }
  throw CudaError(code, text, file, line);
}

}  // namespace detail
}  // namespace cudp
