// Memory: device allocations from CUDA's stream-ordered allocator, host allocations (aligned, or
// pinned for asynchronous copies), and torch.cuda-style statistics.
//
// Device memory comes from each device's default memory pool through cudaMallocAsync, with the
// pool's release threshold raised to "never", so freed blocks stay reserved and are reused without
// going back to the driver (DESIGN.md §2.4). That is the caching allocator; cudp does not write its
// own. An allocation is ordered on a stream and freed on the same stream; memory used on another
// stream must be ordered with an event before it is freed (the engine does this).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace cudp::cuda {

// Allocates `bytes` on `device`, ordered on `stream`. Throws OutOfMemoryError naming the device, the
// bytes asked for, and what is allocated and reserved.
void* device_allocate(size_t bytes, int device, cudaStream_t stream);
void device_free(void* ptr, cudaStream_t stream) noexcept;

// Host memory aligned to 64 bytes; pinned (page-locked, portable across devices) when asked, which
// asynchronous host-to-device copies need.
void* host_allocate(size_t bytes, bool pinned);
void host_free(void* ptr, bool pinned) noexcept;

// Statistics of `device`'s pool, in bytes: what tensors hold now, the peak since the last reset,
// and what the pool holds from the driver (torch.cuda.memory_allocated / max_memory_allocated /
// memory_reserved).
size_t memory_allocated(int device);
size_t max_memory_allocated(int device);
size_t memory_reserved(int device);
void reset_peak_memory_stats(int device);
// Returns the pool's unused reserved memory to the driver (torch.cuda.empty_cache).
void empty_cache(int device);

}  // namespace cudp::cuda
