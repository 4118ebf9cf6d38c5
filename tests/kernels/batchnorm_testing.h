// Helpers of the batch-normalisation tests (host and GPU): bf16 vectors built and read with CUDA's
// own conversions (independent of the kernels' CPU rounding), ReLU and its gradient applied the
// unfused way (kernels/elementwise.h), and a bitwise comparison that names the first difference.
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/compare.h"
#include "kernels/elementwise.h"

namespace cudp::kernels::testing_bn {

inline std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16_rn(v[i]);
  return out;
}

inline std::vector<float> to_float(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// Activations of storage type T (float or __nv_bfloat16) from floats, and back.
template <typename T>
std::vector<T> stored(const std::vector<float>& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return to_bf16(v);
  }
}
inline std::vector<float> floats(const std::vector<float>& v) {
  return v;
}
inline std::vector<float> floats(const std::vector<__nv_bfloat16>& v) {
  return to_float(v);
}

// v rounded to bf16 and back: a float that bf16 holds exactly.
inline std::vector<float> bf16_exact(const std::vector<float>& v) {
  return to_float(to_bf16(v));
}

// ReLU's forward and backward as the unfused layers apply them (on bf16 data the values are
// exact floats, and max and the mask keep them exact).
inline std::vector<float> relu_of(const std::vector<float>& y) {
  std::vector<float> out(y.size());
  relu_forward_cpu(y.data(), out.data(), int64_t(y.size()));
  return out;
}
inline std::vector<float> relu_grad_of(const std::vector<float>& y, const std::vector<float>& dy) {
  std::vector<float> out(y.size());
  relu_backward_cpu(y.data(), dy.data(), out.data(), int64_t(y.size()));
  return out;
}

// How many elements a ReLU clamps: a fused-ReLU test must clamp some and keep some.
inline size_t clamped(const std::vector<float>& y) {
  size_t n = 0;
  for (float v : y) n += v <= 0.f;
  return n;
}

using ::cudp::testing::bitwise_equal;

}  // namespace cudp::kernels::testing_bn
