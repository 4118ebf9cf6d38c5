// ReLU on CUDA against its CPU path (the reference), forward and backward, on random inputs of
// odd sizes: outputs, input gradients, parameter gradients and buffers (layer_testing.h's
// expect_gpu_matches_cpu). One comparison per element: the results must be identical.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/activation.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::expect_gpu_matches_cpu;
using testing::random_tensor;

TEST(ReLUGpuTest, MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  ReLU relu;
  expect_gpu_matches_cpu(relu, random_tensor({3, 7, 5, 9}, 1), 2, 0, 0);
  ReLU inplace(true);
  expect_gpu_matches_cpu(inplace, random_tensor({1001}, 3), 4, 0, 0);
}

}  // namespace
}  // namespace cudp
