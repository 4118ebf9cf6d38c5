// BatchNorm2d on the CPU: batch statistics, PyTorch's running-statistics update (momentum, unbiased
// variance), num_batches_tracked as an i64 scalar that counts training forwards and survives
// state_dict round trips, evaluation with running statistics, and gradients in both modes. The
// weight and bias enter linearly (and in evaluation the input too), so they take fp32 finite
// differences (layer_testing.h); the training input gradient is checked against central
// differences of the kernel's double-precision forward, the same function in double, where a step
// of 1e-4 leaves errors far below the fp32 tolerance.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/batchnorm.h"
#include "layers/batchnorm.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

struct Stats {
  std::vector<double> mean, biased_var;
};

Stats batch_stats(const std::vector<float>& x, int c) {
  const size_t rows = x.size() / c;
  Stats s{std::vector<double>(c, 0.0), std::vector<double>(c, 0.0)};
  for (size_t r = 0; r < rows; ++r)
    for (int k = 0; k < c; ++k) s.mean[k] += x[r * c + k] / double(rows);
  for (size_t r = 0; r < rows; ++r)
    for (int k = 0; k < c; ++k) s.biased_var[k] += std::pow(x[r * c + k] - s.mean[k], 2) / rows;
  return s;
}

TEST(BatchNorm2dTest, TrainingNormalisesWithBatchStatistics) {
  BatchNorm2d bn(3);
  testing::randomize_parameters(bn, 1);
  const Tensor x = random_tensor({2, 3, 5, 3}, 2, -2.f, 3.f);
  const auto xv = values(x), gamma = values(bn.weight().data), beta = values(bn.bias().data);
  const Stats s = batch_stats(xv, 3);
  std::vector<double> expected(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    const int k = static_cast<int>(i % 3);
    expected[i] = (xv[i] - s.mean[k]) / std::sqrt(s.biased_var[k] + 1e-5) * gamma[k] + beta[k];
  }
  EXPECT_ALL_CLOSE(values(bn.forward(x)), expected, 1e-5, 1e-6);
}

TEST(BatchNorm2dTest, RunningStatisticsFollowPyTorch) {
  BatchNorm2d bn(2, 1e-5f, 0.2f);
  const Tensor x1 = random_tensor({3, 2, 2, 2}, 3), x2 = random_tensor({3, 2, 2, 2}, 4, 0.f, 5.f);
  bn.forward(x1);
  bn.forward(x2);
  const Stats s1 = batch_stats(values(x1), 2), s2 = batch_stats(values(x2), 2);
  const double rows = 12, unbias = rows / (rows - 1), m = 0.2;
  std::vector<double> mean(2), var(2);
  for (int k = 0; k < 2; ++k) {
    mean[k] = (1 - m) * ((1 - m) * 0.0 + m * s1.mean[k]) + m * s2.mean[k];
    var[k] =
        (1 - m) * ((1 - m) * 1.0 + m * s1.biased_var[k] * unbias) + m * s2.biased_var[k] * unbias;
  }
  EXPECT_ALL_CLOSE(values(bn.running_mean()), mean, 1e-6, 1e-7);
  EXPECT_ALL_CLOSE(values(bn.running_var()), var, 1e-6, 1e-7);
  EXPECT_EQ(bn.num_batches_tracked(), 2);
  EXPECT_EQ(bn.state_dict().at("num_batches_tracked").to_vector<int64_t>(),
            std::vector<int64_t>{2});
}

TEST(BatchNorm2dTest, EvalUsesRunningStatisticsAndCountsNothing) {
  BatchNorm2d bn(2);
  testing::randomize_parameters(bn, 5);
  bn.running_mean().copy_from(Tensor::from_vector<float>({0.5f, -1.f}, {2}));
  bn.running_var().copy_from(Tensor::from_vector<float>({2.f, 0.25f}, {2}));
  bn.eval();
  const Tensor x = random_tensor({1, 2, 3, 2}, 6);
  const auto xv = values(x), gamma = values(bn.weight().data), beta = values(bn.bias().data);
  const double rm[2] = {0.5, -1.0}, rv[2] = {2.0, 0.25};
  std::vector<double> expected(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    const int k = static_cast<int>(i % 2);
    expected[i] = (xv[i] - rm[k]) / std::sqrt(rv[k] + 1e-5) * gamma[k] + beta[k];
  }
  EXPECT_ALL_CLOSE(values(bn.forward(x)), expected, 1e-6, 1e-6);
  EXPECT_EQ(bn.num_batches_tracked(), 0);
}

