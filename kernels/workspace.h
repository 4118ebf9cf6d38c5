// Scratch device memory for one kernel call, from the stream-ordered allocator: allocated on
// `stream`, and freed on it when the scope ends (also when a launch in between throws), so later
// work on the stream reuses it without a synchronisation. Keep the device's pool release threshold
// raised (docs/architecture.md §2.4) so that this is a reuse, not a trip to the driver. The one
// workspace of every kernel family (GEMM, convolution, batch norm, the tensor-core matmul).
// Out of memory names the workspace (`what`), its bytes and the device, inside the purpose its
// caller set on the thread (engine/core/memory.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "engine/core/error.h"
#include "engine/core/memory.h"

namespace cudp::kernels {

class Workspace {
 public:
  Workspace() = default;
  // bytes == 0 allocates nothing (get() is null). `what`: what the memory holds, for an
  // out-of-memory error ("the GEMM's split-K partial tiles").
  Workspace(size_t bytes, cudaStream_t stream, const char* what = "a kernel's workspace")
      : stream_(stream) {
    if (bytes > 0) {
      cuda::check_allocation(cudaMallocAsync(&ptr_, bytes, stream), bytes, what, "cudaMallocAsync");
      cuda::note_allocation(ptr_, stream);  // freed in the graph when captured (memory.h)
    }
  }
  ~Workspace() { cuda::device_free(ptr_, stream_); }  // an error here already surfaced
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
    if (!ptr_) return;
    if (cuda::capture_is_open()) {
      cuda::device_free(std::exchange(ptr_, nullptr), stream_);
      return;
    }
    CUDP_CUDA_CHECK(cudaFreeAsync(std::exchange(ptr_, nullptr), stream_));
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace cudp::kernels
