// Host tests of the bias CPU references (kernels/bias.h): hand-computed values, an independent
// loop, beta semantics, empty shapes and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/compare.h"
#include "engine/core/error.h"
#include "kernels/bias.h"

namespace cudp::kernels {
namespace {

// A typed null: the float and bf16 overloads would make a bare nullptr ambiguous.
constexpr float* kNoFloats = nullptr;

TEST(BiasAdd, HandValues) {
  // rows = 2, cols = 3
  std::vector<float> y = {1, 2, 3, 4, 5, 6};
  const std::vector<float> bias = {10, 20, 30};
  bias_add_cpu(y.data(), bias.data(), 2, 3);
  EXPECT_EQ(y, (std::vector<float>{11, 22, 33, 14, 25, 36}));
}

TEST(BiasAdd, MatchesIndependentLoop) {
  const int64_t rows = 37, cols = 13;
  std::vector<float> y = testing::random_vector(rows * cols, 1);
  const std::vector<float> bias = testing::random_vector(cols, 2);
  std::vector<float> expected(y.size());
  for (size_t i = 0; i < y.size(); ++i) {
    expected[i] = y[i] + bias[i % cols];
  }
  bias_add_cpu(y.data(), bias.data(), rows, cols);
  EXPECT_ALL_CLOSE(y, expected, 0.0, 0.0);
}

TEST(BiasGrad, HandValuesAndBeta) {
  const std::vector<float> dy = {1, 2, 3, 4, 5, 6, -1, -2, -3, 0.5f, 0.25f, 0.125f};  // 4 x 3
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> dbias = {nan, nan, nan};
  bias_grad_cpu(dy.data(), dbias.data(), 4, 3, 0.0f);  // beta = 0 never reads dbias
  EXPECT_EQ(dbias, (std::vector<float>{4.5f, 5.25f, 6.125f}));
  bias_grad_cpu(dy.data(), dbias.data(), 4, 3, 1.0f);  // accumulate
  EXPECT_EQ(dbias, (std::vector<float>{9.0f, 10.5f, 12.25f}));
  bias_grad_cpu(dy.data(), dbias.data(), 4, 3, 0.5f);
  EXPECT_EQ(dbias, (std::vector<float>{9.0f, 10.5f, 12.25f}));  // 0.5 * (2 s) + s = 2 s
}

TEST(BiasGrad, MatchesIndependentDoubleLoop) {
  const int64_t rows = 1001, cols = 7;
  const std::vector<float> dy = testing::random_vector(rows * cols, 3);
  std::vector<float> dbias = testing::random_vector(cols, 4);
  std::vector<double> expected(cols);
  for (int64_t c = 0; c < cols; ++c) {
    double s = 0.75 * double(dbias[c]);
    for (int64_t r = 0; r < rows; ++r) {
      s += dy[r * cols + c];
    }
    expected[c] = s;
  }
  bias_grad_cpu(dy.data(), dbias.data(), rows, cols, 0.75f);
  EXPECT_ALL_CLOSE(dbias, expected, 1e-7, 0.0);  // one rounding of a double sum
}

TEST(BiasGrad, NoRowsScalesByBeta) {
  std::vector<float> dbias = {2.0f, -4.0f};
  bias_grad_cpu(kNoFloats, dbias.data(), 0, 2, 0.5f);
  EXPECT_EQ(dbias, (std::vector<float>{1.0f, -2.0f}));
  bias_grad_cpu(kNoFloats, dbias.data(), 0, 2, 0.0f);
  EXPECT_EQ(dbias, (std::vector<float>{0.0f, 0.0f}));
}

TEST(Bias, EmptyShapesAreNoOps) {
  EXPECT_NO_THROW(bias_add_cpu(nullptr, nullptr, 0, 0));
  EXPECT_NO_THROW(bias_add_cpu(nullptr, nullptr, 5, 0));
  float b[2] = {1, 2};
  EXPECT_NO_THROW(bias_add_cpu(nullptr, b, 0, 2));
  EXPECT_NO_THROW(bias_grad_cpu(kNoFloats, kNoFloats, 5, 0, 1.0f));
}

TEST(Bias, BadArgumentsThrowValueError) {
  float y[6] = {}, b[3] = {};
  EXPECT_THROW(bias_add_cpu(y, b, -1, 3), ValueError);
  EXPECT_THROW(bias_add_cpu(y, b, 2, -3), ValueError);
  EXPECT_THROW(bias_add_cpu(nullptr, b, 2, 3), ValueError);
  EXPECT_THROW(bias_add_cpu(y, nullptr, 2, 3), ValueError);
  EXPECT_THROW(bias_grad_cpu(y, kNoFloats, 2, 3, 1.0f), ValueError);
  EXPECT_THROW(bias_grad_cpu(kNoFloats, b, 2, 3, 1.0f), ValueError);
  EXPECT_THROW(bias_grad_cpu(y, b, 0, -1, 1.0f), ValueError);
}

}  // namespace
}  // namespace cudp::kernels
