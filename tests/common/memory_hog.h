// For GPU tests of out-of-memory errors: takes all but about `keep` bytes of a device's free memory,
// from the device's pool as tensors do, so that a later allocation of more than that fails for
// certain. The destructor frees it and returns the pool's unused memory to the driver, so that
// later tests (and allocations outside the pool) have the device back.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/core/tensor.h"

namespace cudp::testing {

class MemoryHog {
 public:
  MemoryHog(int device, size_t keep) : device_(device) {
    cuda::empty_cache(device_);
    // The driver may not hand out every free byte in one piece: ask for less until it does.
    for (size_t extra = 0; extra <= (size_t{1} << 30); extra += size_t{64} << 20) {
      const size_t free = free_bytes();
      if (free <= keep + extra) break;
      try {
        hog_ = Tensor::empty({static_cast<int64_t>(free - keep - extra)}, DType::u8,
                             Device::cuda(device_));
        break;
      } catch (const OutOfMemoryError&) {
      }
    }
    cuda::synchronize(device_);
  }
  ~MemoryHog() {
    hog_ = Tensor();
    cuda::empty_cache(device_);
  }
  MemoryHog(const MemoryHog&) = delete;
  MemoryHog& operator=(const MemoryHog&) = delete;

  // What the driver has left now.
  size_t free_bytes() const {
    cuda::DeviceGuard guard(device_);
    size_t free = 0, total = 0;
    CUDP_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return free;
  }

 private:
  int device_;
  Tensor hog_;
};

}  // namespace cudp::testing
