// Flatten on the CPU: NHWC in, PyTorch's NCHW feature order out (so torchvision's Linear weights
// apply unchanged), the inverse in backward, and the views for 1x1 and already flat inputs.
#include <gtest/gtest.h>

#include "layers/flatten.h"
#include "layers/precision.h"
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

// Under the bf16 policy the activations stay bf16 through Flatten: the output holds the f32
// path's values on the same (bf16) inputs, in bf16, and so does the input gradient; a gradient of
// another dtype than the input's is refused.
TEST(FlattenTest, Bf16InputsStayBf16BothWays) {
  for (const Shape& shape : {Shape{2, 3, 2, 4}, Shape{3, 1, 1, 8}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor x = convert(random_tensor(shape, 11), DType::bf16);
    Flatten bf16_flatten, f32_flatten;
    EXPECT_TRUE(bf16_flatten.takes_bf16());
    const Tensor y = bf16_flatten.forward(x);
    EXPECT_EQ(y.dtype(), DType::bf16);
    EXPECT_EQ(values(y), values(f32_flatten.forward(convert(x, DType::f32))));
    const Tensor g = convert(random_tensor(y.shape(), 12), DType::bf16);
    const Tensor dx = bf16_flatten.backward(g);
    EXPECT_EQ(dx.dtype(), DType::bf16);
    EXPECT_EQ(dx.shape(), shape);
    EXPECT_EQ(values(dx), values(f32_flatten.backward(convert(g, DType::f32))));
    bf16_flatten.forward(x);
    EXPECT_THROW_WITH(bf16_flatten.backward(convert(g, DType::f32)),
                      "f32 cpu but the input was bf16");
  }
}

}  // namespace
}  // namespace cudp
