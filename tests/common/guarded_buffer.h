// A device array for kernel tests that catches out-of-bounds writes and misaligned-pointer bugs:
// n elements starting `shift` elements into an allocation (shift 1 breaks 16-byte alignment, so a
// vectorised kernel's scalar head and tail paths run), followed by kGuardBand more elements, the
// whole allocation filled with a poison value first. guards_intact() then says whether anything
// outside the n elements was written. Uploads and downloads are synchronous, like DeviceBuffer's.
#pragma once

#include <cuda_runtime.h>  // before device_buffer.h: its cudaMalloc(T**) overload
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/compare.h"
#include "common/device_buffer.h"
#include "engine/core/error.h"

namespace cudp::testing {

// Poisoned elements after every array.
inline constexpr int kGuardBand = 5;

template <typename T>
class GuardedBuffer {
 public:
  GuardedBuffer(int64_t n, int shift, T poison)
      : n_(n),
        shift_(shift),
        poison_(poison),
        buffer_(static_cast<size_t>(n + shift + kGuardBand)) {
    buffer_.fill(poison);
  }
  // Floats are poisoned with kPoison unless told otherwise.
  GuardedBuffer(int64_t n, int shift) requires std::is_same_v<T, float>
      : GuardedBuffer(n, shift, kPoison) {}

  T* get() const { return buffer_.get() + shift_; }

  void upload(const std::vector<T>& v) {
    ASSERT_EQ(static_cast<int64_t>(v.size()), n_);
    CUDP_CUDA_CHECK(cudaMemcpy(get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    // The kernels run on a non-blocking stream, which does not wait for this copy.
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // The n elements (DeviceBuffer::download synchronises the device first).
  std::vector<T> download() const {
    const std::vector<T> all = buffer_.download();
    return {all.begin() + shift_, all.begin() + shift_ + n_};
  }

  // Success when every element outside the n still holds the poison, bit for bit.
  ::testing::AssertionResult guards_intact() const {
    const std::vector<T> all = buffer_.download();
    for (int64_t i = 0; i < static_cast<int64_t>(all.size()); ++i) {
      if (i >= shift_ && i < shift_ + n_) {
        continue;
      }
      if (std::memcmp(&all[i], &poison_, sizeof(T)) != 0) {
        return ::testing::AssertionFailure()
               << "element " << i - shift_ << " outside the " << n_ << " elements was written";
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  int64_t n_;
  int shift_;
  T poison_;
  DeviceBuffer<T> buffer_;
};

}  // namespace cudp::testing