// With frozen statistics the layer is affine in its input, weight and bias: fp32 differences apply.
TEST(BatchNorm2dTest, EvalGradientsMatchFiniteDifferences) {
  BatchNorm2d bn(3);
  testing::randomize_parameters(bn, 16);
  bn.forward(random_tensor({2, 4, 3, 3}, 17, -1.f, 2.f));  // running statistics away from 0 and 1
  bn.eval();
  testing::check_gradients(bn, random_tensor({2, 3, 2, 3}, 18), 19, {.h = 0.25});
}

TEST(BatchNorm2dTest, WeightAndBiasGradientsMatchFiniteDifferences) {
  BatchNorm2d bn(4);
  testing::randomize_parameters(bn, 8);
  testing::check_gradients(bn, random_tensor({2, 3, 3, 4}, 9), 10,
                           {.h = 0.25, .check_input = false});
}

TEST(BatchNorm2dTest, InputGradientMatchesDoublePrecisionDifferences) {
  const int c = 3;
  const Shape shape{2, 3, 2, c};
  const int64_t rows = shape_numel(shape) / c;
  BatchNorm2d bn(c);
  testing::randomize_parameters(bn, 11);
  const Tensor x = random_tensor(shape, 12, -1.f, 2.f);
  bn.forward(x);
  const std::vector<float> g = testing::random_vector(static_cast<size_t>(x.numel()), 13);
  const std::vector<float> dx = values(bn.backward(Tensor::from_vector(g, shape)));

  const auto gamma32 = values(bn.weight().data), beta32 = values(bn.bias().data);
  const std::vector<double> gamma(gamma32.begin(), gamma32.end()),
      beta(beta32.begin(), beta32.end());
  const auto x32 = values(x);
  std::vector<double> xd(x32.begin(), x32.end()), y(xd.size());
  auto loss = [&] {
    kernels::batchnorm_forward_train_cpu<double>(xd.data(), y.data(), gamma.data(), beta.data(),
                                                 nullptr, nullptr, nullptr, nullptr, rows, c, 0.1,
                                                 1e-5);
    double l = 0;
    for (size_t j = 0; j < y.size(); ++j) l += g[j] * y[j];
    return l;
  };
  std::vector<double> numeric(xd.size());
  const double h = 1e-4;
  for (size_t i = 0; i < xd.size(); ++i) {
    const double saved = xd[i];
    xd[i] = saved + h;
    const double lp = loss();
    xd[i] = saved - h;
    const double lm = loss();
    xd[i] = saved;
    numeric[i] = (lp - lm) / (2 * h);
  }
  EXPECT_ALL_CLOSE(dx, numeric, 1e-4, 1e-6);
}

TEST(BatchNorm2dTest, LoadedCountContinues) {
  BatchNorm2d bn(2);
  auto state = bn.state_dict();
  state["num_batches_tracked"] = Tensor::from_vector<int64_t>({41}, {});
  bn.load_state_dict(state);
  EXPECT_EQ(bn.num_batches_tracked(), 41);
  bn.forward(random_tensor({2, 2, 2, 2}, 14));
  EXPECT_EQ(bn.state_dict().at("num_batches_tracked").to_vector<int64_t>(),
            std::vector<int64_t>{42});
}

TEST(BatchNorm2dTest, TrainingNeedsMoreThanOneValuePerChannel) {
  BatchNorm2d bn(2);
  EXPECT_THROW_WITH(bn.forward(random_tensor({1, 1, 1, 2}, 15)), "more than 1 value per channel");
}

}  // namespace
}  // namespace cudp
