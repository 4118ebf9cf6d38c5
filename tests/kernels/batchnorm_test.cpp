// Host tests of the batch-normalisation CPU references: hand-computed training and evaluation
// forwards (with PyTorch's unbiased running variance), finite-difference checks of the backward in
// double (training and evaluation), the accumulate semantics of the parameter gradients, bf16
// storage (one rounding of the double result), the fused ReLU against ReLU's own kernels bit for
// bit, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/expect_error.h"
#include "engine/core/error.h"
#include "kernels/batchnorm.h"
#include "tests/kernels/batchnorm_testing.h"

namespace cudp::kernels {
namespace {

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
  batchnorm_backward_cpu<double>(x0.data(), w.data(), nullptr, gamma0.data(), mean.data(),
                                 invstd.data(), dx.data(), dgamma.data(), dbeta.data(), rows, c,
                                 0.0);

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
  batchnorm_backward_cpu<double>(x0.data(), w.data(), nullptr, nullptr, mean.data(), invstd.data(),
                                 dx_plain.data(), nullptr, nullptr, rows, c, 0.0);
  batchnorm_backward_cpu<double>(x0.data(), w.data(), nullptr, ones.data(), mean.data(),
                                 invstd.data(), dx_ones.data(), nullptr, nullptr, rows, c, 0.0);
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
  batchnorm_backward_cpu(x.data(), dy.data(), nullptr, kGamma.data(), mean.data(), invstd.data(),
                         dx.data(), g0.data(), b0.data(), rows, c, 0.f);
  for (int ch = 0; ch < c; ++ch) EXPECT_TRUE(std::isfinite(g0[ch]) && std::isfinite(b0[ch]));
  // beta 1 adds, beta 0.5 halves the old value first.
  std::vector<float> g1 = {1.f, -2.f}, b1 = {3.f, 4.f};
  batchnorm_backward_cpu(x.data(), dy.data(), nullptr, kGamma.data(), mean.data(), invstd.data(),
                         dx.data(), g1.data(), b1.data(), rows, c, 1.f);
  EXPECT_ALL_CLOSE(g1, (std::vector<double>{1.0 + g0[0], -2.0 + g0[1]}), 1e-6, 1e-7);
  EXPECT_ALL_CLOSE(b1, (std::vector<double>{3.0 + b0[0], 4.0 + b0[1]}), 1e-6, 1e-7);
  std::vector<float> g2 = {1.f, -2.f}, b2 = {3.f, 4.f};
  batchnorm_backward_cpu(x.data(), dy.data(), nullptr, kGamma.data(), mean.data(), invstd.data(),
                         dx.data(), g2.data(), b2.data(), rows, c, 0.5f);
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
  EXPECT_VALUE_ERROR(batchnorm_backward_cpu<float>(p, p, nullptr, p, p, p, p, p, p, 1, 4, 0.f),
                     "batchnorm_backward: expected more than 1 value per channel");
}

// Half a bf16 ulp at v: bf16 keeps 8 significant bits, so a value in [2^e, 2^(e+1)) is stored
// within 2^(e-8) when rounded to nearest.
double half_bf16_ulp(double v) {
  return std::ldexp(1.0, std::ilogb(v) - 8);
}

TEST(BatchNormCpu, Bf16StoresTheDoubleResultRoundedOnce) {
  using testing_bn::to_bf16;
  using testing_bn::to_float;
  const int64_t rows = 2 * 3 * 7;
  const int c = 5;
  // bf16 inputs; the double reference sees exactly the same values.
  const std::vector<float> xf = testing_bn::bf16_exact(testing::random_vector(rows * c, 51, -2, 3));
  const std::vector<float> dyf = testing_bn::bf16_exact(testing::random_vector(rows * c, 52));
  const std::vector<__nv_bfloat16> x = to_bf16(xf), dy = to_bf16(dyf);
  const std::vector<double> xd(xf.begin(), xf.end()), dyd(dyf.begin(), dyf.end());
  const std::vector<float> gamma = testing::random_vector(c, 53, 0.5f, 1.5f),
                           beta = testing::random_vector(c, 54);
  const std::vector<double> gammad(gamma.begin(), gamma.end()), betad(beta.begin(), beta.end());

  std::vector<__nv_bfloat16> y(rows * c);
  std::vector<float> rm(c, 0.25f), rv(c, 2.f), mean(c), invstd(c);
  batchnorm_forward_train_cpu(x.data(), y.data(), gamma.data(), beta.data(), rm.data(), rv.data(),
                              mean.data(), invstd.data(), rows, c, kMomentum, kEps);
  std::vector<double> yd(rows * c), rmd(c, 0.25), rvd(c, 2.0), meand(c), invstdd(c);
  batchnorm_forward_train_cpu<double>(xd.data(), yd.data(), gammad.data(), betad.data(), rmd.data(),
                                      rvd.data(), meand.data(), invstdd.data(), rows, c,
                                      double(kMomentum), double(kEps));
  // The statistics come from the same values in double, rounded once to float.
  for (int ch = 0; ch < c; ++ch) {
    EXPECT_EQ(mean[ch], float(meand[ch])) << ch;
    EXPECT_EQ(invstd[ch], float(invstdd[ch])) << ch;
    EXPECT_EQ(rm[ch], float(rmd[ch])) << ch;
    EXPECT_EQ(rv[ch], float(rvd[ch])) << ch;
  }
  // y: the double result rounded to nearest bf16, so within half a bf16 ulp of it.
  const std::vector<float> yf = to_float(y);
  for (size_t i = 0; i < yf.size(); ++i) {
    ASSERT_LE(std::fabs(double(yf[i]) - yd[i]), half_bf16_ulp(yd[i])) << i;
  }

  // Backward from the float statistics on both sides.
  const std::vector<double> mean_d(mean.begin(), mean.end()),
      invstd_d(invstd.begin(), invstd.end());
  std::vector<__nv_bfloat16> dx(rows * c);
  std::vector<float> dgamma(c), dbeta(c);
  batchnorm_backward_cpu(x.data(), dy.data(), nullptr, gamma.data(), mean.data(), invstd.data(),
                         dx.data(), dgamma.data(), dbeta.data(), rows, c, 0.f);
  std::vector<double> dxd(rows * c), dgammad(c), dbetad(c);
  batchnorm_backward_cpu<double>(xd.data(), dyd.data(), nullptr, gammad.data(), mean_d.data(),
                                 invstd_d.data(), dxd.data(), dgammad.data(), dbetad.data(), rows,
                                 c, 0.0);
  for (int ch = 0; ch < c; ++ch) {
    EXPECT_EQ(dgamma[ch], float(dgammad[ch])) << ch;
    EXPECT_EQ(dbeta[ch], float(dbetad[ch])) << ch;
  }
  const std::vector<float> dxf = to_float(dx);
  for (size_t i = 0; i < dxf.size(); ++i) {
    ASSERT_LE(std::fabs(double(dxf[i]) - dxd[i]), half_bf16_ulp(dxd[i])) << i;
  }
}

// The fused ReLU against ReLU's own kernels after an unfused forward, and before an unfused
// backward: the same bits, for f32 and bf16 storage, in training and evaluation.
template <typename T>
void expect_fused_relu_is_relu(uint64_t seed) {
  using testing_bn::bitwise_equal;
  const int64_t rows = 3 * 5 * 3;
  const int c = 7;
  using testing_bn::floats;
  using testing_bn::stored;
  const std::vector<T> x = stored<T>(testing::random_vector(rows * c, seed, -2, 3));
  const std::vector<T> dy = stored<T>(testing::random_vector(rows * c, seed + 1));
  const std::vector<float> gamma = testing::random_vector(c, seed + 2, 0.5f, 1.5f);
  const std::vector<float> beta = testing::random_vector(c, seed + 3, -0.5f, 0.5f);
  const std::vector<float> rm = testing::random_vector(c, seed + 4),
                           rv = testing::random_vector(c, seed + 5, 0.5f, 2.f);
  for (const bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "evaluation");
    std::vector<T> y(rows * c), y_relu(rows * c);
    std::vector<float> mean(c), invstd(c), rm1 = rm, rv1 = rv, rm2 = rm, rv2 = rv;
    if (training) {
      batchnorm_forward_train_cpu(x.data(), y.data(), gamma.data(), beta.data(), rm1.data(),
                                  rv1.data(), mean.data(), invstd.data(), rows, c, kMomentum, kEps);
      batchnorm_forward_train_cpu(x.data(), y_relu.data(), gamma.data(), beta.data(), rm2.data(),
                                  rv2.data(), mean.data(), invstd.data(), rows, c, kMomentum, kEps,
                                  BnActivation::relu);
      EXPECT_TRUE(bitwise_equal(rm1, rm2));
      EXPECT_TRUE(bitwise_equal(rv1, rv2));
    } else {
      batchnorm_forward_eval_cpu(x.data(), y.data(), gamma.data(), beta.data(), rm.data(),
                                 rv.data(), rows, c, kEps);
      batchnorm_forward_eval_cpu(x.data(), y_relu.data(), gamma.data(), beta.data(), rm.data(),
                                 rv.data(), rows, c, kEps, BnActivation::relu);
    }
    const std::vector<float> yr = floats(y_relu);
    ASSERT_GT(testing_bn::clamped(yr), yr.size() / 8);
    ASSERT_LT(testing_bn::clamped(yr), yr.size() * 7 / 8);
    EXPECT_TRUE(bitwise_equal(yr, testing_bn::relu_of(floats(y))));

    // Backward: masking inside == ReLU's backward first, then the plain backward.
    const std::vector<T> dy_masked = stored<T>(testing_bn::relu_grad_of(yr, floats(dy)));
    std::vector<T> dx1(rows * c), dx2(rows * c);
    std::vector<float> dg1(c), db1(c), dg2(c), db2(c);
    if (training) {
      batchnorm_backward_cpu(x.data(), dy.data(), y_relu.data(), gamma.data(), mean.data(),
                             invstd.data(), dx1.data(), dg1.data(), db1.data(), rows, c, 0.f);
      batchnorm_backward_cpu(x.data(), dy_masked.data(), nullptr, gamma.data(), mean.data(),
                             invstd.data(), dx2.data(), dg2.data(), db2.data(), rows, c, 0.f);
    } else {
      batchnorm_backward_eval_cpu(x.data(), dy.data(), y_relu.data(), gamma.data(), rm.data(),
                                  rv.data(), dx1.data(), dg1.data(), db1.data(), rows, c, kEps,
                                  0.f);
      batchnorm_backward_eval_cpu(x.data(), dy_masked.data(), nullptr, gamma.data(), rm.data(),
                                  rv.data(), dx2.data(), dg2.data(), db2.data(), rows, c, kEps,
                                  0.f);
    }
    EXPECT_TRUE(bitwise_equal(floats(dx1), floats(dx2)));
    EXPECT_TRUE(bitwise_equal(dg1, dg2));
    EXPECT_TRUE(bitwise_equal(db1, db2));
  }
}

