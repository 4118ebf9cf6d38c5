// Device memory for the benchmarks, freed at scope exit: n elements of T at p. Neither copyable nor
// movable: a benchmark holds its buffers by value or in unique_ptrs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "engine/core/error.h"

namespace cudp::bench {

template <typename T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;

  // Allocates at least one element, so that p is a valid pointer even for n = 0.
  explicit DeviceBuffer(size_t count) : n(count) {
    CUDP_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // The benchmarked kernels (ours and the vendor's) run on cudaStreamNonBlocking streams, which
  // cudaMemcpy's legacy default stream does not wait for: without the synchronisation the copy
  // races the kernels and reads whatever the buffer held before (zeros, or a previous run's
  // values).
  std::vector<T> download() const {
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> h(n);
    CUDP_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

}  // namespace cudp::bench
