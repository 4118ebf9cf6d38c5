// A small VGG with batch normalisation, forward and backward on CUDA against the CPU path. Eleven
// layers of fp32 GPU sums in another order than the CPU's double ones, amplified by batch
// normalisation's division by small standard deviations, so the tolerance is 1e-3 relative.
#include <gtest/gtest.h>

#include <cmath>

#include "common/gpu.h"
#include "layers/conv2d.h"
#include "layers/init.h"
#include "layers/linear.h"
#include "layers/vgg.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

TEST(VggGpuTest, SmallVggBnMatchesTheCpu) {
  CUDP_REQUIRE_GPU();
  auto net = vgg11({.in_channels = 1,
                    .num_classes = 10,
                    .batch_norm = true,
                    .head = VggHead::Compact,
                    .seed = 3});
  testing::expect_gpu_matches_cpu(*net, random_tensor({4, 32, 32, 1}, 1), 2, 1e-3, 1e-4);
}

// The fast way to a big model on a GPU: build without initialising, move, initialise there. The
// values are the ones a CPU build gives (Philox is the same function on both).
TEST(VggGpuTest, TorchvisionHeadInitialisedOnTheGpu) {
  CUDP_REQUIRE_GPU();
  auto net = std::make_shared<Vgg>(init::skip_init, 'A', VggOptions{.num_classes = 7, .seed = 4});
  net->cuda(0);
  init::reset_parameters(*net, 4);
  Conv2d first(3, 64, 3, 1, 1, true, init::derive_seed(4, "features.0"));
  // Philox's bits are identical; the GPU's logf/cosf in Box-Muller may differ from the host's by
  // an ulp.
  EXPECT_ALL_CLOSE(values(net->named_parameters()[0].second->data), values(first.weight().data),
                   1e-6, 1e-9);
  Linear last(4096, 7, true, init::derive_seed(4, "classifier.6"));
  EXPECT_ALL_CLOSE(values(net->classifier()->named_parameters()[4].second->data),
                   values(last.weight().data), 1e-6, 1e-9);

  const Tensor y = net->forward(random_tensor({2, 64, 64, 3}, 5).cuda(0));
  EXPECT_EQ(y.shape(), (Shape{2, 7}));
  const Tensor dx = net->backward(random_tensor({2, 7}, 6).cuda(0));
  EXPECT_EQ(dx.shape(), (Shape{2, 64, 64, 3}));
  for (float v : values(y)) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace cudp
