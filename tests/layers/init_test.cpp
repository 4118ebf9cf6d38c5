// Initialisers: the seed derivation is deterministic and separates names and seeds, and
// reset_parameters reproduces a layer's values from its seed on any layer of a model.
#include <gtest/gtest.h>

#include <set>

#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/init.h"
#include "layers/linear.h"
#include "layers/sequential.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::values;

TEST(InitTest, DeriveSeedIsDeterministicAndSpreads) {
  EXPECT_EQ(init::derive_seed(1, "features.0"), init::derive_seed(1, "features.0"));
  std::set<uint64_t> seen;
  for (uint64_t seed : {0, 1, 2}) {
    for (const char* name : {"", "weight", "bias", "features.0", "features.1", "0", "1"}) {
      seen.insert(init::derive_seed(seed, name));
    }
  }
  EXPECT_EQ(seen.size(), 21u);
}

TEST(InitTest, ResetParametersFollowsThePaths) {
  Sequential seq({std::make_shared<Conv2d>(3, 8, 3), std::make_shared<BatchNorm2d>(8),
                  std::make_shared<Linear>(8, 4)});
  testing::randomize_parameters(seq, 1);
  init::reset_parameters(seq, 42);
  Conv2d conv(3, 8, 3, 1, 0, true, init::derive_seed(42, "0"));
  Linear linear(8, 4, true, init::derive_seed(42, "2"));
  const auto p = seq.named_parameters();
  EXPECT_EQ(values(p[0].second->data), values(conv.weight().data));
  EXPECT_EQ(values(p[1].second->data), std::vector<float>(8, 0.0f));
  EXPECT_EQ(values(p[2].second->data), std::vector<float>(8, 1.0f));
  EXPECT_EQ(values(p[3].second->data), std::vector<float>(8, 0.0f));
  EXPECT_EQ(values(p[4].second->data), values(linear.weight().data));
  // Weight and bias streams of one layer are different streams.
  EXPECT_NE(init::derive_seed(42, "weight"), init::derive_seed(42, "bias"));
}

TEST(InitTest, KaimingRejectsANonPositiveFan) {
  Tensor w = Tensor::empty({2});
  EXPECT_THROW_WITH(init::kaiming_normal_fan_out(w, 0, 1), "fan_out must be positive");
}

}  // namespace
}  // namespace cudp
