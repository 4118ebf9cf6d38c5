// Host tests of the batch-normalisation CPU references: hand-computed training and evaluation
// forwards (with PyTorch's unbiased running variance), finite-difference checks of the backward in
// double, the accumulate semantics of the parameter gradients, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "engine/core/error.h"
#include "kernels/batchnorm.h"

namespace cudp::kernels {
namespace {

std::string value_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "<no ValueError>";
}

#define EXPECT_VALUE_ERROR(call, text) \
  EXPECT_NE(value_error([&] { call; }).find(text), std::string::npos) << value_error([&] { call; })

std::vector<double> random_doubles(size_t n, uint64_t seed, double lo, double hi) {
  const std::vector<float> f = testing::random_vector(n, seed, 0.f, 1.f);
  std::vector<double> d(n);
  for (size_t i = 0; i < n; ++i) d[i] = lo + (hi - lo) * double(f[i]);
  return d;
}

std::vector<float> to_float(const std::vector<double>& d) {
  return {d.begin(), d.end()};
}

// x = {rows 4, channels 2}: channel 0 = 1, 2, 3, 4 (mean 2.5, biased var 1.25, unbiased 5/3);
// channel 1 = -1, -1, 1, 1 (mean 0, biased var 1, unbiased 4/3).
const std::vector<float> kX = {1, -1, 2, -1, 3, 1, 4, 1};
const std::vector<float> kGamma = {2.f, 0.5f}, kBeta = {0.1f, -0.2f};
constexpr float kEps = 1e-5f, kMomentum = 0.1f;

TEST(BatchNormCpu, TrainingForwardByHand) {
  std::vector<float> y(8, testing::kPoison), mean(2), invstd(2);
  std::vector<float> running_mean = {0.5f, -1.f}, running_var = {2.f, 0.25f};
  batchnorm_forward_train_cpu(kX.data(), y.data(), kGamma.data(), kBeta.data(), running_mean.data(),
                              running_var.data(), mean.data(), invstd.data(), 4, 2, kMomentum,
                              kEps);
  const double invstd0 = 1 / std::sqrt(1.25 + 1e-5), invstd1 = 1 / std::sqrt(1.0 + 1e-5);
  std::vector<double> expected(8);
  for (int r = 0; r < 4; ++r) {
    expected[r * 2] = (kX[r * 2] - 2.5) * invstd0 * 2 + 0.1;
    expected[r * 2 + 1] = kX[r * 2 + 1] * invstd1 * 0.5 - 0.2;
  }
  // Float outputs of double formulas: a couple of ulps.
  EXPECT_ALL_CLOSE(y, expected, 1e-6, 1e-7);
  EXPECT_ALL_CLOSE(mean, (std::vector<double>{2.5, 0.0}), 1e-7, 0);
  EXPECT_ALL_CLOSE(invstd, (std::vector<double>{invstd0, invstd1}), 1e-6, 0);
  // running = 0.9 * running + 0.1 * batch statistic, the variance unbiased (rows / (rows - 1)).
  EXPECT_ALL_CLOSE(running_mean, (std::vector<double>{0.9 * 0.5 + 0.1 * 2.5, 0.9 * -1.0}), 1e-6, 0);
  EXPECT_ALL_CLOSE(running_var,
                   (std::vector<double>{0.9 * 2 + 0.1 * 5.0 / 3.0, 0.9 * 0.25 + 0.1 * 4.0 / 3.0}),
                   1e-6, 0);
}

TEST(BatchNormCpu, TrainingForwardWithoutAffineOrRunningStats) {
  std::vector<float> y(8, testing::kPoison);
  batchnorm_forward_train_cpu<float>(kX.data(), y.data(), nullptr, nullptr, nullptr, nullptr,
                                     nullptr, nullptr, 4, 2, kMomentum, kEps);
  const double invstd0 = 1 / std::sqrt(1.25 + 1e-5), invstd1 = 1 / std::sqrt(1.0 + 1e-5);
  std::vector<double> expected(8);
  for (int r = 0; r < 4; ++r) {
    expected[r * 2] = (kX[r * 2] - 2.5) * invstd0;
    expected[r * 2 + 1] = kX[r * 2 + 1] * invstd1;
  }
  EXPECT_ALL_CLOSE(y, expected, 1e-6, 1e-7);
}

TEST(BatchNormCpu, EvalForwardByHand) {
  const std::vector<float> running_mean = {0.5f, -1.f}, running_var = {2.f, 0.25f};
  std::vector<float> y(8, testing::kPoison);
  batchnorm_forward_eval_cpu(kX.data(), y.data(), kGamma.data(), kBeta.data(), running_mean.data(),
                             running_var.data(), 4, 2, kEps);
  std::vector<double> expected(8);
  for (int r = 0; r < 4; ++r) {
    expected[r * 2] = (kX[r * 2] - 0.5) / std::sqrt(2 + 1e-5) * 2 + 0.1;
    expected[r * 2 + 1] = (kX[r * 2 + 1] + 1.0) / std::sqrt(0.25 + 1e-5) * 0.5 - 0.2;
  }
  EXPECT_ALL_CLOSE(y, expected, 1e-6, 1e-7);
}

TEST(BatchNormCpu, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 2 * 3 * 3;
  const int c = 3;
  const std::vector<double> x0 = random_doubles(rows * c, 31, -2.0, 3.0);
  const std::vector<double> gamma0 = random_doubles(c, 32, 0.5, 1.5);
  const std::vector<double> beta0 = random_doubles(c, 33, -1.0, 1.0);
  const std::vector<double> w = random_doubles(rows * c, 34, -1.0, 1.0);  // dL/dy
  const double eps = 1e-5;

  // L(x, gamma, beta) = sum w * y.
  auto loss = [&](const std::vector<double>& x, const std::vector<double>& gamma,
                  const std::vector<double>& beta) {
    std::vector<double> y(x.size());
    batchnorm_forward_train_cpu<double>(x.data(), y.data(), gamma.data(), beta.data(), nullptr,
                                        nullptr, nullptr, nullptr, rows, c, 0.1, eps);
    double sum = 0;
    for (size_t i = 0; i < y.size(); ++i) sum += w[i] * y[i];
    return sum;
  };
  auto numeric = [&](std::vector<double> v,
                     const std::function<double(const std::vector<double>&)>& f) {
    std::vector<double> grad(v.size());
    const double h = 1e-6;
    for (size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i];
      v[i] = keep + h;
      const double up = f(v);
      v[i] = keep - h;
      const double down = f(v);
      v[i] = keep;
      grad[i] = (up - down) / (2 * h);
    }
    return grad;
  };

