// Sequential on the CPU: index names, forward as the chain of its children, backward in reverse,
// and the whole chain's gradient (linear pieces only, so finite differences are exact up to
// rounding).
#include <gtest/gtest.h>

#include "layers/activation.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

TEST(SequentialTest, ChildrenAreNamedByIndex) {
  Sequential seq({std::make_shared<Linear>(4, 3), std::make_shared<ReLU>()});
  auto last = seq.add(std::make_shared<Linear>(3, 2));
  EXPECT_EQ(seq.size(), 3u);
  EXPECT_EQ(seq[2], last);
  std::vector<std::string> names;
  for (auto& [name, child] : seq.children()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"0", "1", "2"}));
  EXPECT_THROW_WITH(seq[3], "Sequential: index 3 out of range for 3 modules");
}

TEST(SequentialTest, ForwardChainsAndBackwardReverses) {
  auto conv = std::make_shared<Conv2d>(2, 3, 3, 1, 1, true, 1);
  auto relu = std::make_shared<ReLU>();
  auto pool = std::make_shared<MaxPool2d>(2);
  Sequential seq({conv, relu, pool});
  const Tensor x = random_tensor({2, 4, 4, 2}, 2);
  const Tensor y = seq.forward(x);
  // The same chain by hand, on a clone so that the two runs do not share saved state.
  auto by_hand = std::static_pointer_cast<Sequential>(seq.clone(Device::cpu()));
  Tensor expected = x;
  for (size_t i = 0; i < by_hand->size(); ++i) expected = (*by_hand)[i]->forward(expected);
  EXPECT_EQ(values(y), values(expected));
  const Tensor g = random_tensor(y.shape(), 3);
  const Tensor dx = seq.backward(g);
  Tensor dg = g;
  for (size_t i = by_hand->size(); i-- > 0;) dg = (*by_hand)[i]->backward(dg);
  EXPECT_EQ(values(dx), values(dg));
  EXPECT_EQ(values(conv->weight().grad),
            values(std::static_pointer_cast<Conv2d>((*by_hand)[0])->weight().grad));
}

// A chain propagates each layer's rounding through the next ones (a Linear over 12 features can
// multiply an input's error by up to 12 max|W|), so the rounding budget is larger than one layer's.
TEST(SequentialTest, GradientsThroughAChain) {
  Sequential seq({std::make_shared<Conv2d>(2, 3, 3, 2, 1), std::make_shared<AdaptiveAvgPool2d>(2),
                  std::make_shared<Flatten>(), std::make_shared<Linear>(12, 4)});
  testing::randomize_parameters(seq, 4);
  testing::check_gradients(seq, random_tensor({2, 5, 6, 2}, 5), 6, {.h = 0.25, .ulps = 32});
}

TEST(SequentialTest, EmptyIsTheIdentity) {
  Sequential seq;
  const Tensor x = random_tensor({2, 3}, 7);
  EXPECT_TRUE(seq.forward(x).shares_storage(x));
}

TEST(SequentialTest, RejectsANullModule) {
  Sequential seq;
  EXPECT_THROW_WITH(seq.add(std::shared_ptr<Module>()), "Sequential::add: module 0 is null");
}

}  // namespace
}  // namespace cudp
