// Host tests of the pooling CPU references: hand-computed cases (ties, padding, NaN, overlapping
// windows), finite-difference checks of both backwards in double, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/expect_error.h"
#include "engine/core/error.h"
#include "kernels/pool.h"

namespace cudp::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Uniform doubles in [-1, 1): distinct with probability 1, so no ties at finite-difference scale.
std::vector<double> random_doubles(size_t n, uint64_t seed) {
  const std::vector<float> f = testing::random_vector(n, seed);
  std::vector<double> d(n);
  for (size_t i = 0; i < n; ++i) d[i] = f[i] + 1e-3 * testing::random_vector(1, seed * 31 + i)[0];
  return d;
}

// Central differences of L(x) = sum_i w_i * f(x)_i, element by element.
std::vector<double> numeric_gradient(
    const std::function<std::vector<double>(const std::vector<double>&)>& f, std::vector<double> x,
    const std::vector<double>& w, double h) {
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const std::vector<double> up = f(x);
    x[i] = keep - h;
    const std::vector<double> down = f(x);
    x[i] = keep;
    double diff = 0;
    for (size_t j = 0; j < w.size(); ++j) diff += w[j] * (up[j] - down[j]);
    grad[i] = diff / (2 * h);
  }
  return grad;
}

std::vector<float> to_float(const std::vector<double>& d) {
  return {d.begin(), d.end()};
}

TEST(MaxPoolCpu, TwoByTwoStrideTwoWithTies) {
  // One 4x4 plane, one channel. Windows (row-major):
  //   [1 3 | 3 2]     window (0,0) = {1,3,5,0}: max 5 at (1,0) -> index 4
  //   [5 0 | 3 3]     window (0,1) = {3,2,3,3}: a tie of three 3s, the first (0,2) wins -> index 2
  //   [-1 -2| 7 7]    window (1,0) = {-1,-2,-4,-3}: max -1 at (2,0) -> 8
  //   [-4 -3| 7 7]    window (1,1) = all 7: the first (2,2) -> 10
  const std::vector<float> x = {1, 3, 3, 2, 5, 0, 3, 3, -1, -2, 7, 7, -4, -3, 7, 7};
  std::vector<float> y(4);
  std::vector<int32_t> idx(4);
  max_pool2d_forward_cpu(x.data(), y.data(), idx.data(), 1, 4, 4, 1, 2, 2, 2, 2, 0, 0);
  EXPECT_EQ(y, (std::vector<float>{5, 3, -1, 7}));
  EXPECT_EQ(idx, (std::vector<int32_t>{4, 2, 8, 10}));
}

// The same plane through the codes: the window's place (0..3, row-major) and bit 2 where the max
// is <= 0; backward sends dy to the coded element, and with the ReLU mask not where bit 2 is set.
TEST(MaxPoolCpu, TwoByTwoCodesNameThePlaceAndTheSign) {
  const std::vector<float> x = {1, 3, 3, 2, 5, 0, 3, 3, -1, -2, 7, 7, -4, -3, 7, 7};
  std::vector<float> y(4);
  std::vector<uint8_t> codes(4);
  max_pool2d_2x2_forward_cpu(x.data(), y.data(), codes.data(), 1, 4, 4, 1);
  EXPECT_EQ(y, (std::vector<float>{5, 3, -1, 7}));
  EXPECT_EQ(codes, (std::vector<uint8_t>{2, 0, 4 + 0, 0}));
  const std::vector<float> dy = {10, 20, 30, 40};
  std::vector<float> dx(16, -9.f);
  max_pool2d_2x2_backward_cpu(dy.data(), codes.data(), dx.data(), 1, 4, 4, 1);
  EXPECT_EQ(dx, (std::vector<float>{0, 0, 20, 0, 10, 0, 0, 0, 30, 0, 40, 0, 0, 0, 0, 0}));
  max_pool2d_2x2_backward_cpu(dy.data(), codes.data(), dx.data(), 1, 4, 4, 1, /*relu_mask=*/true);
  EXPECT_EQ(dx, (std::vector<float>{0, 0, 20, 0, 10, 0, 0, 0, 0, 0, 40, 0, 0, 0, 0, 0}));
  // An odd edge: the last row and column belong to no window and get zeros.
  const std::vector<float> x3 = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<float> y3(1), dx3(9, -9.f);
  std::vector<uint8_t> c3(1);
  max_pool2d_2x2_forward_cpu(x3.data(), y3.data(), c3.data(), 1, 3, 3, 1);
  EXPECT_EQ(y3[0], 5.f);
  EXPECT_EQ(c3[0], 3);
  max_pool2d_2x2_backward_cpu(dy.data(), c3.data(), dx3.data(), 1, 3, 3, 1);
  EXPECT_EQ(dx3, (std::vector<float>{0, 0, 0, 0, 10, 0, 0, 0, 0}));
}

