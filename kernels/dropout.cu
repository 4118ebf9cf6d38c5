// Dropout kernels: float4 over the aligned body (detail::vector_split), one Philox call per float4
// when the body's global indices start on a multiple of 4 and two otherwise (the four elements then
// straddle two counters; `phase` is the same for every float4 of a launch, so the branch is
// uniform). The head and tail elements call detail::dropout_keep, exactly what the CPU reference
// does.
#include <algorithm>

#include "engine/core/launch.cuh"
#include "kernels/dropout.h"
#include "kernels/elementwise.h"

namespace cudp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535;

__device__ __forceinline__ float drop(uint32_t word, float x, float p, float scale) {
  return uniform01(word) >= p ? x * scale : 0.0f;
}

__global__ void __launch_bounds__(kThreads, 6)
    dropout_kernel(const float* x, float* y, int64_t n, float p, float scale, uint64_t seed,
                   uint64_t offset, int64_t head, int64_t vectors,
                   const uint64_t* __restrict__ seed_offset) {
  kernel_entry();
  if (seed_offset != nullptr) {  // a captured launch: this replay's (seed, offset)
    seed = seed_offset[0];
    offset = seed_offset[1];
  }
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const auto* x4 = reinterpret_cast<const float4*>(x + head);
  auto* y4 = reinterpret_cast<float4*>(y + head);
  const uint64_t body = offset + static_cast<uint64_t>(head);  // global index of the first float4
  const uint32_t phase = static_cast<uint32_t>(body & 3);
  for (int64_t v = start; v < vectors; v += stride) {
    const float4 a = x4[v];  // issued first: its latency overlaps the Philox rounds
    const uint64_t g = body + 4 * static_cast<uint64_t>(v);
    const Philox4 r0 = philox(seed, g >> 2);
    uint32_t w[4];
    if (phase == 0) {
      w[0] = r0.v[0];
      w[1] = r0.v[1];
      w[2] = r0.v[2];
      w[3] = r0.v[3];
    } else {
      // Elements g .. g + 3: words phase .. 3 of counter g / 4, then words 0 .. phase - 1 of the
      // next counter, (g + 4) / 4 (written so that it wraps as the CPU's (g + k) / 4 does).
      const Philox4 r1 = philox(seed, (g + 4) >> 2);
#pragma unroll
      for (uint32_t k = 0; k < 4; ++k) {
        const uint32_t word = phase + k;
        w[k] = word < 4 ? detail::philox_word(r0, word) : detail::philox_word(r1, word - 4);
      }
    }
    y4[v] = make_float4(drop(w[0], a.x, p, scale), drop(w[1], a.y, p, scale),
                        drop(w[2], a.z, p, scale), drop(w[3], a.w, p, scale));
  }
  for (int64_t i = start; i < head; i += stride) {
    y[i] = detail::dropout_keep(seed, offset + static_cast<uint64_t>(i), p) ? x[i] * scale : 0.0f;
  }
  for (int64_t i = head + 4 * vectors + start; i < n; i += stride) {
    y[i] = detail::dropout_keep(seed, offset + static_cast<uint64_t>(i), p) ? x[i] * scale : 0.0f;
  }
}

void run(const char* op, const float* x, float* y, int64_t n, float p, uint64_t seed,
         uint64_t offset, const uint64_t* seed_offset, cudaStream_t stream) {
  detail::check_elementwise(op, n, {x, y});
  const float scale = dropout_scale(p);  // checks p
  if (n == 0) {
    return;
  }
  if (p == 0.0f) {
    if (y != x) {
      CUDP_CUDA_CHECK(cudaMemcpyAsync(y, x, static_cast<size_t>(n) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream));
    }
    return;
  }
  const detail::VectorSplit split = detail::vector_split(n, {{x, 4}, {y, 4}});
  const int64_t work = std::max(split.vectors, n - 4 * split.vectors);
  const unsigned blocks = std::min(grid_for(work, kThreads), kMaxBlocks);
  launch(op, dropout_kernel, blocks, kThreads, 0, stream, x, y, n, p, scale, seed, offset,
         split.head, split.vectors, seed_offset);
}

}  // namespace

void dropout_forward(const float* x, float* y, int64_t n, float p, uint64_t seed, uint64_t offset,
                     cudaStream_t stream) {
  run("dropout_forward", x, y, n, p, seed, offset, nullptr, stream);
}

void dropout_forward(const float* x, float* y, int64_t n, float p, const uint64_t* seed_offset,
                     cudaStream_t stream) {
  CUDP_CHECK(seed_offset != nullptr, "dropout_forward: the seed and offset pointer is null");
  run("dropout_forward", x, y, n, p, 0, 0, seed_offset, stream);
}

void dropout_backward(const float* dy, float* dx, int64_t n, float p, uint64_t seed,
                      uint64_t offset, cudaStream_t stream) {
  run("dropout_backward", dy, dx, n, p, seed, offset, nullptr, stream);
}

void dropout_backward(const float* dy, float* dx, int64_t n, float p, const uint64_t* seed_offset,
                      cudaStream_t stream) {
  CUDP_CHECK(seed_offset != nullptr, "dropout_backward: the seed and offset pointer is null");
  run("dropout_backward", dy, dx, n, p, 0, 0, seed_offset, stream);
}

}  // namespace cudp::kernels
