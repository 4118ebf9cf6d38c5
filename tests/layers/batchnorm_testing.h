// Helpers of the BatchNorm2d layer tests: tensors of values bf16 holds exactly, and a bitwise
// comparison of two activation tensors that names the first difference.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "engine/core/tensor.h"
#include "layers/precision.h"
#include "tests/layers/layer_testing.h"

namespace cudp::testing_bn {

// An f32 tensor of values that bf16 holds exactly.
inline Tensor bf16_exact(const Tensor& t) {
  return convert(convert(t, DType::bf16), DType::f32);
}

inline ::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return ::testing::AssertionFailure() << a.str() << " vs " << b.str();
  }
  const std::vector<float> x = testing::values(a), y = testing::values(b);
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::memcmp(&x[i], &y[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure()
             << "first difference at " << i << ": " << x[i] << " vs " << y[i];
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace cudp::testing_bn
