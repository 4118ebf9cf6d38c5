// MaxPool2d and AdaptiveAvgPool2d on CUDA against its CPU path (the reference), forward and
// backward, on random inputs of odd sizes: outputs, input gradients, parameter gradients and
// buffers (layer_testing.h's expect_gpu_matches_cpu). Maxima are exact; averages and
// overlapping-window gradient sums are a few fp32 additions: 1e-5 relative.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/pooling.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::expect_gpu_matches_cpu;
using testing::random_tensor;

TEST(PoolingGpuTest, MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  MaxPool2d pool(2);
  expect_gpu_matches_cpu(pool, random_tensor({3, 9, 11, 5}, 1), 2, 0, 0);
  MaxPool2d overlapping(3, 2, 1);
  expect_gpu_matches_cpu(overlapping, random_tensor({2, 13, 7, 8}, 3), 4, 1e-6, 1e-6);
  AdaptiveAvgPool2d adaptive(3, 5);
  expect_gpu_matches_cpu(adaptive, random_tensor({2, 7, 11, 6}, 5), 6, 1e-5, 1e-6);
  AdaptiveAvgPool2d grow(7);
  expect_gpu_matches_cpu(grow, random_tensor({2, 1, 1, 12}, 7), 8, 1e-5, 1e-6);
  AdaptiveAvgPool2d identity(4, 4);
  expect_gpu_matches_cpu(identity, random_tensor({2, 4, 4, 3}, 9), 10, 0, 0);
}

}  // namespace
}  // namespace cudp
