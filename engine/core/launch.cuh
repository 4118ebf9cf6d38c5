// The one way cudp launches a kernel: launch() runs it on the given stream and checks the launch
// right after, naming the kernel, so a bad configuration surfaces at its launch and not at some
// later synchronisation. An empty grid is a no-op (a zero-sized tensor is legal). Launches are
// programmatic where the GPU allows (engine/core/launch.h, NOTE [Programmatic dependent launch]):
// every kernel cudp launches begins with kernel_entry().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "engine/core/error.h"
#include "engine/core/launch.h"

namespace cudp {

// The first statement of every kernel of cudp (NOTE [Programmatic dependent launch]): waits until
// the kernels this one depends on have completed and their writes are visible, then lets the
// next kernel on the stream launch. Nothing before it may touch global memory.
__device__ __forceinline__ void kernel_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <typename... KernelArgs, typename... Args>
void launch(const char* name, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
            size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  cudaError_t status;
  if (detail::programmatic_launch()) {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    status = cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
    if (status != cudaSuccess) (void)cudaGetLastError();  // cleared, as the <<<>>> path does
  } else {
    kernel<<<grid, block, shared_bytes, stream>>>(static_cast<KernelArgs>(args)...);
    status = cudaGetLastError();
  }
  if (status != cudaSuccess) {
    detail::throw_cuda(status, name, __FILE__, __LINE__);
  }
}

// Blocks of `threads` threads covering n elements, one element per thread.
inline unsigned grid_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace cudp
