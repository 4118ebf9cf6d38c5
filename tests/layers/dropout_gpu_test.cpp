// Dropout on CUDA against its CPU path (the reference), forward and backward, on random inputs of
// odd sizes: outputs, input gradients, parameter gradients and buffers (layer_testing.h's
// expect_gpu_matches_cpu). The mask is the same Philox function on both: results must be identical.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/dropout.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::expect_gpu_matches_cpu;
using testing::random_tensor;

TEST(DropoutGpuTest, MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  Dropout dropout(0.3f, 17);
  dropout.set_offset(6);  // not a multiple of 4: the kernels' unaligned path
  auto gpu = expect_gpu_matches_cpu(dropout, random_tensor({5, 37}, 1), 2, 0, 0);
  EXPECT_EQ(std::static_pointer_cast<Dropout>(gpu)->offset(), dropout.offset());
}

}  // namespace
}  // namespace cudp
