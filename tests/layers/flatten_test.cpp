// Flatten on the CPU: NHWC in, PyTorch's NCHW feature order out (so torchvision's Linear weights
// apply unchanged), the inverse in backward, and the views for 1x1 and already flat inputs.
#include <gtest/gtest.h>

#include "layers/flatten.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

TEST(FlattenTest, FeaturesComeInNchwOrder) {
  const int N = 2, H = 3, W = 4, C = 5;
  // x[n, h, w, c] holds a code of its own index, so the output says where each value came from.
  std::vector<float> x;
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h)
      for (int w = 0; w < W; ++w)
        for (int c = 0; c < C; ++c) x.push_back(float(((n * 10 + c) * 10 + h) * 10 + w));
  Flatten flatten;
  const Tensor y = flatten.forward(Tensor::from_vector(x, {N, H, W, C}));
  ASSERT_EQ(y.shape(), (Shape{N, C * H * W}));
  const auto yv = values(y);
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < H; ++h)
        for (int w = 0; w < W; ++w)
          ASSERT_EQ(yv[n * C * H * W + (c * H + h) * W + w],
                    float(((n * 10 + c) * 10 + h) * 10 + w));
}

TEST(FlattenTest, BackwardIsTheInverse) {
  Flatten flatten;
  const Tensor x = random_tensor({2, 3, 2, 4}, 1);
  flatten.forward(x);
  const Tensor g = flatten.forward(x).clone();  // the flattened x as gradient: back to x exactly
  EXPECT_EQ(values(flatten.backward(g)), values(x));
  testing::check_gradients(flatten, random_tensor({1, 2, 3, 5}, 2), 3, {.h = 0.25});
}

TEST(FlattenTest, OneByOneAndFlatInputsAreViews) {
  Flatten flatten;
  const Tensor x = random_tensor({3, 1, 1, 8}, 4);
  const Tensor y = flatten.forward(x);
  EXPECT_EQ(y.shape(), (Shape{3, 8}));
  EXPECT_TRUE(y.shares_storage(x));
  const Tensor g = random_tensor({3, 8}, 5);
  const Tensor dx = flatten.backward(g);
  EXPECT_EQ(dx.shape(), (Shape{3, 1, 1, 8}));
  EXPECT_TRUE(dx.shares_storage(g));
  const Tensor flat = random_tensor({3, 8}, 6);
  EXPECT_TRUE(flatten.forward(flat).shares_storage(flat));
  EXPECT_THROW_WITH(flatten.forward(random_tensor({3, 8, 2}, 7)), "Flatten: expected an NHWC");
}

}  // namespace
}  // namespace cudp
