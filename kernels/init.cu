#include "engine/core/launch.cuh"
#include "kernels/init.h"
#include "kernels/init_math.h"

namespace cudp::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void fill_kernel(float* x, int64_t n, float value) {
  kernel_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = value;
  }
}

__global__ void uniform_kernel(float* x, int64_t n, float lo, float hi, uint64_t seed,
                               uint64_t offset) {
  kernel_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = detail::uniform_at(seed, offset + i, lo, hi);
  }
}

__global__ void normal_kernel(float* x, int64_t n, float mean, float std, uint64_t seed,
                              uint64_t offset) {
  kernel_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = detail::normal_at(seed, offset + i, mean, std);
  }
}

// Grid-stride loops: enough blocks to fill the GPU, no more than the elements need.
unsigned blocks_for(int64_t n) { return std::min<unsigned>(grid_for(n, kThreads), 65535u); }

}  // namespace

void fill(float* x, int64_t n, float value, cudaStream_t stream) {
  launch("fill_kernel", fill_kernel, blocks_for(n), kThreads, 0, stream, x, n, value);
}

void uniform(float* x, int64_t n, float lo, float hi, uint64_t seed, uint64_t offset,
             cudaStream_t stream) {
  launch("uniform_kernel", uniform_kernel, blocks_for(n), kThreads, 0, stream, x, n, lo, hi, seed,
         offset);
}

void normal(float* x, int64_t n, float mean, float std, uint64_t seed, uint64_t offset,
            cudaStream_t stream) {
  launch("normal_kernel", normal_kernel, blocks_for(n), kThreads, 0, stream, x, n, mean, std, seed,
         offset);
}

}  // namespace cudp::kernels