TEST(MaxPoolCpu, PaddingIsMinusInfinityAndChannelsAreIndependent) {
  // 3x3 window, stride 2, pad 1 over a 3x3 plane of two channels -> 2x2 outputs. Channel 0 is
  // all negative: a zero padding would win; -inf padding must not. Channel 1 = -channel 0.
  std::vector<float> x(9 * 2);
  for (int i = 0; i < 9; ++i) x[i * 2] = -1.f - i, x[i * 2 + 1] = 1.f + i;
  std::vector<float> y(4 * 2);
  std::vector<int32_t> idx(4 * 2);
  max_pool2d_forward_cpu(x.data(), y.data(), idx.data(), 1, 3, 3, 2, 3, 3, 2, 2, 1, 1);
  // Window (oh, ow) covers rows [2oh-1, 2oh+1] and columns [2ow-1, 2ow+1] clipped to [0, 2]:
  // positions {0,1,3,4}, {1,2,4,5}, {3,4,6,7}, {4,5,7,8}. Channel 0's maximum is at the smallest
  // position of each, channel 1's at the largest.
  EXPECT_EQ(y[0 * 2], -1.f);
  EXPECT_EQ(idx[0 * 2], 0);
  EXPECT_EQ(y[1 * 2], -2.f);
  EXPECT_EQ(idx[1 * 2], 1);
  EXPECT_EQ(y[2 * 2], -4.f);
  EXPECT_EQ(idx[2 * 2], 3);
  EXPECT_EQ(y[3 * 2], -5.f);
  EXPECT_EQ(idx[3 * 2], 4);
  EXPECT_EQ(y[0 * 2 + 1], 5.f);
  EXPECT_EQ(idx[0 * 2 + 1], 4);
  EXPECT_EQ(y[1 * 2 + 1], 6.f);
  EXPECT_EQ(idx[1 * 2 + 1], 5);
  EXPECT_EQ(y[2 * 2 + 1], 8.f);
  EXPECT_EQ(idx[2 * 2 + 1], 7);
  EXPECT_EQ(y[3 * 2 + 1], 9.f);
  EXPECT_EQ(idx[3 * 2 + 1], 8);
}

TEST(MaxPoolCpu, AllMinusInfinityTakesTheFirstRealPositionAndNaNPropagates) {
  // 2x2 plane, 2x2 window, pad 1, stride 1 -> 3x3 outputs; every input is -inf: nothing beats the
  // initial -inf, and the index stays at the window's first real position (PyTorch's).
  const std::vector<float> x(4, -kInf);
  std::vector<float> y(9);
  std::vector<int32_t> idx(9);
  max_pool2d_forward_cpu(x.data(), y.data(), idx.data(), 1, 2, 2, 1, 2, 2, 1, 1, 1, 1);
  const std::vector<int32_t> first = {0, 0, 1, 0, 0, 1, 2, 2, 3};
  EXPECT_EQ(idx, first);
  for (float v : y) EXPECT_EQ(v, -kInf);

  // NaN wins over any number; of two NaNs the last in window order gives the index.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> z = {nan, 9, 1, nan};
  std::vector<float> zy(1);
  std::vector<int32_t> zi(1);
  max_pool2d_forward_cpu(z.data(), zy.data(), zi.data(), 1, 2, 2, 1, 2, 2, 2, 2, 0, 0);
  EXPECT_TRUE(std::isnan(zy[0]));
  EXPECT_EQ(zi[0], 3);
}

TEST(MaxPoolCpu, BackwardSumsOverlappingWindowsAndZeroesTheRest) {
  // 3x3 plane whose centre is the maximum: with 3x3 windows, stride 2, pad 1, all four windows
  // take it, so dx(centre) = the sum of the four gradients and every other dx is 0.
  const std::vector<float> x = {1, 2, 3, 4, 100, 5, 6, 7, 8};
  std::vector<float> y(4);
  std::vector<int32_t> idx(4);
  max_pool2d_forward_cpu(x.data(), y.data(), idx.data(), 1, 3, 3, 1, 3, 3, 2, 2, 1, 1);
  EXPECT_EQ(idx, (std::vector<int32_t>{4, 4, 4, 4}));
  const std::vector<float> dy = {0.5f, -1.25f, 2.f, 0.25f};
  std::vector<float> dx(9, testing::kPoison);
  max_pool2d_backward_cpu(dy.data(), idx.data(), dx.data(), 1, 3, 3, 1, 3, 3, 2, 2, 1, 1);
  EXPECT_EQ(dx, (std::vector<float>{0, 0, 0, 0, 1.5f, 0, 0, 0, 0}));
}

