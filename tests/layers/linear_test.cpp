// Linear on the CPU: forward against y = x W^T + b in double, finite-difference gradients (2-D and
// 3-D inputs, with and without bias), PyTorch's [out, in] weight layout in state_dict, the init.
#include <gtest/gtest.h>

#include <cmath>

#include "layers/linear.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

TEST(LinearTest, ForwardIsXWTransposedPlusB) {
  Linear linear(5, 3, true, 1);
  testing::randomize_parameters(linear, 2);
  const Tensor x = random_tensor({4, 5}, 3);
  const auto xv = values(x), w = values(linear.weight().data), b = values(linear.bias().data);
  std::vector<double> expected;
  for (int n = 0; n < 4; ++n)
    for (int o = 0; o < 3; ++o) {
      double sum = b[o];
      for (int i = 0; i < 5; ++i) sum += double(xv[n * 5 + i]) * w[o * 5 + i];
      expected.push_back(sum);
    }
  const Tensor y = linear.forward(x);
  EXPECT_EQ(y.shape(), (Shape{4, 3}));
  EXPECT_ALL_CLOSE(values(y), expected, 1e-6, 1e-6);
  EXPECT_EQ(linear.state_dict().at("weight").shape(), (Shape{3, 5}));
}

TEST(LinearTest, GradientsMatchFiniteDifferences) {
  Linear linear(7, 5, true);
  testing::randomize_parameters(linear, 4);
  testing::check_gradients(linear, random_tensor({3, 7}, 5), 6, {.h = 0.25});
}

TEST(LinearTest, GradientsOverLeadingDimensionsAndWithoutBias) {
  Linear linear(4, 3, /*bias=*/false);
  testing::randomize_parameters(linear, 7);
  EXPECT_EQ(linear.named_parameters().size(), 1u);
  const Tensor x = random_tensor({2, 3, 4}, 8);
  EXPECT_EQ(linear.forward(x).shape(), (Shape{2, 3, 3}));
  testing::check_gradients(linear, x, 9, {.h = 0.25});
}

TEST(LinearTest, RejectsAWrongInput) {
  Linear linear(4, 3);
  EXPECT_THROW_WITH(linear.forward(random_tensor({2, 5}, 1)),
                    "Linear: expected an f32 input [*, 4], got Tensor[2, 5]");
}

TEST(LinearTest, InitIsNormalWithStd001) {
  Linear linear(100, 80, true, 3);
  const auto w = values(linear.weight().data);
  double sq = 0;
  for (float v : w) sq += double(v) * v;
  EXPECT_NEAR(std::sqrt(sq / w.size()), 0.01, 0.0003);  // 8000 samples
  for (float v : values(linear.bias().data)) EXPECT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace cudp
