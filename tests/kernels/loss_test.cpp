// Host tests of the loss CPU references: a cross-entropy of known value, stability with large
// logits, finite differences of the backward in double, grad_scale, bad-label detection, argmax
// ties and NaN, accuracy counting and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/expect_error.h"
#include "engine/core/error.h"
#include "kernels/loss.h"

namespace cudp::kernels {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(CrossEntropyCpu, KnownValue) {
  // Row 0: log(e^1 + e^2 + e^3) - 3 = 0.40760596444438013; row 1: log 3 = 1.0986122886681098.
  const std::vector<float> logits = {1, 2, 3, 1, 1, 1};
  const std::vector<int32_t> labels = {2, 0};
  float loss = testing::kPoison;
  std::vector<float> probs(6, testing::kPoison);
  int bad = 0;
  softmax_cross_entropy_forward_cpu(logits.data(), labels.data(), &loss, probs.data(), 2, 3, &bad);
  EXPECT_NEAR(loss, 0.753109126556245, 1e-7);
  EXPECT_EQ(bad, 0);
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_ALL_CLOSE(probs,
                   (std::vector<double>{std::exp(1.0) / z, std::exp(2.0) / z, std::exp(3.0) / z,
                                        1 / 3.0, 1 / 3.0, 1 / 3.0}),
                   1e-6, 0);
}

TEST(CrossEntropyCpu, LargeLogitsAreStable) {
  // Shifting every logit of a row by 1000 changes nothing (e^1000 would overflow a naive sum).
  const std::vector<float> logits = {1001, 1002, 1003, -1000, -1000, -1000};
  const std::vector<int32_t> labels = {2, 0};
  float loss = 0;
  std::vector<float> probs(6);
  softmax_cross_entropy_forward_cpu(logits.data(), labels.data(), &loss, probs.data(), 2, 3,
                                    nullptr);
  EXPECT_NEAR(loss, 0.753109126556245, 1e-6);
}

TEST(CrossEntropyCpu, BackwardMatchesFiniteDifferences) {
  const int n = 4, classes = 7;
  const std::vector<float> f = testing::random_vector(n * classes, 51, -3.f, 3.f);
  const std::vector<double> logits(f.begin(), f.end());
  const std::vector<int32_t> labels = {0, 6, 3, 3};
  auto loss = [&](const std::vector<double>& x) {
    double value = 0;
    std::vector<double> probs(x.size());
    softmax_cross_entropy_forward_cpu<double>(x.data(), labels.data(), &value, probs.data(), n,
                                              classes, nullptr);
    return value;
  };
  double value = 0;
  std::vector<double> probs(n * classes), dlogits(n * classes);
  softmax_cross_entropy_forward_cpu<double>(logits.data(), labels.data(), &value, probs.data(), n,
                                            classes, nullptr);
  for (const double scale : {1.0, 0.375}) {
    SCOPED_TRACE(::testing::Message() << "grad_scale " << scale);
    softmax_cross_entropy_backward_cpu<double>(probs.data(), labels.data(), dlogits.data(), n,
                                               classes, scale);
    std::vector<double> numeric(n * classes);
    std::vector<double> x = logits;
    const double h = 1e-6;
    for (size_t i = 0; i < x.size(); ++i) {
      const double keep = x[i];
      x[i] = keep + h;
      const double up = loss(x);
      x[i] = keep - h;
      const double down = loss(x);
      x[i] = keep;
      numeric[i] = scale * (up - down) / (2 * h);
    }
    // Smooth: O(h^2) ~ 1e-12 plus rounding ~ 1e-16 / h = 1e-10.
    EXPECT_ALL_CLOSE(std::vector<float>(dlogits.begin(), dlogits.end()), numeric, 1e-6, 1e-8);
  }
}

TEST(CrossEntropyCpu, BadLabelsAreFlaggedAndPoisonTheirRows) {
  const std::vector<float> logits = {1, 2, 3, 1, 1, 1, 0, 5, 2};
  for (const int32_t bad_value : {3, -1}) {
    SCOPED_TRACE(::testing::Message() << "label " << bad_value);
    const std::vector<int32_t> labels = {2, bad_value, 1};
    float loss = 0;
    std::vector<float> probs(9), dlogits(9);
    int bad = 0;
    softmax_cross_entropy_forward_cpu(logits.data(), labels.data(), &loss, probs.data(), 3, 3,
                                      &bad);
    EXPECT_EQ(bad, 1);
    EXPECT_TRUE(std::isnan(loss));
    softmax_cross_entropy_backward_cpu(probs.data(), labels.data(), dlogits.data(), 3, 3, 1.f);
    for (int j = 0; j < 3; ++j) {
      EXPECT_TRUE(std::isfinite(dlogits[j]));
      EXPECT_TRUE(std::isnan(dlogits[3 + j]));
      EXPECT_TRUE(std::isfinite(dlogits[6 + j]));
    }
  }
}

TEST(ArgmaxCpu, TiesGoToTheFirstIndexAndNaNWins) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {
      1,    3,    3,    2,      // tie: 1
      7,    7,    7,    7,      // all equal: 0
      1,    kNaN, 5,    kNaN,   // the first NaN: 1
      -inf, -inf, -inf, -inf,   // 0
      -5,   -4,   -3,   -3.5f,  // 2
  };
  std::vector<int32_t> out(5, -7);
  argmax_rows_cpu(x.data(), out.data(), 5, 4);
  EXPECT_EQ(out, (std::vector<int32_t>{1, 0, 1, 0, 2}));
}

TEST(CountCorrectCpu, CountsMatches) {
  const std::vector<int32_t> pred = {1, 2, 3, 4, 5}, labels = {1, 0, 3, 4, 9};
  int count = -1;
  count_correct_cpu(pred.data(), labels.data(), 5, &count);
  EXPECT_EQ(count, 3);
  count_correct_cpu(pred.data(), labels.data(), 0, &count);
  EXPECT_EQ(count, 0);
}

TEST(LossCpu, BadArgumentsThrowValueErrorNamingTheValue) {
  std::vector<float> b(16);
  std::vector<int32_t> l(16);
  float* p = b.data();
  EXPECT_VALUE_ERROR(softmax_cross_entropy_forward_cpu(p, l.data(), p, p, 0, 3, nullptr),
                     "batch size must be >= 1 (the mean over an empty batch is undefined), got 0");
  EXPECT_VALUE_ERROR(softmax_cross_entropy_forward_cpu(p, l.data(), p, p, 2, 0, nullptr),
                     "number of classes must be >= 1, got 0");
  EXPECT_VALUE_ERROR(softmax_cross_entropy_backward_cpu(p, l.data(), p, -2, 3, 1.f),
                     "batch size must be >= 1 (the mean over an empty batch is undefined), got -2");
  EXPECT_VALUE_ERROR(argmax_rows_cpu(p, l.data(), -1, 3), "batch size must be >= 0, got -1");
  EXPECT_VALUE_ERROR(argmax_rows_cpu(p, l.data(), 70000, 70000), "70000 x 70000 logits exceed");
  EXPECT_VALUE_ERROR(count_correct_cpu(l.data(), l.data(), -3, l.data()), "n must be >= 0, got -3");
}

}  // namespace
}  // namespace cudp::kernels
