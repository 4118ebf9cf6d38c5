// Helpers of the BatchNorm2d layer tests: bf16 tensors from f32 ones (CUDA's own rounding), any
// activation tensor's values as floats, and a bitwise comparison naming the first difference.
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "engine/core/tensor.h"

namespace cudp::testing_bn {

inline std::vector<float> floats_of(const Tensor& t) {
  if (t.dtype() == DType::f32) return t.to_vector<float>();
  const std::vector<__nv_bfloat16> v = t.to_vector<__nv_bfloat16>();
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// An f32 tensor rounded to bf16 (on the CPU).
inline Tensor to_bf16(const Tensor& t) {
  const std::vector<float> v = floats_of(t);
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16_rn(v[i]);
  return Tensor::from_vector(out, t.shape());
}

// An f32 tensor of values that bf16 holds exactly.
inline Tensor bf16_exact(const Tensor& t) {
  return Tensor::from_vector(floats_of(to_bf16(t)), t.shape());
}

inline ::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return ::testing::AssertionFailure() << a.str() << " vs " << b.str();
  }
  const std::vector<float> x = floats_of(a), y = floats_of(b);
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::memcmp(&x[i], &y[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure()
             << "first difference at " << i << ": " << x[i] << " vs " << y[i];
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace cudp::testing_bn
