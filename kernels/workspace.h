// Scratch device memory for one kernel call, from the stream-ordered allocator: allocated on
// `stream`, and freed on it when the scope ends (also when a launch in between throws), so later
// work on the stream reuses it without a synchronisation. Keep the device's pool release threshold
// raised (docs/architecture.md §2.4) so that this is a reuse, not a trip to the driver. The one
// workspace of every kernel family (GEMM, convolution, batch norm, the tensor-core matmul).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "engine/core/error.h"

namespace cudp::kernels {

class Workspace {
 public:
  Workspace() = default;
  // bytes == 0 allocates nothing (get() is null).
  Workspace(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) CUDP_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~Workspace() {
    if (ptr_) static_cast<void>(cudaFreeAsync(ptr_, stream_));  // an error here already surfaced
  }
  Workspace(Workspace&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), stream_(other.stream_) {}
  Workspace& operator=(Workspace&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(stream_, other.stream_);
    return *this;
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  template <typename T = float>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  // Frees now (on the stream), reporting an error instead of swallowing it.
  void release() {
    if (ptr_) CUDP_CUDA_CHECK(cudaFreeAsync(std::exchange(ptr_, nullptr), stream_));
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace cudp::kernels