struct Window {
  int kh, kw, sh, sw, ph, pw;
};

TEST(MaxPoolCpu, BackwardMatchesFiniteDifferences) {
  const int n = 2, h = 7, w = 7, c = 3;
  for (const Window& win : {Window{2, 2, 2, 2, 0, 0}, Window{3, 3, 2, 2, 1, 1},
                            Window{3, 3, 1, 1, 1, 1}, Window{2, 3, 1, 2, 1, 0}}) {
    SCOPED_TRACE(::testing::Message() << win.kh << "x" << win.kw << " s" << win.sh << "," << win.sw
                                      << " p" << win.ph << "," << win.pw);
    const int oh = max_pool2d_output_size(h, win.kh, win.sh, win.ph);
    const int ow = max_pool2d_output_size(w, win.kw, win.sw, win.pw);
    const size_t out = size_t(n) * oh * ow * c;
    auto forward = [&](const std::vector<double>& x) {
      std::vector<double> y(out);
      std::vector<int32_t> idx(out);
      max_pool2d_forward_cpu(x.data(), y.data(), idx.data(), n, h, w, c, win.kh, win.kw, win.sh,
                             win.sw, win.ph, win.pw);
      return y;
    };
    const std::vector<double> x = random_doubles(size_t(n) * h * w * c, 11);
    const std::vector<double> dy = random_doubles(out, 12);
    std::vector<double> y(out);
    std::vector<int32_t> idx(out);
    max_pool2d_forward_cpu(x.data(), y.data(), idx.data(), n, h, w, c, win.kh, win.kw, win.sh,
                           win.sw, win.ph, win.pw);
    std::vector<double> dx(x.size());
    max_pool2d_backward_cpu(dy.data(), idx.data(), dx.data(), n, h, w, c, win.kh, win.kw, win.sh,
                            win.sw, win.ph, win.pw);
    // Max pooling is piecewise linear: with h = 1e-7, far below the gaps between random inputs, no
    // argmax changes, so central differences are exact up to rounding (~1e-16 / 1e-7).
    const std::vector<double> numeric = numeric_gradient(forward, x, dy, 1e-7);
    EXPECT_ALL_CLOSE(to_float(dx), numeric, 1e-6, 1e-6);
  }
}

TEST(AdaptiveAvgPoolCpu, PyTorchWindows) {
  // 5 -> 3: rows [0,2), [1,4), [3,5) (floor(i*5/3), ceil((i+1)*5/3)), the same for columns.
  std::vector<float> x(25);
  for (int i = 0; i < 25; ++i) x[i] = float(i);
  std::vector<float> y(9);
  adaptive_avg_pool2d_forward_cpu(x.data(), y.data(), 1, 5, 5, 1, 3, 3);
  const int starts[3] = {0, 1, 3}, ends[3] = {2, 4, 5};
  for (int oh = 0; oh < 3; ++oh) {
    for (int ow = 0; ow < 3; ++ow) {
      double sum = 0;
      for (int ih = starts[oh]; ih < ends[oh]; ++ih) {
        for (int iw = starts[ow]; iw < ends[ow]; ++iw) sum += ih * 5 + iw;
      }
      const double mean = sum / ((ends[oh] - starts[oh]) * (ends[ow] - starts[ow]));
      EXPECT_FLOAT_EQ(y[oh * 3 + ow], float(mean)) << oh << "," << ow;
    }
  }
  // Window (0,0) is {0,1,5,6}: mean 3. Window (1,1) rows/cols 1..3: mean of 6..8,11..13,16..18
  // = 12.
  EXPECT_FLOAT_EQ(y[0], 3.f);
  EXPECT_FLOAT_EQ(y[4], 12.f);
}

