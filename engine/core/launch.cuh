// The one way cudp launches a kernel: launch() runs it on the given stream and checks
// cudaGetLastError() right after, naming the kernel, so a bad configuration surfaces at its launch
// and not at some later synchronisation. An empty grid is a no-op (a zero-sized tensor is legal).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "engine/core/error.h"

namespace cudp {

template <typename... KernelArgs, typename... Args>
void launch(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
            size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  kernel<<<grid, block, shared_bytes, stream>>>(static_cast<KernelArgs>(args)...);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    detail::throw_cuda(status, name, __FILE__, __LINE__);
  }
}

// Blocks of `threads` threads covering n elements, one element per thread.
inline unsigned grid_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace cudp
