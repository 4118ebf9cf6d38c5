// Kernels of kernels/scalars.h: one block copies a chunk of bytes that arrived as a kernel
// argument; one thread adds to a counter.
#include <cstring>

#include "engine/core/launch.cuh"
#include "kernels/scalars.h"

namespace cudp::kernels {
namespace {

struct Chunk {
  unsigned char bytes[kWriteChunk];
};

__global__ void write_bytes_kernel(unsigned char* __restrict__ dst, Chunk chunk, unsigned n) {
  kernel_entry();
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) dst[i] = chunk.bytes[i];
}

__global__ void add_i64_kernel(int64_t* counter, int64_t value) {
  kernel_entry();
  *counter += value;
}

}  // namespace

void write_bytes(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  CUDP_CHECK(bytes == 0 || (dst != nullptr && src != nullptr), "write_bytes: a pointer is null");
  auto* out = static_cast<unsigned char*>(dst);
  const auto* in = static_cast<const unsigned char*>(src);
  for (size_t done = 0; done < bytes; done += kWriteChunk) {
    const size_t n = bytes - done < kWriteChunk ? bytes - done : kWriteChunk;
    Chunk chunk;
    std::memcpy(chunk.bytes, in + done, n);
    launch("write_bytes_kernel", write_bytes_kernel, 1, 256, 0, stream, out + done, chunk,
           static_cast<unsigned>(n));
  }
}

void add_i64(int64_t* counter, int64_t value, cudaStream_t stream) {
  CUDP_CHECK(counter != nullptr, "add_i64: the counter pointer is null");
  launch("add_i64_kernel", add_i64_kernel, 1, 1, 0, stream, counter, value);
}

}  // namespace cudp::kernels