  std::vector<double> y(rows * c), mean(c), invstd(c);
  batchnorm_forward_train_cpu<double>(x0.data(), y.data(), gamma0.data(), beta0.data(), nullptr,
                                      nullptr, mean.data(), invstd.data(), rows, c, 0.1, eps);
  std::vector<double> dx(rows * c), dgamma(c), dbeta(c);
  batchnorm_backward_cpu<double>(x0.data(), w.data(), gamma0.data(), mean.data(), invstd.data(),
                                 dx.data(), dgamma.data(), dbeta.data(), rows, c, 0.0);

  // Smooth in every input: central differences with h = 1e-6 err by O(h^2) ~ 1e-12 plus rounding
  // ~ 1e-16 * |L| / h ~ 1e-9.
  const auto num_dx =
      numeric(x0, [&](const std::vector<double>& x) { return loss(x, gamma0, beta0); });
  const auto num_dgamma =
      numeric(gamma0, [&](const std::vector<double>& g) { return loss(x0, g, beta0); });
  const auto num_dbeta =
      numeric(beta0, [&](const std::vector<double>& b) { return loss(x0, gamma0, b); });
  EXPECT_ALL_CLOSE(to_float(dx), num_dx, 1e-6, 1e-7);
  EXPECT_ALL_CLOSE(to_float(dgamma), num_dgamma, 1e-6, 1e-7);
  EXPECT_ALL_CLOSE(to_float(dbeta), num_dbeta, 1e-6, 1e-7);

