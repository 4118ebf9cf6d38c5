// Linear on the CPU: forward against y = x W^T + b in double, finite-difference gradients (2-D and
// 3-D inputs, with and without bias), PyTorch's [out, in] weight layout in state_dict, the tf32
// policy's operand truncation, the init.
#include <gtest/gtest.h>

#include <cmath>

#include "common/tf32.h"
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

// Under tf32 the CPU path truncates each product's operands to TF32 as the tensor cores read them
// (layers/precision.h) and computes in fp32: checked as Conv2d's test does, against an fp32 layer
// run on truncated tensors and against fp32 on the tensors as they are.
TEST(LinearTest, Tf32PolicyTruncatesTheOperandsOfEveryProductOnTheCpu) {
  Linear linear(7, 5, true), fp32(7, 5, true), reference(7, 5, true);
  testing::randomize_parameters(linear, 31);
  fp32.load_state_dict(linear.state_dict());
  auto truncated = [](const Tensor& t) {
    std::vector<float> v = values(t);
    for (float& f : v) f = testing::tf32_truncated(f);
    return Tensor::from_vector(v, t.shape());
  };
  reference.weight().data.copy_from(truncated(linear.weight().data));
  reference.bias().data.copy_from(linear.bias().data);
  linear.set_precision(Precision::tf32);
  const Tensor x = random_tensor({2, 3, 7}, 32), g = random_tensor({2, 3, 5}, 33);
  const Tensor y = linear.forward(x);
  EXPECT_EQ(values(y), values(reference.forward(truncated(x))));
  EXPECT_NE(values(y), values(fp32.forward(x)));
  linear.zero_grad();
  fp32.zero_grad();
  reference.zero_grad();
  const Tensor dx = linear.backward(g);
  EXPECT_EQ(values(dx), values(reference.backward(truncated(g))));
  EXPECT_NE(values(dx), values(fp32.backward(g)));
  EXPECT_EQ(values(linear.weight().grad), values(reference.weight().grad));
  EXPECT_NE(values(linear.weight().grad), values(fp32.weight().grad));
  EXPECT_EQ(values(linear.bias().grad), values(fp32.bias().grad));
  EXPECT_NE(values(linear.bias().grad), values(reference.bias().grad));
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