TEST(BatchNormCpu, FusedReluIsReluBitForBitF32) {
  expect_fused_relu_is_relu<float>(61);
}

TEST(BatchNormCpu, FusedReluIsReluBitForBitBf16) {
  expect_fused_relu_is_relu<__nv_bfloat16>(71);
}

// With frozen statistics the map is affine in x, gamma and beta: central differences in double are
// exact up to rounding (~1e-16 * |L| / h).
TEST(BatchNormCpu, EvalBackwardMatchesFiniteDifferences) {
  const int64_t rows = 2 * 3 * 2;
  const int c = 3;
  const std::vector<double> x0 = random_doubles(rows * c, 81, -2.0, 3.0);
  const std::vector<double> gamma0 = random_doubles(c, 82, 0.5, 1.5);
  const std::vector<double> beta0 = random_doubles(c, 83, -1.0, 1.0);
  const std::vector<double> rm = random_doubles(c, 84, -1.0, 1.0),
                            rv = random_doubles(c, 85, 0.5, 2);
  const std::vector<double> w = random_doubles(rows * c, 86, -1.0, 1.0);
  const double eps = 1e-5;
  auto loss = [&](const std::vector<double>& x, const std::vector<double>& gamma,
                  const std::vector<double>& beta) {
    std::vector<double> y(x.size());
    batchnorm_forward_eval_cpu<double>(x.data(), y.data(), gamma.data(), beta.data(), rm.data(),
                                       rv.data(), rows, c, eps);
    double sum = 0;
    for (size_t i = 0; i < y.size(); ++i) sum += w[i] * y[i];
    return sum;
  };
  auto numeric = [](std::vector<double> v,
                    const std::function<double(const std::vector<double>&)>& f) {
    std::vector<double> grad(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i], h = 1e-3;
      v[i] = keep + h;
      const double up = f(v);
      v[i] = keep - h;
      grad[i] = (up - f(v)) / (2 * h);
      v[i] = keep;
    }
    return grad;
  };
  std::vector<double> dx(rows * c), dgamma(c), dbeta(c);
  batchnorm_backward_eval_cpu<double>(x0.data(), w.data(), nullptr, gamma0.data(), rm.data(),
                                      rv.data(), dx.data(), dgamma.data(), dbeta.data(), rows, c,
                                      eps, 0.0);
  EXPECT_ALL_CLOSE(to_float(dx), numeric(x0, [&](const auto& x) { return loss(x, gamma0, beta0); }),
                   1e-6, 1e-9);
  EXPECT_ALL_CLOSE(to_float(dgamma),
                   numeric(gamma0, [&](const auto& g) { return loss(x0, g, beta0); }), 1e-6, 1e-9);
  EXPECT_ALL_CLOSE(to_float(dbeta),
                   numeric(beta0, [&](const auto& b) { return loss(x0, gamma0, b); }), 1e-6, 1e-9);
}

TEST(BatchNormCpu, EvalBackwardArgumentErrors) {
  std::vector<float> b(64);
  float* p = b.data();
  EXPECT_VALUE_ERROR(
      batchnorm_backward_eval_cpu<float>(p, p, nullptr, p, nullptr, p, p, p, p, 4, 4, 1e-5f, 0.f),
      "batchnorm_backward_eval: needs running_mean and running_var");
  EXPECT_VALUE_ERROR(
      batchnorm_backward_eval_cpu<float>(p, p, nullptr, p, p, p, p, p, p, -1, 4, 1e-5f, 0.f),
      "rows (N*H*W) must be >= 0, got -1");
}

}  // namespace
}  // namespace cudp::kernels
