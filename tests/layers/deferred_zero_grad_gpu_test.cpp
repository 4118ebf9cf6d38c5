// GPU tests of deferred zeroing (layers/module.h, NOTE [Deferred zeroing]): the CUDA paths of
// Conv2d and Linear under every precision (fp32 SIMT, TF32 and bf16 tensor cores: the beta-0
// epilogues, split-K reductions, the padded first layer's and the transposed weight gradients'
// write-backs), per parameter and flat (zero_ranges), with accumulation, against the same network
// zeroed first (deferred_zero_grad_testing.h); and a parameter no backward writes.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "tests/layers/deferred_zero_grad_testing.h"

namespace cudp::testing {
namespace {

class DeferredZeroGradGpu : public ::testing::TestWithParam<std::tuple<Precision, bool>> {};

TEST_P(DeferredZeroGradGpu, EqualsZeroingFirst) {
  CUDP_REQUIRE_GPU();
  const auto [precision, flat] = GetParam();
  if (precision != Precision::fp32) CUDP_REQUIRE_TENSOR_CORES();
  expect_deferred_zeroing_equals_zeroing_first(
      {.device = Device::cuda(0), .precision = precision, .flat = flat});
}

TEST_P(DeferredZeroGradGpu, AccumulatedMicroBatchesEqualZeroingFirst) {
  CUDP_REQUIRE_GPU();
  const auto [precision, flat] = GetParam();
  if (precision != Precision::fp32) CUDP_REQUIRE_TENSOR_CORES();
  expect_deferred_zeroing_equals_zeroing_first(
      {.device = Device::cuda(0), .precision = precision, .flat = flat, .micro_batches = 3});
}

INSTANTIATE_TEST_SUITE_P(Gpu, DeferredZeroGradGpu,
                         ::testing::Combine(::testing::Values(Precision::fp32, Precision::tf32,
                                                              Precision::bf16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(precision_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "Flat" : "PerParameter");
                         });

TEST(DeferredZeroGradGpuUnused, AnUnusedParameterCountsAsZero) {
  CUDP_REQUIRE_GPU();
  expect_unused_parameter_counts_as_zero(Device::cuda(0), false);
  expect_unused_parameter_counts_as_zero(Device::cuda(0), true);
}

}  // namespace
}  // namespace cudp::testing
