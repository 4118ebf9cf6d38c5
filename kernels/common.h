// What every kernel file shares. kernels/ is the bottom layer (docs/architecture.md §1): raw pointers, shapes
// and a stream in, no Tensor. Each op has
//   - a CUDA launcher      `op_forward(..., cudaStream_t stream)`  (kernels/op.cu, through launch())
//   - a CPU reference      `op_forward_cpu(...)`                    (kernels/op_ref.cpp, double accumulation)
// with the same argument order, so tests and layers can call either.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define CUDP_HD __host__ __device__
#else
#define CUDP_HD
#endif

namespace cudp::kernels {

// How matrix products are computed. FP32 is plain IEEE fp32 FMA (the only one implemented now);
// TF32 and BF16 select tensor-core variants; a launcher that lacks one throws ValueError saying so.
enum class Math { FP32, TF32, BF16 };

const char* math_name(Math math);

namespace detail {
// Whether p is a multiple of `bytes` (a vector access's alignment).
inline bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}
template <uintptr_t kBytes>
bool aligned(const void* p) {
  return aligned(p, kBytes);
}
}  // namespace detail

}  // namespace cudp::kernels
