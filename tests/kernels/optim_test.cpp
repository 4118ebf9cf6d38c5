// Host tests of the optimizer CPU references: SGD (plain, momentum, dampening, Nesterov, weight
// decay) and AdamW over several steps against the formulas unrolled in double, exact small cases,
// norms and clipping, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/expect_error.h"
#include "engine/core/error.h"
#include "kernels/optim.h"

namespace cudp::kernels {
namespace {

TEST(SgdCpu, ExactSmallSteps) {
  // Powers of two keep every intermediate exact in fp32 (worked by hand):
  // p = 1, lr = 0.25, wd = 0.5, momentum = 0.5, grads 0.5 then 0.25.
  //   step 1: g = 0.5 + 0.5 * 1 = 1, buf = 1, p = 1 - 0.25 = 0.75
  //   step 2: g = 0.25 + 0.5 * 0.75 = 0.625, buf = 0.5 * 1 + 0.625 = 1.125,
  //           p = 0.75 - 0.25 * 1.125 = 0.46875
  // Nesterov: step 1 g = 1 + 0.5 * 1 = 1.5, p = 0.625; step 2 g = 0.25 + 0.3125 = 0.5625,
  //           buf = 0.5 + 0.5625 = 1.0625, g = 0.5625 + 0.53125 = 1.09375, p = 0.3515625
  for (const bool nesterov : {false, true}) {
    float p = 1.f, buf = 12345.f;  // a first step never reads buf
    float g = 0.5f;
    sgd_step_cpu(&p, &g, &buf, 1, 0.25, 0.5, 0.0, 0.5, nesterov, true);
    EXPECT_EQ(p, nesterov ? 0.625f : 0.75f);
    EXPECT_EQ(buf, 1.f);
    g = 0.25f;
    sgd_step_cpu(&p, &g, &buf, 1, 0.25, 0.5, 0.0, 0.5, nesterov, false);
    EXPECT_EQ(buf, nesterov ? 1.0625f : 1.125f);
    EXPECT_EQ(p, nesterov ? 0.3515625f : 0.46875f);
  }
}

struct SgdConfig {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
};

TEST(SgdCpu, SeveralStepsMatchTheFormulaInDouble) {
  const int n = 37, steps = 5;
  for (const SgdConfig& cfg :
       {SgdConfig{0.1, 0, 0, 0, false}, SgdConfig{0.05, 0, 0, 5e-4, false},
        SgdConfig{0.05, 0.9, 0, 5e-4, false}, SgdConfig{0.05, 0.9, 0.1, 1e-2, false},
        SgdConfig{0.05, 0.9, 0, 5e-4, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << "lr " << cfg.lr << " momentum " << cfg.momentum << " dampening "
                 << cfg.dampening << " wd " << cfg.weight_decay << " nesterov " << cfg.nesterov);
    std::vector<float> p = testing::random_vector(n, 61), buf(n, 0.f);
    std::vector<double> pd(p.begin(), p.end()), bufd(n, 0.0);
    for (int t = 0; t < steps; ++t) {
      const std::vector<float> grad = testing::random_vector(n, 62 + t);
      sgd_step_cpu(p.data(), grad.data(), cfg.momentum != 0 ? buf.data() : nullptr, n, cfg.lr,
                   cfg.momentum, cfg.dampening, cfg.weight_decay, cfg.nesterov, t == 0);
      for (int i = 0; i < n; ++i) {  // torch.optim.SGD's documented algorithm
        double g = grad[i] + cfg.weight_decay * pd[i];
        if (cfg.momentum != 0) {
          bufd[i] = t == 0 ? g : cfg.momentum * bufd[i] + (1 - cfg.dampening) * g;
          g = cfg.nesterov ? g + cfg.momentum * bufd[i] : bufd[i];
        }
        pd[i] -= cfg.lr * g;
      }
    }
    // fp32 against double after 5 steps of O(1) values: ~10 roundings of 6e-8 each per element.
    EXPECT_ALL_CLOSE(p, pd, 2e-6, 2e-6);
    if (cfg.momentum != 0) {
      EXPECT_ALL_CLOSE(buf, bufd, 2e-6, 2e-6);
    }
  }
}

TEST(AdamWCpu, SeveralStepsMatchTheFormulaInDouble) {
  const int n = 41, steps = 6;
  const double lr = 1e-2, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  for (const double wd : {0.0, 0.1}) {
    SCOPED_TRACE(::testing::Message() << "weight_decay " << wd);
    std::vector<float> p = testing::random_vector(n, 71), m(n, 0.f), v(n, 0.f);
    std::vector<double> pd(p.begin(), p.end()), md(n, 0.0), vd(n, 0.0);
    for (int t = 1; t <= steps; ++t) {
      const std::vector<float> grad = testing::random_vector(n, 72 + t);
      adamw_step_cpu(p.data(), grad.data(), m.data(), v.data(), n, lr, beta1, beta2, eps, wd, t);
      const double bc1 = 1 - std::pow(beta1, t), bc2 = 1 - std::pow(beta2, t);
      for (int i = 0; i < n; ++i) {  // torch.optim.AdamW's documented algorithm
        pd[i] *= 1 - lr * wd;
        md[i] = beta1 * md[i] + (1 - beta1) * grad[i];
        vd[i] = beta2 * vd[i] + (1 - beta2) * double(grad[i]) * grad[i];
        pd[i] -= lr / bc1 * md[i] / (std::sqrt(vd[i]) / std::sqrt(bc2) + eps);
      }
    }
    // Each step moves p by ~lr with a relative fp32 error of a few ulps; p itself is O(1).
    EXPECT_ALL_CLOSE(p, pd, 1e-6, 1e-6);
    EXPECT_ALL_CLOSE(m, md, 1e-5, 1e-7);
    EXPECT_ALL_CLOSE(v, vd, 1e-5, 1e-9);
  }
}

TEST(AdamWCpu, FirstStepMovesEachParameterByLrTimesTheSignOfItsGradient) {
  // Step 1 from zero moments: m = 0.1 g, v = 0.001 g^2, bias corrections 0.1 and 0.001, so the
  // update is lr * g / (|g| + eps), after the decoupled decay p *= 1 - lr * wd.
  const std::vector<float> grad = {0.5f, -2.f, 1e-3f};
  std::vector<float> p = {1.f, 1.f, -1.f}, m(3, 0.f), v(3, 0.f);
  adamw_step_cpu(p.data(), grad.data(), m.data(), v.data(), 3, 0.01, 0.9, 0.999, 1e-8, 0.5, 1);
  const double decay = 1 - 0.01 * 0.5;
  for (int i = 0; i < 3; ++i) {
    const double g = grad[i];
    const double expected = (i == 2 ? -1.0 : 1.0) * decay - 0.01 * g / (std::fabs(g) + 1e-8);
    EXPECT_NEAR(p[i], expected, 2e-7) << i;
  }
}

TEST(NormCpu, SumOfSquaresNormAndClipping) {
  std::vector<float> x = {3.f, 4.f};
  float s = 0, norm = 0;
  sum_of_squares_cpu(x.data(), 2, &s);
  global_norm_cpu(x.data(), 2, &norm);
  EXPECT_EQ(s, 25.f);
  EXPECT_EQ(norm, 5.f);
  // max_norm 10 > norm: coefficient clamped to exactly 1, gradients untouched.
  clip_grad_norm_cpu(x.data(), 2, 10.f, &norm);
  EXPECT_EQ(x, (std::vector<float>{3.f, 4.f}));
  // max_norm 1: scaled by 1 / (5 + 1e-6).
  clip_grad_norm_cpu(x.data(), 2, 1.f, &norm);
  EXPECT_EQ(norm, 5.f);
  EXPECT_NEAR(x[0], 0.6, 1e-6);
  EXPECT_NEAR(x[1], 0.8, 1e-6);
  // A NaN norm poisons the gradients, as torch.clamp propagates NaN.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  scale_by_clip_coefficient_cpu(x.data(), 2, &nan, 1.f);
  EXPECT_TRUE(std::isnan(x[0]) && std::isnan(x[1]));
  // An empty buffer has norm 0.
  sum_of_squares_cpu(x.data(), 0, &s);
  EXPECT_EQ(s, 0.f);
}

// ---- gated steps (StepGate) ---------------------------------------------------------------------

// A gated run issues calls 0..4 and skips calls 0 and 2 (flags on the "device", here host memory),
// counting the skips with count_skipped_step as Optimizer does and never folding them, so every
// later call corrects its count by the skips (StepGate::skipped - folded). A skipped call must
// leave every byte as it was, even with NaN gradients; the taken calls must equal, bit for bit,
// ungated calls that never saw the skipped ones (SGD's first step is call 1; AdamW's step 1 is
// call 1, with the bias corrections of step 1, not 2).
TEST(GatedStepCpu, SkippedCallsWriteNothingAndDoNotCount) {
  const int n = 29;
  const std::vector<int32_t> skips = {1, 0, 1, 0, 0};
  const std::vector<float> nans(n, std::nanf(""));
  for (const SgdConfig& cfg :
       {SgdConfig{0.05, 0.9, 0.1, 1e-2, false}, SgdConfig{0.05, 0.9, 0, 5e-4, true},
        SgdConfig{0.1, 0, 0, 0, false}}) {
    SCOPED_TRACE(::testing::Message() << "SGD momentum " << cfg.momentum << " nesterov "
                                      << cfg.nesterov);
    std::vector<float> p = testing::random_vector(n, 11), buf(n, testing::kPoison);
    std::vector<float> rp = p, rbuf = buf;
    int64_t counts[2] = {0, 0};
    int64_t issued = 0, taken = 0;
    for (size_t t = 0; t < skips.size(); ++t) {
      const std::vector<float> grad = testing::random_vector(n, 20 + t);
      const StepGate gate{&skips[t], &counts[1], 0};
      const std::vector<float> p_before = p, buf_before = buf;
      sgd_step_cpu(p.data(), skips[t] ? nans.data() : grad.data(), buf.data(), n, cfg.lr,
                   cfg.momentum, cfg.dampening, cfg.weight_decay, cfg.nesterov, issued, gate);
      count_skipped_step_cpu(&skips[t], counts, cfg.momentum != 0);
      if (cfg.momentum != 0) ++issued;
      if (skips[t]) {
        EXPECT_EQ(std::memcmp(p.data(), p_before.data(), n * sizeof(float)), 0) << "call " << t;
        EXPECT_EQ(std::memcmp(buf.data(), buf_before.data(), n * sizeof(float)), 0) << t;
        continue;
      }
      sgd_step_cpu(rp.data(), grad.data(), rbuf.data(), n, cfg.lr, cfg.momentum, cfg.dampening,
                   cfg.weight_decay, cfg.nesterov, taken++ == 0);
      EXPECT_EQ(std::memcmp(p.data(), rp.data(), n * sizeof(float)), 0) << "call " << t;
      EXPECT_EQ(std::memcmp(buf.data(), rbuf.data(), n * sizeof(float)), 0) << "call " << t;
    }
    EXPECT_EQ(counts[0], 2);
    EXPECT_EQ(counts[1], cfg.momentum != 0 ? 2 : 0);
  }

  // AdamW, also against torch.optim.AdamW's formula in double over the steps taken.
  const double lr = 1e-2, beta1 = 0.8, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  std::vector<float> p = testing::random_vector(n, 12), m(n, 0.f), v(n, 0.f);
  std::vector<float> rp = p, rm = m, rv = v;
  std::vector<double> pd(p.begin(), p.end()), md(n, 0.0), vd(n, 0.0);
  int64_t counts[2] = {0, 0};
  int taken = 0;
  for (size_t t = 0; t < skips.size(); ++t) {
    const std::vector<float> grad = testing::random_vector(n, 30 + t);
    const StepGate gate{&skips[t], &counts[1], 0};
    const std::vector<float> before = p;
    adamw_step_cpu(p.data(), skips[t] ? nans.data() : grad.data(), m.data(), v.data(), n, lr,
                   beta1, beta2, eps, wd, int64_t(t) + 1, gate);
    count_skipped_step_cpu(&skips[t], counts, true);
    if (skips[t]) {
      EXPECT_EQ(std::memcmp(p.data(), before.data(), n * sizeof(float)), 0) << "call " << t;
      continue;
    }
    ++taken;
    adamw_step_cpu(rp.data(), grad.data(), rm.data(), rv.data(), n, lr, beta1, beta2, eps, wd,
                   taken);
    EXPECT_EQ(std::memcmp(p.data(), rp.data(), n * sizeof(float)), 0) << "call " << t;
    EXPECT_EQ(std::memcmp(m.data(), rm.data(), n * sizeof(float)), 0) << "call " << t;
    EXPECT_EQ(std::memcmp(v.data(), rv.data(), n * sizeof(float)), 0) << "call " << t;
    const double bc1 = 1 - std::pow(beta1, taken), bc2 = 1 - std::pow(beta2, taken);
    for (int i = 0; i < n; ++i) {
      pd[i] *= 1 - lr * wd;
      md[i] = beta1 * md[i] + (1 - beta1) * grad[i];
      vd[i] = beta2 * vd[i] + (1 - beta2) * double(grad[i]) * grad[i];
      pd[i] -= lr / bc1 * md[i] / (std::sqrt(vd[i]) / std::sqrt(bc2) + eps);
    }
  }
  EXPECT_ALL_CLOSE(p, pd, 1e-6, 1e-6);
  EXPECT_EQ(counts[0], 2);
  EXPECT_EQ(counts[1], 2);
  // Folded (the caller took the skips out of its count): the same step with the caller's count.
  const std::vector<float> grad = testing::random_vector(n, 40);
  const int32_t go = 0;
  std::vector<float> q = p, qm = m, qv = v;
  adamw_step_cpu(p.data(), grad.data(), m.data(), v.data(), n, lr, beta1, beta2, eps, wd, 6,
                 StepGate{&go, &counts[1], 0});
  adamw_step_cpu(q.data(), grad.data(), qm.data(), qv.data(), n, lr, beta1, beta2, eps, wd, 4,
                 StepGate{&go, &counts[1], 2});
  EXPECT_EQ(std::memcmp(p.data(), q.data(), n * sizeof(float)), 0);
}

TEST(GatedStepCpu, NonfiniteFlag) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  const auto flag = [](float a, const float* b) {
    int32_t f = -1;
    nonfinite_flag_cpu(&a, b, &f);
    return f;
  };
  const float one = 1.f, big = 3e38f;
  EXPECT_EQ(flag(2.f, &big), 0);
  EXPECT_EQ(flag(-0.f, nullptr), 0);
  EXPECT_EQ(flag(nan, &one), 1);
  EXPECT_EQ(flag(1.f, &inf), 1);
  const float minus_inf = -inf;
  EXPECT_EQ(flag(1.f, &minus_inf), 1);
  EXPECT_EQ(flag(-inf, nullptr), 1);
}

TEST(OptimCpu, BadArgumentsThrowValueErrorNamingTheValue) {
  std::vector<float> b(8);
  float* p = b.data();
  EXPECT_VALUE_ERROR(sgd_step_cpu(p, p, p, 8, -0.1, 0.9, 0, 0, false, true),
                     "Invalid learning rate: -0.1");
  EXPECT_VALUE_ERROR(sgd_step_cpu(p, p, p, 8, 0.1, -0.5, 0, 0, false, true),
                     "Invalid momentum value: -0.5");
  EXPECT_VALUE_ERROR(sgd_step_cpu(p, p, p, 8, 0.1, 0.9, 0, -1e-4, false, true),
                     "Invalid weight_decay value: -0.0001");
  EXPECT_VALUE_ERROR(sgd_step_cpu(p, p, p, 8, 0.1, 0.9, 0.1, 0, true, true),
                     "Nesterov momentum requires a momentum and zero dampening (momentum 0.9, "
                     "dampening 0.1)");
  EXPECT_VALUE_ERROR(sgd_step_cpu(p, p, nullptr, 8, 0.1, 0.9, 0, 0, false, true),
                     "momentum 0.9 needs a momentum buffer");
  EXPECT_VALUE_ERROR(sgd_step_cpu(p, p, p, -8, 0.1, 0.9, 0, 0, false, true),
                     "n must be >= 0, got -8");
  EXPECT_VALUE_ERROR(adamw_step_cpu(p, p, p, p, 8, 1e-3, 1.0, 0.999, 1e-8, 0, 1),
                     "Invalid beta parameter at index 0: 1");
  EXPECT_VALUE_ERROR(adamw_step_cpu(p, p, p, p, 8, 1e-3, 0.9, -0.1, 1e-8, 0, 1),
                     "Invalid beta parameter at index 1: -0.1");
  EXPECT_VALUE_ERROR(adamw_step_cpu(p, p, p, p, 8, 1e-3, 0.9, 0.999, -1e-8, 0, 1),
                     "Invalid epsilon value: -1e-08");
  EXPECT_VALUE_ERROR(adamw_step_cpu(p, p, p, p, 8, 1e-3, 0.9, 0.999, 1e-8, 0, 0),
                     "step counts from 1, got 0");
  EXPECT_VALUE_ERROR(global_norm_cpu(p, -1, p), "global_norm: n must be >= 0, got -1");
}

}  // namespace
}  // namespace cudp::kernels
