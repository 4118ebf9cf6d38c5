// Linear on CUDA against its CPU path (the reference), forward and backward, on random inputs of
// odd sizes: outputs, input gradients, parameter gradients and buffers (layer_testing.h's
// expect_gpu_matches_cpu). The GPU sums in fp32, in another order than the CPU's double sums; for
// reductions of up to ~500 terms of magnitude <= 1 that stays within 1e-5 relative, with a small
// absolute term for outputs that cancel to near zero.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/linear.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::expect_gpu_matches_cpu;
using testing::random_tensor;

TEST(LinearGpuTest, MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  Linear linear(37, 23, true);
  testing::randomize_parameters(linear, 1);
  expect_gpu_matches_cpu(linear, random_tensor({13, 37}, 2), 3, 1e-5, 1e-5);
  Linear wide(515, 129, false);
  testing::randomize_parameters(wide, 4);
  expect_gpu_matches_cpu(wide, random_tensor({3, 5, 515}, 5), 6, 1e-5, 1e-4);
}

}  // namespace
}  // namespace cudp
