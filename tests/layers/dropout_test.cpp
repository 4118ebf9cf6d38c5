// Dropout on the CPU: inverted scaling, the mask's reproducibility from (seed, offset), a fresh
// mask per training forward, the identity in evaluation, the gradient (with the mask held fixed by
// rewinding the offset), and the state clone() carries.
#include <gtest/gtest.h>

#include <cmath>

#include "layers/dropout.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

TEST(DropoutTest, KeptElementsAreScaledAndAboutPAreDropped) {
  Dropout dropout(0.25f, 7);
  const Tensor x = testing::away_from_zero({64, 64}, 1);
  const auto xv = values(x), yv = values(dropout.forward(x));
  size_t dropped = 0;
  for (size_t i = 0; i < xv.size(); ++i) {
    if (yv[i] == 0.0f) {
      ++dropped;
    } else {
      ASSERT_EQ(yv[i], xv[i] * (1.0f / 0.75f));
    }
  }
  // 4096 Bernoulli(0.25) draws: mean 1024, standard deviation ~28.
  EXPECT_NEAR(static_cast<double>(dropped), 1024.0, 5 * 28.0);
}

TEST(DropoutTest, MaskIsAFunctionOfSeedAndOffset) {
  const Tensor x = random_tensor({10, 13}, 2);
  Dropout a(0.5f, 3), b(0.5f, 3);
  const auto first = values(a.forward(x));
  EXPECT_EQ(a.offset(), 132u);  // 130 elements, rounded up to a multiple of 4
  const auto second = values(a.forward(x));
  EXPECT_NE(first, second);  // a fresh mask each step
  EXPECT_EQ(values(b.forward(x)), first);
  b.set_offset(132);
  EXPECT_EQ(values(b.forward(x)), second);
  Dropout other_seed(0.5f, 4);
  EXPECT_NE(values(other_seed.forward(x)), first);
  b.set_seed(3);
  EXPECT_EQ(b.offset(), 0u);
  EXPECT_EQ(values(b.forward(x)), first);
}

TEST(DropoutTest, EvalAndZeroPAreTheIdentity) {
  const Tensor x = random_tensor({4, 5}, 3);
  Dropout dropout(0.5f, 1);
  dropout.eval();
  EXPECT_TRUE(dropout.forward(x).shares_storage(x));
  const Tensor g = random_tensor({4, 5}, 4);
  EXPECT_TRUE(dropout.backward(g).shares_storage(g));
  EXPECT_EQ(dropout.offset(), 0u);
  Dropout none(0.0f);
  EXPECT_TRUE(none.forward(x).shares_storage(x));
}

TEST(DropoutTest, GradientMatchesFiniteDifferencesWithTheSameMask) {
  Dropout dropout(0.4f, 5);
  testing::GradCheckOptions options{.h = 0.25};
  options.forward = [](Module& m, const Tensor& x) {
    static_cast<Dropout&>(m).set_offset(1000);
    return m.forward(x);
  };
  testing::check_gradients(dropout, random_tensor({3, 11}, 6), 7, options);
}

TEST(DropoutTest, BackwardUsesTheForwardsMask) {
  Dropout dropout(0.5f, 8);
  const Tensor x = testing::away_from_zero({50}, 9);
  const auto y = values(dropout.forward(x));
  dropout.forward(x);  // a second forward moves the offset; backward follows the last forward
  const auto y2 = values(dropout.forward(x));
  const auto dx = values(dropout.backward(Tensor::full({50}, 1.0f)));
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_EQ(dx[i] == 0.0f, y2[i] == 0.0f) << i;
  EXPECT_NE(y, y2);
}

TEST(DropoutTest, RejectsInvalidP) {
  EXPECT_THROW_WITH(Dropout(1.0f), "Dropout: p must be in [0, 1), got 1");
  EXPECT_THROW(Dropout(-0.1f), ValueError);
  EXPECT_THROW(Dropout(std::nanf("")), ValueError);
}

TEST(DropoutTest, CloneCarriesSeedAndOffset) {
  Dropout dropout(0.3f, 11);
  dropout.forward(random_tensor({9}, 10));
  auto copy = std::static_pointer_cast<Dropout>(dropout.clone(Device::cpu()));
  EXPECT_EQ(copy->seed(), 11u);
  EXPECT_EQ(copy->offset(), 12u);
  EXPECT_FLOAT_EQ(copy->p(), 0.3f);
  EXPECT_TRUE(dropout.state_dict().empty());  // torchvision's Dropout has no state either
}

}  // namespace
}  // namespace cudp
