// ReLU on the CPU: values, finite-difference gradient (inputs kept away from the kink at 0), and
// the in-place variant sharing its input's and its gradient's storage.
#include <gtest/gtest.h>

#include "layers/activation.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::values;

TEST(ReLUTest, ForwardClampsNegatives) {
  ReLU relu;
  const Tensor x = Tensor::from_vector<float>({-2.f, -0.f, 0.5f, 3.f}, {2, 2});
  EXPECT_EQ(values(relu.forward(x)), (std::vector<float>{0.f, 0.f, 0.5f, 3.f}));
  EXPECT_EQ(values(x)[0], -2.f);  // not in place
}

TEST(ReLUTest, GradientMatchesFiniteDifferences) {
  ReLU relu;
  testing::check_gradients(relu, testing::away_from_zero({2, 3, 5, 4}, 1), 2, {.h = 1.0 / 32});
}

TEST(ReLUTest, InPlaceOverwritesInputAndGradient) {
  ReLU relu(/*inplace=*/true);
  const Tensor x = Tensor::from_vector<float>({-1.f, 2.f, -3.f, 4.f}, {4});
  const Tensor y = relu.forward(x);
  EXPECT_TRUE(y.shares_storage(x));
  EXPECT_EQ(values(x), (std::vector<float>{0.f, 2.f, 0.f, 4.f}));
  const Tensor g = Tensor::from_vector<float>({1.f, 1.f, 1.f, 1.f}, {4});
  const Tensor dx = relu.backward(g);
  EXPECT_TRUE(dx.shares_storage(g));
  EXPECT_EQ(values(dx), (std::vector<float>{0.f, 1.f, 0.f, 1.f}));
  testing::check_gradients(relu, testing::away_from_zero({3, 7}, 3), 4, {.h = 1.0 / 32});
}

}  // namespace
}  // namespace cudp
