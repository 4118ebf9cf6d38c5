// BatchNorm2d on CUDA against its CPU path (the reference), forward and backward, on random inputs
// of odd sizes: outputs, input gradients, parameter gradients and buffers (layer_testing.h's
// expect_gpu_matches_cpu). Statistics are fp32 reductions on the GPU (double on the CPU), and
// dividing by the standard deviation amplifies their error a little: 1e-4 relative.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/batchnorm.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::expect_gpu_matches_cpu;
using testing::random_tensor;
using testing::values;

TEST(BatchNorm2dGpuTest, MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  BatchNorm2d bn(13);
  testing::randomize_parameters(bn, 1);
  auto gpu = expect_gpu_matches_cpu(bn, random_tensor({3, 7, 5, 13}, 2, -2.f, 3.f), 3, 1e-4, 1e-5);
  EXPECT_EQ(std::static_pointer_cast<BatchNorm2d>(gpu)->num_batches_tracked(), 1);
  // Evaluation with the running statistics the training step left.
  bn.eval();
  gpu->eval();
  const Tensor x = random_tensor({2, 3, 3, 13}, 4);
  EXPECT_ALL_CLOSE(values(gpu->forward(x.cuda(0))), values(bn.forward(x)), 1e-5, 1e-5);
  // Backward through frozen statistics.
  expect_gpu_matches_cpu(bn, random_tensor({2, 5, 3, 13}, 5), 6, 1e-5, 1e-5);
  // The count reaches the device buffer without a host synchronisation in forward.
  gpu->train();
  gpu->forward(x.cuda(0));
  EXPECT_EQ(gpu->state_dict().at("num_batches_tracked").to_vector<int64_t>(),
            std::vector<int64_t>{2});
}

}  // namespace
}  // namespace cudp
