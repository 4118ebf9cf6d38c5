// Host tests of the conv2d CPU references (kernels/conv2d.h) and of the argument checks shared with
// the GPU launchers:
//   - hand-computed outputs and gradients of tiny convolutions;
//   - the forward reference against an independent formula (explicitly zero-padded input, double);
//   - the backward references against finite differences of that formula: L = sum(y * g) is
//     linear in x and in w, so a central difference is exact up to double rounding, and the
//     references must agree to their own float rounding;
//   - shape validation and the launchers' errors, which are raised before any CUDA call.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "engine/core/error.h"
#include "kernels/conv2d.h"

namespace cudp::kernels {
namespace {

std::string describe(const Conv2dShape& s) {
  return cudp::detail::str("n", s.n, " h", s.h, " w", s.w, " c", s.c, " k", s.k, " r", s.r, " s", s.s,
                     " stride ", s.stride_h, "x", s.stride_w, " pad ", s.pad_h, "x", s.pad_w);
}

// y (NHWC) of the convolution, computed on a zero-padded copy of x so that no tap needs a bounds
// check: a formulation independent of the reference's.
std::vector<double> direct_forward(const Conv2dShape& s, const std::vector<double>& x,
                                   const std::vector<double>& w) {
  const int hp = s.h + 2 * s.pad_h, wp = s.w + 2 * s.pad_w, P = s.p(), Q = s.q();
  std::vector<double> padded(size_t(s.n) * hp * wp * s.c, 0.0);
  for (int n = 0; n < s.n; ++n)
    for (int h = 0; h < s.h; ++h)
      for (int v = 0; v < s.w; ++v)
        for (int c = 0; c < s.c; ++c)
          padded[((size_t(n) * hp + h + s.pad_h) * wp + v + s.pad_w) * s.c + c] =
              x[((size_t(n) * s.h + h) * s.w + v) * s.c + c];
  std::vector<double> y(size_t(s.n) * P * Q * s.k, 0.0);
  for (int n = 0; n < s.n; ++n)
    for (int p = 0; p < P; ++p)
      for (int q = 0; q < Q; ++q)
        for (int k = 0; k < s.k; ++k) {
          double acc = 0.0;
          for (int r = 0; r < s.r; ++r)
            for (int t = 0; t < s.s; ++t)
              for (int c = 0; c < s.c; ++c)
                acc +=
                    padded[((size_t(n) * hp + p * s.stride_h + r) * wp + q * s.stride_w + t) * s.c +
                           c] *
                    w[((size_t(k) * s.r + r) * s.s + t) * s.c + c];
          y[((size_t(n) * P + p) * Q + q) * s.k + k] = acc;
        }
  return y;
}

std::vector<double> to_double(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

// d/dv of L(v) = sum(direct_forward(...) * g) by central differences, where `forward` evaluates
// the convolution with v substituted. L is linear in v, so any step gives the exact derivative up
// to rounding.
std::vector<double> finite_difference(
    std::vector<double> v, const std::vector<double>& g,
    const std::function<std::vector<double>(const std::vector<double>&)>& forward) {
  const auto loss = [&](const std::vector<double>& at) {
    const std::vector<double> y = forward(at);
    double sum = 0.0;
    for (size_t i = 0; i < y.size(); ++i) sum += y[i] * g[i];
    return sum;
  };
  constexpr double kStep = 0.5;
  std::vector<double> grad(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const double saved = v[i];
    v[i] = saved + kStep;
    const double up = loss(v);
    v[i] = saved - kStep;
    const double down = loss(v);
    v[i] = saved;
    grad[i] = (up - down) / (2 * kStep);
  }
  return grad;
}

// Small shapes that cover strides, paddings (including more padding than the filter reaches),
// non-square images and filters, and 1x1 filters.
const Conv2dShape kShapes[] = {
    {2, 5, 6, 3, 4, 3, 3, 1, 1, 1, 1}, {1, 7, 6, 2, 3, 3, 2, 2, 1, 1, 0},
    {2, 6, 5, 3, 2, 2, 3, 2, 2, 2, 1}, {1, 4, 4, 5, 3, 1, 1, 1, 1, 0, 0},
    {3, 5, 5, 1, 2, 5, 5, 1, 1, 2, 2}, {1, 8, 3, 2, 2, 3, 1, 3, 1, 0, 1},
};

// ---- shape --------------------------------------------------------------------------------------

TEST(Conv2dShape, OutputSize) {
  const Conv2dShape vgg{64, 224, 224, 3, 64, 3, 3, 1, 1, 1, 1};
  EXPECT_EQ(vgg.p(), 224);
  EXPECT_EQ(vgg.q(), 224);
  const Conv2dShape strided{1, 7, 8, 1, 1, 3, 2, 2, 3, 1, 0};
  EXPECT_EQ(strided.p(), 4);  // (7 + 2 - 3) / 2 + 1
  EXPECT_EQ(strided.q(), 3);  // (8 + 0 - 2) / 3 + 1
  EXPECT_DOUBLE_EQ(vgg.flops(), 2.0 * 64 * 224 * 224 * 64 * 3 * 3 * 3);
  EXPECT_NO_THROW(vgg.validate());
}

TEST(Conv2dShape, ValidateNamesTheBadField) {
  const Conv2dShape good{2, 5, 5, 3, 4, 3, 3, 1, 1, 1, 1};
  struct Bad {
    std::function<void(Conv2dShape&)> change;
    const char* named;
  };
  const Bad cases[] = {
      {[](Conv2dShape& s) { s.n = 0; }, "n must be positive"},
      {[](Conv2dShape& s) { s.h = -1; }, "h must be positive"},
      {[](Conv2dShape& s) { s.w = 0; }, "w must be positive"},
      {[](Conv2dShape& s) { s.c = 0; }, "c must be positive"},
      {[](Conv2dShape& s) { s.k = 0; }, "k must be positive"},
      {[](Conv2dShape& s) { s.r = 0; }, "r must be positive"},
      {[](Conv2dShape& s) { s.s = -3; }, "s must be positive"},
      {[](Conv2dShape& s) { s.stride_h = 0; }, "stride_h must be positive"},
      {[](Conv2dShape& s) { s.stride_w = -1; }, "stride_w must be positive"},
      {[](Conv2dShape& s) { s.pad_h = -1; }, "pad_h must be non-negative"},
      {[](Conv2dShape& s) { s.pad_w = -2; }, "pad_w must be non-negative"},
      {[](Conv2dShape& s) { s.r = 8; }, "output height p"},  // 5 + 2 < 8
      {[](Conv2dShape& s) { s.s = 6, s.pad_w = 0; }, "output width q"},
      {[](Conv2dShape& s) { s.pad_h = 1 << 30; }, "h + 2*pad_h"},
      {[](Conv2dShape& s) { s.n = 1 << 16, s.h = s.w = 1 << 8; }, "n*h*w"},
      {[](Conv2dShape& s) { s.c = 1 << 27; }, "r*s*c"},
      {[](Conv2dShape& s) { s.k = 1 << 27; }, "r*s*k"},
  };
  for (const Bad& bad : cases) {
    Conv2dShape shape = good;
    bad.change(shape);
    try {
      shape.validate();
      ADD_FAILURE() << "no error for a shape with bad " << bad.named;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(bad.named), std::string::npos) << e.what();
    }
  }
}

// ---- hand-computed cases ------------------------------------------------------------------------

// x = 1..9 as a 3x3 single-channel image (row-major), used by the cases below.
const std::vector<float> kNine = {1, 2, 3, 4, 5, 6, 7, 8, 9};

TEST(Conv2dForwardCpu, HandComputedDifferenceFilter) {
  // w = [[1, 0], [0, -1]]: y[p][q] = x[p][q] - x[p+1][q+1] = -4 everywhere.
  const Conv2dShape s{1, 3, 3, 1, 1, 2, 2, 1, 1, 0, 0};
  const std::vector<float> w = {1, 0, 0, -1};
  std::vector<float> y(4);
  conv2d_forward_cpu(s, kNine.data(), w.data(), nullptr, y.data(), false);
  EXPECT_EQ(y, (std::vector<float>{-4, -4, -4, -4}));
  const float bias = 5.5f;
  conv2d_forward_cpu(s, kNine.data(), w.data(), &bias, y.data(), false);
  EXPECT_EQ(y, (std::vector<float>{1.5f, 1.5f, 1.5f, 1.5f}));
  const float small_bias = 1.0f;
  conv2d_forward_cpu(s, kNine.data(), w.data(), &small_bias, y.data(), true);  // relu(-3) = 0
  EXPECT_EQ(y, (std::vector<float>{0, 0, 0, 0}));
}

TEST(Conv2dForwardCpu, HandComputedStrideAndPadding) {
  // A 3x3 box filter, stride 2, padding 1: each output sums a 2x2 corner of x.
  const Conv2dShape s{1, 3, 3, 1, 1, 3, 3, 2, 2, 1, 1};
  const std::vector<float> w(9, 1.0f);
  std::vector<float> y(4);
  conv2d_forward_cpu(s, kNine.data(), w.data(), nullptr, y.data(), false);
  EXPECT_EQ(y, (std::vector<float>{1 + 2 + 4 + 5, 2 + 3 + 5 + 6, 4 + 5 + 7 + 8, 5 + 6 + 8 + 9}));
}

TEST(Conv2dForwardCpu, HandComputedChannels) {
  // 1x1 filters mix channels per pixel: y = W x with W = [[1, 2], [-1, 3], [0, 1]] (K = 3, C = 2).
  const Conv2dShape s{1, 1, 2, 2, 3, 1, 1, 1, 1, 0, 0};
  const std::vector<float> x = {1, 10, 2, 20};  // pixel 0: (1, 10), pixel 1: (2, 20)
  const std::vector<float> w = {1, 2, -1, 3, 0, 1};
  const std::vector<float> bias = {100, 200, 300};
  std::vector<float> y(6);
  conv2d_forward_cpu(s, x.data(), w.data(), bias.data(), y.data(), false);
  EXPECT_EQ(y, (std::vector<float>{121, 229, 310, 142, 258, 320}));
}

TEST(Conv2dBackwardCpu, HandComputedStrideAndPadding) {
  // The box filter of HandComputedStrideAndPadding with dy = [[1, 2], [3, 4]]: every x pixel
  // receives the dy of each window that covers it, and dw[r][s] sums dy times the pixel that tap
  // (r, s) of each window reads (zero in the padding).
  const Conv2dShape s{1, 3, 3, 1, 1, 3, 3, 2, 2, 1, 1};
  const std::vector<float> dy = {1, 2, 3, 4};
  const std::vector<float> w(9, 1.0f);
  std::vector<float> dx(9);
  conv2d_backward_data_cpu(s, dy.data(), w.data(), dx.data());
  EXPECT_EQ(dx, (std::vector<float>{1, 1 + 2, 2, 1 + 3, 1 + 2 + 3 + 4, 2 + 4, 3, 3 + 4, 4}));
  std::vector<float> dw(9);
  conv2d_backward_weight_cpu(s, kNine.data(), dy.data(), dw.data(), 0.0f);
  // dw[1][1] = 1*x[0][0] + 2*x[0][2] + 3*x[2][0] + 4*x[2][2] = 1 + 6 + 21 + 36, and so on.
  EXPECT_EQ(dw, (std::vector<float>{20, 36, 15, 36, 64, 26, 10, 16, 5}));
}

// ---- against the independent formula ------------------------------------------------------------

TEST(Conv2dForwardCpu, MatchesZeroPaddedFormula) {
  uint64_t seed = 100;
  for (const Conv2dShape& s : kShapes) {
    SCOPED_TRACE(describe(s));
    const std::vector<float> x = testing::random_vector(s.x_size(), ++seed);
    const std::vector<float> w = testing::random_vector(s.w_size(), ++seed);
    const std::vector<float> bias = testing::random_vector(s.k, ++seed);
    const std::vector<double> plain = direct_forward(s, to_double(x), to_double(w));
    for (const bool with_bias : {false, true}) {
      for (const bool relu : {false, true}) {
        std::vector<double> expected = plain;
        for (size_t i = 0; i < expected.size(); ++i) {
          if (with_bias) expected[i] += bias[i % s.k];
          if (relu) expected[i] = std::max(expected[i], 0.0);
        }
        std::vector<float> y(s.y_size(), testing::kPoison);
        conv2d_forward_cpu(s, x.data(), w.data(), with_bias ? bias.data() : nullptr, y.data(),
                           relu);
        // One rounding to float of a double sum.
        EXPECT_ALL_CLOSE(y, expected, 1e-7, 1e-12) << "bias " << with_bias << " relu " << relu;
      }
    }
  }
}

TEST(Conv2dBackwardDataCpu, MatchesFiniteDifferences) {
  uint64_t seed = 200;
  for (const Conv2dShape& s : kShapes) {
    SCOPED_TRACE(describe(s));
    const std::vector<float> x = testing::random_vector(s.x_size(), ++seed);
    const std::vector<float> w = testing::random_vector(s.w_size(), ++seed);
    const std::vector<float> g = testing::random_vector(s.y_size(), ++seed);
    const std::vector<double> wd = to_double(w);
    const std::vector<double> expected =
        finite_difference(to_double(x), to_double(g),
                          [&](const std::vector<double>& at) { return direct_forward(s, at, wd); });
    std::vector<float> dx(s.x_size(), testing::kPoison);
    conv2d_backward_data_cpu(s, g.data(), w.data(), dx.data());
    EXPECT_ALL_CLOSE(dx, expected, 1e-7, 1e-12);
  }
}

TEST(Conv2dBackwardWeightCpu, MatchesFiniteDifferences) {
  uint64_t seed = 300;
  for (const Conv2dShape& s : kShapes) {
    SCOPED_TRACE(describe(s));
    const std::vector<float> x = testing::random_vector(s.x_size(), ++seed);
    const std::vector<float> w = testing::random_vector(s.w_size(), ++seed);
    const std::vector<float> g = testing::random_vector(s.y_size(), ++seed);
    const std::vector<double> xd = to_double(x);
    const std::vector<double> expected =
        finite_difference(to_double(w), to_double(g),
                          [&](const std::vector<double>& at) { return direct_forward(s, xd, at); });
    std::vector<float> dw(s.w_size(), testing::kPoison);
    conv2d_backward_weight_cpu(s, x.data(), g.data(), dw.data(), 0.0f);
    EXPECT_ALL_CLOSE(dw, expected, 1e-7, 1e-12);
  }
}

TEST(Conv2dBackwardWeightCpu, BetaAccumulatesAndZeroDoesNotRead) {
  const Conv2dShape s = kShapes[0];
  const std::vector<float> x = testing::random_vector(s.x_size(), 400);
  const std::vector<float> g = testing::random_vector(s.y_size(), 401);
  const std::vector<float> old = testing::random_vector(s.w_size(), 402);
  std::vector<float> grad(s.w_size(), std::numeric_limits<float>::quiet_NaN());
  conv2d_backward_weight_cpu(s, x.data(), g.data(), grad.data(), 0.0f);  // NaN never read
  double largest = 0.0;
  for (const float v : grad) largest = std::max(largest, double(std::fabs(v)));
  for (const float beta : {1.0f, 0.5f}) {
    std::vector<double> expected(old.size());
    for (size_t i = 0; i < old.size(); ++i) expected[i] = double(beta) * old[i] + grad[i];
    std::vector<float> dw = old;
    conv2d_backward_weight_cpu(s, x.data(), g.data(), dw.data(), beta);
    // The reference adds the unrounded gradient and rounds once; `expected` adds the gradient
    // already rounded to float: they differ by at most 2^-24 * |grad| plus dw's own rounding.
    EXPECT_ALL_CLOSE(dw, expected, 0x1p-24, 0x1p-24 * largest) << "beta " << beta;
  }
}

// ---- the launchers' checks (no GPU needed: they throw before any CUDA call) ---------------------

// Tensor-core math needs an sm_90 GPU: without one every pass says so and what to use instead.
TEST(Conv2dLaunchers, TensorCoreMathWithoutAnSm90GpuSaysWhatToUse) {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0) {
      GTEST_SKIP() << "an sm_90 GPU is present: tests/kernels/conv2d_tc_gpu_test.cpp covers it";
    }
  }
  cudaGetLastError();
  const Conv2dShape s = kShapes[0];
  float dummy[1] = {};
  for (const Math math : {Math::TF32, Math::BF16}) {
    const auto expect_message = [&](const std::function<void()>& call) {
      try {
        call();
        ADD_FAILURE() << "no error for math " << math_name(math);
      } catch (const ValueError& e) {
        EXPECT_NE(std::string(e.what()).find("needs an sm_90 GPU"), std::string::npos) << e.what();
      }
    };
    expect_message([&] { conv2d_forward(s, dummy, dummy, nullptr, dummy, false, nullptr, math); });
    expect_message([&] { conv2d_backward_data(s, dummy, dummy, dummy, nullptr, math); });
    expect_message([&] { conv2d_backward_weight(s, dummy, dummy, dummy, 1.0f, nullptr, math); });
  }
}

TEST(Conv2dLaunchers, RejectBadShapesAndNullPointers) {
  Conv2dShape bad = kShapes[0];
  bad.stride_w = 0;
  float dummy[1] = {};
  EXPECT_THROW(conv2d_forward(bad, dummy, dummy, nullptr, dummy, false, nullptr), ValueError);
  EXPECT_THROW(conv2d_backward_data(bad, dummy, dummy, dummy, nullptr), ValueError);
  EXPECT_THROW(conv2d_backward_weight(bad, dummy, dummy, dummy, 0.0f, nullptr), ValueError);
  EXPECT_THROW(conv2d_forward_cpu(bad, dummy, dummy, nullptr, dummy, false), ValueError);
  const Conv2dShape s = kShapes[0];
  EXPECT_THROW(conv2d_forward(s, nullptr, dummy, nullptr, dummy, false, nullptr), ValueError);
  EXPECT_THROW(conv2d_backward_data(s, dummy, nullptr, dummy, nullptr), ValueError);
  EXPECT_THROW(conv2d_backward_weight(s, dummy, dummy, nullptr, 0.0f, nullptr), ValueError);
}

}  // namespace
}  // namespace cudp::kernels