  // Without gamma (affine=False) dx is the gamma = 1 one.
  std::vector<double> ones(c, 1.0), dx_plain(rows * c), dx_ones(rows * c);
  batchnorm_backward_cpu<double>(x0.data(), w.data(), nullptr, mean.data(), invstd.data(),
                                 dx_plain.data(), nullptr, nullptr, rows, c, 0.0);
  batchnorm_backward_cpu<double>(x0.data(), w.data(), ones.data(), mean.data(), invstd.data(),
                                 dx_ones.data(), nullptr, nullptr, rows, c, 0.0);
  EXPECT_EQ(dx_plain, dx_ones);
}

TEST(BatchNormCpu, ParameterGradientsAccumulateWithBeta) {
  const int64_t rows = 6;
  const int c = 2;
  const std::vector<float> x = testing::random_vector(rows * c, 41);
  const std::vector<float> dy = testing::random_vector(rows * c, 42);
  std::vector<float> y(rows * c), mean(c), invstd(c), dx(rows * c);
  batchnorm_forward_train_cpu(x.data(), y.data(), kGamma.data(), kBeta.data(), nullptr, nullptr,
                              mean.data(), invstd.data(), rows, c, kMomentum, kEps);
  // beta 0 overwrites, even NaN: the old value is never read.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> g0 = {nan, nan}, b0 = {nan, nan};
  batchnorm_backward_cpu(x.data(), dy.data(), kGamma.data(), mean.data(), invstd.data(), dx.data(),
                         g0.data(), b0.data(), rows, c, 0.f);
  for (int ch = 0; ch < c; ++ch) EXPECT_TRUE(std::isfinite(g0[ch]) && std::isfinite(b0[ch]));
  // beta 1 adds, beta 0.5 halves the old value first.
  std::vector<float> g1 = {1.f, -2.f}, b1 = {3.f, 4.f};
  batchnorm_backward_cpu(x.data(), dy.data(), kGamma.data(), mean.data(), invstd.data(), dx.data(),
                         g1.data(), b1.data(), rows, c, 1.f);
  EXPECT_ALL_CLOSE(g1, (std::vector<double>{1.0 + g0[0], -2.0 + g0[1]}), 1e-6, 1e-7);
  EXPECT_ALL_CLOSE(b1, (std::vector<double>{3.0 + b0[0], 4.0 + b0[1]}), 1e-6, 1e-7);
  std::vector<float> g2 = {1.f, -2.f}, b2 = {3.f, 4.f};
  batchnorm_backward_cpu(x.data(), dy.data(), kGamma.data(), mean.data(), invstd.data(), dx.data(),
                         g2.data(), b2.data(), rows, c, 0.5f);
  EXPECT_ALL_CLOSE(g2, (std::vector<double>{0.5 + g0[0], -1.0 + g0[1]}), 1e-6, 1e-7);
  EXPECT_ALL_CLOSE(b2, (std::vector<double>{1.5 + b0[0], 2.0 + b0[1]}), 1e-6, 1e-7);
}

TEST(BatchNormCpu, BadArgumentsThrowValueErrorNamingTheValue) {
  std::vector<float> b(64);
  float* p = b.data();
  EXPECT_VALUE_ERROR(batchnorm_forward_train_cpu<float>(p, p, p, p, p, p, p, p, 1, 4, 0.1f, 1e-5f),
                     "expected more than 1 value per channel when training, got rows (N*H*W) = 1");
  EXPECT_VALUE_ERROR(batchnorm_forward_train_cpu<float>(p, p, p, p, p, p, p, p, 8, 0, 0.1f, 1e-5f),
                     "channels must be >= 1, got 0");
  EXPECT_VALUE_ERROR(batchnorm_forward_eval_cpu<float>(p, p, p, p, p, p, -1, 4, 1e-5f),
                     "rows (N*H*W) must be >= 0, got -1");
  EXPECT_VALUE_ERROR(batchnorm_backward_cpu<float>(p, p, p, p, p, p, p, p, 1, 4, 0.f),
                     "batchnorm_backward: expected more than 1 value per channel");
}

}  // namespace
}  // namespace cudp::kernels
