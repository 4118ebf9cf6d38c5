// Linear on CUDA against its CPU path (the reference), forward and backward, on random inputs of
// odd sizes: outputs, input gradients, parameter gradients and buffers (layer_testing.h's
// expect_gpu_matches_cpu). The GPU sums in fp32, in another order than the CPU's double sums; for
// reductions of up to ~500 terms of magnitude <= 1 that stays within 1e-5 relative, with a small
// absolute term for outputs that cancel to near zero.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/sequential.h"
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

// bf16 and TF32 products on tensor cores. bf16: the CPU path rounds the operands as the GPU does,
// so the products agree exactly and 1e-4 covers the summation order (see conv2d_gpu_test.cpp).
// TF32: the CPU computes with the unrounded fp32 operands, so the difference is TF32's operand
// rounding, up to 2^-10 relative per operand: over 515 random-signed products of mean magnitude
// 1/4 that is a random walk of standard deviation about 4e-3, so 3e-2 absolute (7 sigma) holds;
// the fp32 kernels would pass it too, which the bf16 cases and the kernel tests rule out.
TEST(LinearGpuTest, TensorCorePrecisionsMatchTheCpuPath) {
  CUDP_REQUIRE_TENSOR_CORES();
  Linear linear(515, 129, true);
  testing::randomize_parameters(linear, 7);
  linear.set_precision(Precision::bf16);
  expect_gpu_matches_cpu(linear, random_tensor({3, 5, 515}, 8), 9, 1e-4, 1e-4);
  Linear small(37, 23, false);
  testing::randomize_parameters(small, 10);
  small.set_precision(Precision::bf16);
  expect_gpu_matches_cpu(small, random_tensor({13, 37}, 11), 12, 1e-4, 1e-4);
  linear.set_precision(Precision::tf32);
  expect_gpu_matches_cpu(linear, random_tensor({3, 5, 515}, 8), 9, 1e-3, 3e-2);
}

// The direct bf16 products (in_features a multiple of 8) where out_features is not one (a
// classifier's 10 classes: dy's bf16 rows padded with zeros, read with the longer row stride), and
// after a fused ReLU, whose mask pass writes the masked dy in bf16 itself (its bias gradient's last
// stage queued to the backward's end): the CPU path's values, as above.
TEST(LinearGpuTest, Bf16GradientsPaddedOrMaskedMatchTheCpuPath) {
  CUDP_REQUIRE_TENSOR_CORES();
  Linear head(512, 10, true);
  testing::randomize_parameters(head, 21);
  head.set_precision(Precision::bf16);
  expect_gpu_matches_cpu(head, random_tensor({256, 512}, 22), 23, 1e-4, 1e-4);
  auto net = std::make_shared<Sequential>();
  net->add(std::make_shared<Linear>(64, 40, true));
  net->add(std::make_shared<ReLU>(true));
  net->add(std::make_shared<Linear>(40, 10, true));
  testing::randomize_parameters(*net, 24);
  net->set_precision(Precision::bf16);
  const auto gpu = expect_gpu_matches_cpu(*net, random_tensor({33, 64}, 25), 26, 1e-4, 1e-4);
  EXPECT_TRUE((*std::static_pointer_cast<Sequential>(gpu))[0]->relu_fused());
}

}  // namespace
}  // namespace cudp
