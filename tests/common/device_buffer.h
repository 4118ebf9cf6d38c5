// A minimal RAII device buffer for kernel tests, which sit below Tensor (kernels/ takes raw
// pointers). Uploads and downloads are synchronous: tests want simple, obviously correct code.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "engine/core/error.h"

namespace cudp::testing {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n_ > 0) CUDP_CUDA_CHECK(cudaMalloc(&ptr_, n_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), n_(o.n_) { o.ptr_ = nullptr; o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }

  T* get() const { return ptr_; }
  size_t size() const { return n_; }

  void upload(const std::vector<T>& host) {
    CUDP_CHECK(host.size() == n_, "upload of ", host.size(), " elements into a buffer of ", n_);
    if (n_) CUDP_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> host(n_);
    if (n_) CUDP_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every element with `value` (for floats, use testing::kPoison before a kernel runs).
  void fill(const T& value) { upload(std::vector<T>(n_, value)); }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

}  // namespace cudp::testing
