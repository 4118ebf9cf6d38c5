// Host tests of GraphedStep (layers/train.h NOTE [Graphed training steps]) and of the capture
// bookkeeping it relies on (engine/core/memory.h NOTE [Allocations during stream capture]): on the
// CPU every step runs eagerly, through the body, with results identical to train_step_async on an
// identical model; bad options are refused with messages that name them. (Capture and replay need
// a GPU: graphed_step_gpu_test.cpp.)
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/tensor_bytes.h"
#include "engine/core/memory.h"
#include "layers/activation.h"
#include "layers/dropout.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/sequential.h"
#include "layers/train.h"

namespace cudp {
namespace {

using testing::bytes_of;
using testing::random_vector;

std::shared_ptr<Module> mlp() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Flatten>(), std::make_shared<Linear>(4 * 4 * 2, 16, true, 41),
      std::make_shared<ReLU>(true), std::make_shared<Dropout>(0.25f, 42),
      std::make_shared<Linear>(16, 5, true, 43)});
}

std::pair<Tensor, Tensor> batch(int n, uint64_t seed) {
  std::vector<int32_t> labels(n);
  std::mt19937 gen(static_cast<uint32_t>(seed));
  for (auto& l : labels) l = static_cast<int32_t>(gen() % 5);
  return {
      Tensor::from_vector(random_vector(static_cast<size_t>(n) * 4 * 4 * 2, seed), {n, 4, 4, 2}),
      Tensor::from_vector(labels, {n})};
}

TEST(GraphedStep, RunsEveryStepEagerlyOnTheCpuWithTrainStepsResults) {
  auto a = mlp();
  auto b = a->clone(Device::cpu());
  SGD sgd_a(a->parameters(), {.lr = 0.1, .momentum = 0.9});
  SGD sgd_b(b->parameters(), {.lr = 0.1, .momentum = 0.9});
  CrossEntropyLoss loss_a, loss_b;
  GraphedStep graphed(*b, loss_b, sgd_b);
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto [images, labels] = batch(step == 3 ? 3 : 6, 7 + step);
    sgd_a.set_lr(0.1 / (step + 1));
    sgd_b.set_lr(0.1 / (step + 1));
    const StepResult expected = train_step_async(*a, loss_a, sgd_a, images, labels).wait();
    const StepResult got = graphed.step(images, labels).wait();
    EXPECT_EQ(got.loss, expected.loss);
    EXPECT_EQ(got.correct, expected.correct);
    EXPECT_EQ(got.count, expected.count);
  }
  EXPECT_FALSE(graphed.captured());
  EXPECT_EQ(graphed.replays(), 0);
  EXPECT_EQ(graphed.eager_steps(), 5);
  EXPECT_EQ(bytes_of(b->state_dict()), bytes_of(a->state_dict()));
  EXPECT_EQ(bytes_of(sgd_b.state_dict()), bytes_of(sgd_a.state_dict()));
}

TEST(GraphedStep, RefusesBadOptionsByName) {
  const GraphedStep::Body body = [](const Tensor&, const Tensor&) { return TensorList{}; };
  try {
    GraphedStepOptions options;
    options.warmup_steps = 0;
    GraphedStep g(body, Device::cpu(), options);
    FAIL() << "warmup_steps 0 was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("warmup_steps must be at least 1"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(GraphedStep(GraphedStep::Body{}, Device::cpu(), {}), ValueError);
  GraphedStep g(body, Device::cpu(), {});
  EXPECT_THROW(g.step(Tensor::zeros({2, 4, 4, 2}), Tensor::zeros({2}, DType::i32)), ValueError)
      << "a body without {loss, correct} must be refused by step()";
}

// One capture at a time: a second one is refused with a message saying so; frees outside a
// capture are not deferred.
TEST(CaptureBookkeeping, OneCaptureAtATime) {
  EXPECT_FALSE(cuda::capture_is_open());
  cuda::begin_capture_allocations();
  EXPECT_TRUE(cuda::capture_is_open());
  try {
    cuda::begin_capture_allocations();
    ADD_FAILURE() << "a second capture was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("already open"), std::string::npos) << e.what();
  }
  cuda::end_capture_allocations();
  EXPECT_FALSE(cuda::capture_is_open());
  cuda::begin_capture_allocations();  // open again after the end
  cuda::end_capture_allocations();
}

}  // namespace
}  // namespace cudp
