// Flatten on CUDA against its CPU path (the reference), forward and backward, on random inputs of
// odd sizes: outputs, input gradients, parameter gradients and buffers (layer_testing.h's
// expect_gpu_matches_cpu). A transpose: results must be identical.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/flatten.h"
#include "layers/precision.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::expect_gpu_matches_cpu;
using testing::random_tensor;

TEST(FlattenGpuTest, MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  Flatten flatten;
  expect_gpu_matches_cpu(flatten, random_tensor({3, 5, 7, 9}, 1), 2, 0, 0);
  expect_gpu_matches_cpu(flatten, random_tensor({3, 1, 1, 9}, 3), 4, 0, 0);
  // bf16 activations (the bf16 policy): moved as they are, the CPU path's bits.
  expect_gpu_matches_cpu(flatten, convert(random_tensor({3, 5, 7, 9}, 5), DType::bf16), 6, 0, 0);
  expect_gpu_matches_cpu(flatten, convert(random_tensor({3, 1, 1, 9}, 7), DType::bf16), 8, 0, 0);
}

}  // namespace
}  // namespace cudp
