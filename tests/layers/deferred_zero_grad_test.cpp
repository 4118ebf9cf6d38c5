// Host tests of deferred zeroing (layers/module.h, NOTE [Deferred zeroing]): the CPU paths of
// Conv2d and Linear under every precision, per parameter and flat, with accumulation, against the
// same network zeroed first (deferred_zero_grad_testing.h); a parameter no backward writes; and
// the flags that fill, Module::zero_grad and train_step leave.
#include <gtest/gtest.h>

#include "tests/layers/deferred_zero_grad_testing.h"

namespace cudp::testing {
namespace {

class DeferredZeroGrad : public ::testing::TestWithParam<std::tuple<Precision, bool>> {};

TEST_P(DeferredZeroGrad, EqualsZeroingFirst) {
  const auto [precision, flat] = GetParam();
  expect_deferred_zeroing_equals_zeroing_first(
      {.device = Device::cpu(), .precision = precision, .flat = flat});
}

TEST_P(DeferredZeroGrad, AccumulatedMicroBatchesEqualZeroingFirst) {
  const auto [precision, flat] = GetParam();
  // Three micro-batches of 3, 3 and 2 rows: the first backward writes, the others add.
  expect_deferred_zeroing_equals_zeroing_first(
      {.device = Device::cpu(), .precision = precision, .flat = flat, .micro_batches = 3});
}

INSTANTIATE_TEST_SUITE_P(Cpu, DeferredZeroGrad, kDeferredZeroingCases, deferred_zeroing_case_name);

TEST(DeferredZeroGradCpu, AnUnusedParameterCountsAsZero) {
  expect_unused_parameter_counts_as_zero(Device::cpu(), false);
  expect_unused_parameter_counts_as_zero(Device::cpu(), true);
}

TEST(DeferredZeroGradCpu, FillAndModuleZeroGradClearTheFlags) {
  auto net = deferred_zeroing_net();
  SGD opt(net->parameters(), {.lr = 0.1});
  opt.zero_grad(ZeroGrad::deferred);
  size_t pending = 0;
  for (Parameter* p : net->parameters()) pending += p->grad_zero_pending ? 1 : 0;
  EXPECT_EQ(pending, deferred_parameter_names().size());
  fill_gradients(*net, kStaleNaN);
  opt.zero_grad();  // fill: every gradient zero, nothing pending
  for (Parameter* p : net->parameters()) {
    EXPECT_FALSE(p->grad_zero_pending);
    EXPECT_EQ(p->grad.to_vector<float>(), std::vector<float>(p->grad.numel(), 0.f));
  }
  opt.zero_grad(ZeroGrad::deferred);
  fill_gradients(*net, kStaleNaN);
  net->zero_grad();
  for (Parameter* p : net->parameters()) {
    EXPECT_FALSE(p->grad_zero_pending);
    EXPECT_EQ(p->grad.to_vector<float>(), std::vector<float>(p->grad.numel(), 0.f));
  }
}

// train_step defers; three of its steps against zero_grad(), backward and step by hand.
TEST(DeferredZeroGradCpu, TrainStepEqualsTheStepWithZeroingFirst) {
  auto by_hand = deferred_zeroing_net(), stepped = deferred_zeroing_net();
  SGD hand_opt(by_hand->parameters(), {.lr = 0.05, .momentum = 0.9});
  SGD step_opt(stepped->parameters(), {.lr = 0.05, .momentum = 0.9});
  fill_gradients(*stepped, kStaleNaN);
  CrossEntropyLoss hand_loss, step_loss;
  for (int step = 0; step < 3; ++step) {
    const Tensor x = deferred_zeroing_images(6, 60 + step, Device::cpu());
    const Tensor y = deferred_zeroing_labels(6, step, Device::cpu());
    by_hand->set_input_grad(false);  // as train_step does
    hand_loss.forward(by_hand->forward(x), y);
    hand_opt.zero_grad();
    by_hand->backward(hand_loss.backward());
    hand_opt.step();
    const StepResult r = train_step(*stepped, step_loss, step_opt, x, y);
    EXPECT_TRUE(std::isfinite(r.loss));
  }
  const auto want = by_hand->named_parameters(), got = stepped->named_parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    expect_same_values(got[i].second->data, want[i].second->data, got[i].first);
  }
}

TEST(DeferredZeroGradCpu, GradBetaIsZeroUntilTheWrite) {
  Parameter p{Tensor::zeros({2}), Tensor::zeros({2})};
  EXPECT_EQ(p.grad_beta(), 1.f);
  p.grad_zero_pending = true;
  EXPECT_EQ(p.grad_beta(), 0.f);
  EXPECT_EQ(p.grad_beta(), 0.f);  // asking does not clear it: a backward that throws leaves it
  p.grad_written();
  EXPECT_FALSE(p.grad_zero_pending);
  EXPECT_EQ(p.grad_beta(), 1.f);
}

// A backward that fails before its write (here: a gradient of the wrong shape) leaves the gradient
// counting as zero, so that the backward run again writes it rather than adding to stale values.
TEST(DeferredZeroGradCpu, ABackwardThatThrowsLeavesTheFlag) {
  Linear linear(4, 3, true, 5);
  SGD opt(linear.parameters(), {.lr = 0.1});
  opt.zero_grad(ZeroGrad::deferred);
  poison_pending_gradients(linear);
  const Tensor x = Tensor::from_vector(random_vector(8, 7), {2, 4});
  linear.forward(x);
  EXPECT_THROW(linear.backward(Tensor::zeros({2, 5})), ValueError);
  for (Parameter* p : linear.parameters()) EXPECT_TRUE(p->grad_zero_pending);
  linear.forward(x);
  linear.backward(Tensor::from_vector(random_vector(6, 8), {2, 3}));
  for (Parameter* p : linear.parameters()) {
    EXPECT_FALSE(p->grad_zero_pending);
    for (float g : p->grad.to_vector<float>()) EXPECT_TRUE(std::isfinite(g));
  }
}

// An optimizer over a parameter without a gradient zeroes the others and reports that one at
// step(), in either mode.
TEST(DeferredZeroGradCpu, AParameterWithoutAGradientIsSkippedByZeroGrad) {
  Parameter with{Tensor::zeros({3}), Tensor::from_vector(std::vector<float>{1, 2, 3}, {3})};
  Parameter without{Tensor::zeros({2}), Tensor()};
  SGD opt({&with, &without}, {.lr = 0.1});
  EXPECT_NO_THROW(opt.zero_grad());
  EXPECT_EQ(with.grad.to_vector<float>(), std::vector<float>(3, 0.f));
  with.backward_writes_grad = without.backward_writes_grad = true;
  EXPECT_NO_THROW(opt.zero_grad(ZeroGrad::deferred));
  EXPECT_TRUE(with.grad_zero_pending);
  EXPECT_FALSE(without.grad_zero_pending);
  EXPECT_THROW(opt.step(), ValueError);
}

}  // namespace
}  // namespace cudp::testing
