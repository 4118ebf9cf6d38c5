// MaxPool2d and AdaptiveAvgPool2d on the CPU: values against direct definitions, finite-difference
// gradients (max pooling on well-separated values so no argmax moves), overlapping windows, and
// the adaptive pool's identity fast path.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include "layers/pooling.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

TEST(MaxPool2dTest, TwoByTwoTakesTheWindowMaxima) {
  MaxPool2d pool(2);
  EXPECT_EQ(pool.stride(), 2);
  const Tensor x = testing::distinct_values({2, 4, 6, 3}, 1);
  const Tensor y = pool.forward(x);
  ASSERT_EQ(y.shape(), (Shape{2, 2, 3, 3}));
  const auto xv = values(x), yv = values(y);
  for (int n = 0; n < 2; ++n)
    for (int p = 0; p < 2; ++p)
      for (int q = 0; q < 3; ++q)
        for (int c = 0; c < 3; ++c) {
          float m = -std::numeric_limits<float>::infinity();
          for (int r = 0; r < 2; ++r)
            for (int s = 0; s < 2; ++s)
              m = std::max(m, xv[((n * 4 + 2 * p + r) * 6 + 2 * q + s) * 3 + c]);
          ASSERT_EQ(yv[((n * 2 + p) * 3 + q) * 3 + c], m);
        }
}

TEST(MaxPool2dTest, GradientMatchesFiniteDifferences) {
  MaxPool2d pool(2, 2);
  testing::check_gradients(pool, testing::distinct_values({2, 5, 4, 3}, 2), 3, {.h = 1.0 / 32});
}

TEST(MaxPool2dTest, OverlappingPaddedWindowsSumTheirGradients) {
  MaxPool2d pool(3, 2, 1);
  const Tensor x = testing::distinct_values({1, 7, 6, 2}, 4);
  EXPECT_EQ(pool.forward(x).shape(), (Shape{1, 4, 3, 2}));
  testing::check_gradients(pool, x, 5, {.h = 1.0 / 32});
}

TEST(MaxPool2dTest, RejectsPaddingLargerThanHalfTheKernel) {
  EXPECT_THROW_WITH(MaxPool2d(2, 2, 2), "padding must be at most half the kernel");
}

TEST(AdaptiveAvgPool2dTest, AveragesPyTorchsWindows) {
  // 5 rows to 3: windows [0, 2), [1, 4), [3, 5); 4 columns to 2: [0, 2), [2, 4).
  AdaptiveAvgPool2d pool(3, 2);
  const Tensor x = random_tensor({1, 5, 4, 2}, 1);
  const auto xv = values(x);
  const int rows[3][2] = {{0, 2}, {1, 4}, {3, 5}}, cols[2][2] = {{0, 2}, {2, 4}};
  std::vector<double> expected;
  for (auto& r : rows)
    for (auto& s : cols)
      for (int c = 0; c < 2; ++c) {
        double sum = 0;
        for (int h = r[0]; h < r[1]; ++h)
          for (int w = s[0]; w < s[1]; ++w) sum += xv[(h * 4 + w) * 2 + c];
        expected.push_back(sum / ((r[1] - r[0]) * (s[1] - s[0])));
      }
  EXPECT_ALL_CLOSE(values(pool.forward(x)), expected, 1e-6, 1e-7);
}

TEST(AdaptiveAvgPool2dTest, GradientsShrinkingAndGrowing) {
  AdaptiveAvgPool2d shrink(3, 2);
  testing::check_gradients(shrink, random_tensor({2, 5, 7, 3}, 2), 3, {.h = 0.25});
  AdaptiveAvgPool2d grow(7);  // torchvision's head on 1x1 features
  testing::check_gradients(grow, random_tensor({2, 1, 1, 4}, 4), 5, {.h = 0.25});
}

TEST(AdaptiveAvgPool2dTest, IdentityWhenAlreadyTheOutputSize) {
  AdaptiveAvgPool2d pool(7, 7);
  const Tensor x = random_tensor({2, 7, 7, 3}, 6);
  const Tensor y = pool.forward(x);
  EXPECT_TRUE(y.shares_storage(x));
  EXPECT_EQ(y.shape(), x.shape());
  const Tensor g = random_tensor({2, 7, 7, 3}, 7);
  EXPECT_TRUE(pool.backward(g).shares_storage(g));
}

}  // namespace
}  // namespace cudp
