// BatchNorm2d on the CPU: batch statistics, PyTorch's running-statistics update (momentum, unbiased
// variance), num_batches_tracked as an i64 scalar that counts training forwards and survives
// state_dict round trips, evaluation with running statistics, and gradients in both modes. The
// weight and bias enter linearly (and in evaluation the input too), so they take fp32 finite
// differences (layer_testing.h); the training input gradient is checked against central
// differences of the kernel's double-precision forward, the same function in double, where a step
// of 1e-4 leaves errors far below the fp32 tolerance. bf16 activations keep their dtype and equal
// the f32 layer's results rounded once; a fused ReLU (Sequential) is the unfused one bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kernels/batchnorm.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/sequential.h"
#include "tests/layers/batchnorm_testing.h"
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

// The bf16 layer on values that bf16 holds exactly, against the f32 layer on the same values: both
// compute in double on the CPU, so everything fp32 (statistics, running buffers, weight and bias
// gradients) is the same bits, and each bf16 activation is the double result rounded once to
// nearest, within half a bf16 ulp (2^-8 relative) of it, while the f32 one is within 2^-24 of it:
// rtol 2^-8 + 2^-23 between them.
TEST(BatchNorm2dTest, Bf16KeepsItsDtypeAndIsTheF32ResultRounded) {
  constexpr double kRtol = 1.0 / 256 + 1.0 / (1 << 23);
  using testing_bn::bitwise_equal;
  BatchNorm2d f32(5);
  testing::randomize_parameters(f32, 21);
  auto bf16 = std::static_pointer_cast<BatchNorm2d>(f32.clone(Device::cpu()));
  const Tensor x = testing_bn::bf16_exact(random_tensor({2, 3, 7, 5}, 22, -2.f, 3.f));
  const Tensor g = testing_bn::bf16_exact(random_tensor(x.shape(), 23));
  for (const bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "evaluation");
    f32.train(training);
    bf16->train(training);
    f32.zero_grad();
    bf16->zero_grad();
    const Tensor y = bf16->forward(convert(x, DType::bf16));
    EXPECT_EQ(y.dtype(), DType::bf16);
    EXPECT_ALL_CLOSE(values(y), values(f32.forward(x)), kRtol, 0);
    EXPECT_TRUE(bitwise_equal(bf16->running_mean(), f32.running_mean()));
    EXPECT_TRUE(bitwise_equal(bf16->running_var(), f32.running_var()));
    EXPECT_EQ(bf16->num_batches_tracked(), f32.num_batches_tracked());
    const Tensor dx = bf16->backward(convert(g, DType::bf16));
    EXPECT_EQ(dx.dtype(), DType::bf16);
    EXPECT_ALL_CLOSE(values(dx), values(f32.backward(g)), kRtol, 0);
    EXPECT_EQ(bf16->weight().grad.dtype(), DType::f32);
    EXPECT_TRUE(bitwise_equal(bf16->weight().grad, f32.weight().grad));
    EXPECT_TRUE(bitwise_equal(bf16->bias().grad, f32.bias().grad));
  }
}

TEST(BatchNorm2dTest, GradOutputMustHaveTheOutputDtype) {
  BatchNorm2d bn(3);
  const Tensor x = random_tensor({2, 2, 2, 3}, 24);
  bn.forward(convert(x, DType::bf16));
  EXPECT_THROW_WITH(bn.backward(x), "grad_output must have the output's dtype bf16");
  EXPECT_THROW_WITH(bn.forward(Tensor::zeros({2, 2, 2, 3}, DType::f16)), "f32 or bf16 input");
}

TEST(BatchNorm2dTest, GradOutputMustHaveTheOutputShape) {
  BatchNorm2d bn(3);
  bn.forward(random_tensor({2, 2, 2, 3}, 24));
  EXPECT_THROW_WITH(bn.backward(random_tensor({2, 2, 1, 3}, 25)),
                    "BatchNorm2d: grad_output has invalid shape");
  EXPECT_THROW_WITH(bn.backward(Tensor()), "BatchNorm2d: grad_output is undefined");
}

// Sequential(BatchNorm2d, ReLU) fuses the ReLU into the BatchNorm2d; with fusion off the ReLU
// module runs. Outputs, input gradients, parameter gradients and buffers are the same bits, in f32
// and bf16, in training and in evaluation.
TEST(BatchNorm2dTest, FusedReluIsUnfusedBitForBit) {
  using testing_bn::bitwise_equal;
  for (const DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    auto bn = std::make_shared<BatchNorm2d>(6);
    testing::randomize_parameters(*bn, 25, 0.5f, 1.5f);
    Sequential fused({bn, std::make_shared<ReLU>()});
    auto unfused = std::static_pointer_cast<Sequential>(fused.clone(Device::cpu()));
    unfused->set_fusion(false);
    const Tensor x = convert(random_tensor({2, 5, 3, 6}, 26, -2.f, 3.f), dtype);
    const Tensor g = convert(random_tensor(x.shape(), 27), dtype);
    for (const bool training : {true, false}) {
      SCOPED_TRACE(training ? "training" : "evaluation");
      fused.train(training);
      unfused->train(training);
      fused.zero_grad();
      unfused->zero_grad();
      const Tensor y = fused.forward(x);
      EXPECT_EQ(y.dtype(), dtype);
      EXPECT_TRUE(bn->relu_fused());
      EXPECT_FALSE((*unfused)[0]->relu_fused());
      EXPECT_TRUE(bitwise_equal(y, unfused->forward(x)));
      const std::vector<float> yv = values(y);
      const auto zeros = std::count(yv.begin(), yv.end(), 0.f);
      EXPECT_GT(zeros, 0);  // the ReLU clamps some values and keeps others
      EXPECT_LT(zeros, static_cast<long>(yv.size()));
      EXPECT_TRUE(bitwise_equal(fused.backward(g), unfused->backward(g)));
      const auto a = fused.named_parameters(), b = unfused->named_parameters();
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_TRUE(bitwise_equal(a[i].second->grad, b[i].second->grad)) << a[i].first;
      const auto ba = fused.named_buffers(), bb = unfused->named_buffers();
      for (size_t i = 0; i < ba.size(); ++i) {
        if (ba[i].second->dtype() == DType::f32) {
          EXPECT_TRUE(bitwise_equal(*ba[i].second, *bb[i].second)) << ba[i].first;
        }
      }
    }
  }
}

}  // namespace
}  // namespace cudp
