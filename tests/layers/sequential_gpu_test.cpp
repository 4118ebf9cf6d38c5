// Sequential on CUDA against its CPU path (the reference), forward and backward, on random inputs
// of odd sizes: outputs, input gradients, parameter gradients and buffers (layer_testing.h's
// expect_gpu_matches_cpu). A conv-BN-ReLU-pool-flatten-linear-dropout chain; errors of fp32 sums
// compound over the layers: 1e-4 relative.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dropout.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::expect_gpu_matches_cpu;
using testing::random_tensor;

TEST(SequentialGpuTest, MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  Sequential seq({std::make_shared<Conv2d>(3, 8, 3, 1, 1), std::make_shared<BatchNorm2d>(8),
                  std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2),
                  std::make_shared<Flatten>(), std::make_shared<Linear>(8 * 4 * 5, 6),
                  std::make_shared<Dropout>(0.5f, 3)});
  expect_gpu_matches_cpu(seq, random_tensor({4, 9, 11, 3}, 1), 2, 1e-4, 1e-4);
}

}  // namespace
}  // namespace cudp
