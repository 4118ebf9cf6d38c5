// CPU twins of kernels/scalars.h.
#include <cstring>

#include "engine/core/error.h"
#include "kernels/scalars.h"

namespace cudp::kernels {

void write_bytes_cpu(void* dst, const void* src, size_t bytes) {
  CUDP_CHECK(bytes == 0 || (dst != nullptr && src != nullptr), "write_bytes: a pointer is null");
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

void add_i64_cpu(int64_t* counter, int64_t value) {
  CUDP_CHECK(counter != nullptr, "add_i64: the counter pointer is null");
  *counter += value;
}

}  // namespace cudp::kernels
