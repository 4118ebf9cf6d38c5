// GPU tests of deferred zeroing (layers/module.h, NOTE [Deferred zeroing]): the CUDA paths of
// Conv2d and Linear under every precision (fp32 SIMT, TF32 and bf16 tensor cores: the beta-0
// epilogues, split-K reductions, the padded first layer's and the transposed weight gradients'
// write-backs), per parameter and flat (zero_ranges), with accumulation, against the same network
// zeroed first (deferred_zero_grad_testing.h); and a parameter no backward writes.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "kernels/conv2d.h"
#include "tests/layers/deferred_zero_grad_testing.h"

namespace cudp::testing {
namespace {

class DeferredZeroGradGpu : public ::testing::TestWithParam<std::tuple<Precision, bool>> {};

TEST_P(DeferredZeroGradGpu, EqualsZeroingFirst) {
  CUDP_REQUIRE_GPU();
  const auto [precision, flat] = GetParam();
  if (precision != Precision::fp32) CUDP_REQUIRE_TENSOR_CORES();
  expect_deferred_zeroing_equals_zeroing_first(
      {.device = Device::cuda(0), .precision = precision, .flat = flat, .net = kWideNet});
}

TEST_P(DeferredZeroGradGpu, AccumulatedMicroBatchesEqualZeroingFirst) {
  CUDP_REQUIRE_GPU();
  const auto [precision, flat] = GetParam();
  if (precision != Precision::fp32) CUDP_REQUIRE_TENSOR_CORES();
  expect_deferred_zeroing_equals_zeroing_first({.device = Device::cuda(0),
                                                .precision = precision,
                                                .flat = flat,
                                                .micro_batches = 3,
                                                .net = kWideNet});
}

// TF32's backward-weight boxes with split-K forced (3 splits, 128 wide), so that the split
// reduction's beta 0 runs whatever the planner picks for these shapes.
TEST(DeferredZeroGradGpuSplit, Tf32BoxesSplitKEqualsZeroingFirst) {
  CUDP_REQUIRE_TENSOR_CORES();
  kernels::detail::set_tf32_wgrad_plan(128, 3);
  expect_deferred_zeroing_equals_zeroing_first(
      {.device = Device::cuda(0), .precision = Precision::tf32, .flat = true, .net = kWideNet});
  kernels::detail::set_tf32_wgrad_plan(0, 0);
}

INSTANTIATE_TEST_SUITE_P(Gpu, DeferredZeroGradGpu, kDeferredZeroingCases,
                         deferred_zeroing_case_name);

// A backward that throws after it asked for the weight gradient's beta (a strided TF32 layer's
// input gradient: backward-data on the tensor cores takes stride 1 only, and it runs before
// backward-weight) leaves the gradient counting as zero.
TEST(DeferredZeroGradGpuThrow, ABackwardThatThrowsBeforeItsWriteLeavesTheFlag) {
  CUDP_REQUIRE_TENSOR_CORES();
  Conv2d conv(8, 16, 3, 2, 1, true, 3);
  conv.to(Device::cuda(0));
  conv.set_precision(Precision::tf32);
  SGD opt(conv.parameters(), {.lr = 0.1});
  opt.zero_grad(ZeroGrad::deferred);
  const Tensor x = Tensor::from_vector(random_vector(2 * 8 * 8 * 8, 9), {2, 8, 8, 8});
  const Tensor y = conv.forward(x.to(Device::cuda(0)));
  EXPECT_ANY_THROW(conv.backward(Tensor::zeros(y.shape(), DType::f32, Device::cuda(0))));
  EXPECT_TRUE(conv.parameters()[0]->grad_zero_pending);
}

TEST(DeferredZeroGradGpuUnused, AnUnusedParameterCountsAsZero) {
  CUDP_REQUIRE_GPU();
  expect_unused_parameter_counts_as_zero(Device::cuda(0), false);
  expect_unused_parameter_counts_as_zero(Device::cuda(0), true);
}

}  // namespace
}  // namespace cudp::testing