TEST(AdaptiveAvgPoolCpu, OneByOneToSevenBySevenReplicates) {
  // torchvision's VGG head on 32x32 inputs: a 1x1 feature map pooled to 7x7 repeats it 49 times;
  // backward sums the 49 gradients.
  const std::vector<float> x = {1.5f, -2.f};  // one pixel, two channels
  std::vector<float> y(49 * 2);
  adaptive_avg_pool2d_forward_cpu(x.data(), y.data(), 1, 1, 1, 2, 7, 7);
  for (int i = 0; i < 49; ++i) {
    EXPECT_EQ(y[i * 2], 1.5f);
    EXPECT_EQ(y[i * 2 + 1], -2.f);
  }
  std::vector<float> dy(49 * 2);
  for (int i = 0; i < 49; ++i) dy[i * 2] = 1.f, dy[i * 2 + 1] = float(i);
  std::vector<float> dx(2, testing::kPoison);
  adaptive_avg_pool2d_backward_cpu(dy.data(), dx.data(), 1, 1, 1, 2, 7, 7);
  EXPECT_EQ(dx[0], 49.f);
  EXPECT_EQ(dx[1], 48.f * 49.f / 2.f);
}

TEST(AdaptiveAvgPoolCpu, BackwardMatchesFiniteDifferences) {
  const int n = 2, c = 3;
  struct Case {
    int h, w, oh, ow;
  };
  for (const Case& k : {Case{7, 7, 7, 7}, Case{9, 7, 4, 3}, Case{5, 6, 7, 7}, Case{3, 3, 1, 1}}) {
    SCOPED_TRACE(::testing::Message() << k.h << "x" << k.w << " -> " << k.oh << "x" << k.ow);
    const size_t out = size_t(n) * k.oh * k.ow * c;
    auto forward = [&](const std::vector<double>& x) {
      std::vector<double> y(out);
      adaptive_avg_pool2d_forward_cpu(x.data(), y.data(), n, k.h, k.w, c, k.oh, k.ow);
      return y;
    };
    const std::vector<double> x = random_doubles(size_t(n) * k.h * k.w * c, 21);
    const std::vector<double> dy = random_doubles(out, 22);
    std::vector<double> dx(x.size());
    adaptive_avg_pool2d_backward_cpu(dy.data(), dx.data(), n, k.h, k.w, c, k.oh, k.ow);
    // Linear: central differences are exact up to rounding.
    EXPECT_ALL_CLOSE(to_float(dx), numeric_gradient(forward, x, dy, 1e-3), 1e-7, 1e-9);
  }
}

TEST(PoolCpu, BadArgumentsThrowValueErrorNamingTheValue) {
  std::vector<float> buf(1024);
  std::vector<int32_t> idx(1024);
  float* p = buf.data();
  int32_t* q = idx.data();
  EXPECT_VALUE_ERROR(max_pool2d_forward_cpu(p, p, q, 1, 4, 4, 1, 0, 2, 2, 2, 0, 0),
                     "kernel size must be >= 1, got 0");
  EXPECT_VALUE_ERROR(max_pool2d_forward_cpu(p, p, q, 1, 4, 4, 1, 2, 2, 0, 2, 0, 0),
                     "stride must be >= 1, got 0");
  EXPECT_VALUE_ERROR(max_pool2d_forward_cpu(p, p, q, 1, 4, 4, 1, 2, 2, 2, 2, 2, 0),
                     "pad should be at most half of kernel size (pad 2, kernel 2)");
  EXPECT_VALUE_ERROR(max_pool2d_forward_cpu(p, p, q, 1, 2, 4, 1, 3, 3, 1, 1, 0, 0),
                     "input size 2 with pad 0 is smaller than the kernel 3");
  EXPECT_VALUE_ERROR(max_pool2d_forward_cpu(p, p, q, 1, 4, 4, 0, 2, 2, 2, 2, 0, 0),
                     "channels must be >= 1, got 0");
  EXPECT_VALUE_ERROR(max_pool2d_backward_cpu(p, q, p, -1, 4, 4, 1, 2, 2, 2, 2, 0, 0),
                     "batch size must be >= 0, got -1");
  EXPECT_VALUE_ERROR(max_pool2d_forward_cpu(p, p, q, 1, 0, 4, 1, 2, 2, 2, 2, 0, 0),
                     "height must be >= 1, got 0");
  EXPECT_VALUE_ERROR(adaptive_avg_pool2d_forward_cpu(p, p, 1, 4, 4, 1, 0, 7),
                     "output height must be >= 1, got 0");
  EXPECT_VALUE_ERROR(adaptive_avg_pool2d_backward_cpu(p, p, 1, 4, -3, 1, 7, 7),
                     "width must be >= 1, got -3");
  // An empty batch is legal and writes nothing.
  EXPECT_NO_THROW(max_pool2d_forward_cpu(p, p, q, 0, 4, 4, 1, 2, 2, 2, 2, 0, 0));
}

}  // namespace
}  // namespace cudp::kernels
