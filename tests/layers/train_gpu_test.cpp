// GPU tests of the training helpers: K steps of a small conv net on CUDA against the same steps on
// the CPU, evaluation, and label checks on both sides of the upload.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <tuple>

#include "common/compare.h"
#include "common/gpu.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/train.h"

namespace cudp {
namespace {

using testing::all_close;
using testing::random_vector;

const Device kGpu = Device::cuda(0);

std::shared_ptr<Module> net() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, 8, 3, 1, 1, true, 21), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2),
      std::make_shared<Conv2d>(8, 16, 3, 1, 1, true, 22), std::make_shared<ReLU>(true),
      std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(16 * 3 * 3, 10, true, 23)});
}

// Images NHWC [n, 12, 12, 3] and labels in [0, 10), on the host.
std::pair<Tensor, Tensor> batch(int n, uint64_t seed) {
  std::vector<int32_t> labels(n);
  std::mt19937 gen(static_cast<uint32_t>(seed));
  for (auto& l : labels) l = static_cast<int32_t>(gen() % 10);
  return {Tensor::from_vector(random_vector(static_cast<size_t>(n) * 12 * 12 * 3, seed),
                              {n, 12, 12, 3}),
          Tensor::from_vector(labels, {n})};
}

TEST(TrainGpu, StepsMatchTheCpu) {
  CUDP_REQUIRE_GPU();
  auto cpu = net();
  auto gpu = cpu->clone(kGpu);
  SGDOptions o{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4};
  SGD cpu_sgd(cpu->parameters(), o), gpu_sgd(gpu->parameters(), o);
  CrossEntropyLoss cpu_loss, gpu_loss;
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto [images, labels] = batch(13, step);  // odd batch
    const StepResult c = train_step(*cpu, cpu_loss, cpu_sgd, images, labels);
    const StepResult g = train_step(*gpu, gpu_loss, gpu_sgd, images, labels);  // host inputs
    EXPECT_TRUE(all_close({g.loss}, std::vector<float>{c.loss}, 1e-4, 1e-6));
    EXPECT_EQ(g.count, c.count);
    EXPECT_EQ(g.correct, c.correct);
  }
  // fp32 kernels against double-accumulating references through five updates of a conv net.
  const TensorMap a = gpu->state_dict(), b = cpu->state_dict();
  for (const auto& [name, t] : b) {
    if (t.dtype() != DType::f32) continue;  // num_batches_tracked
    EXPECT_TRUE(all_close(a.at(name).to_vector<float>(), t.to_vector<float>(), 1e-4, 1e-5)) << name;
  }
}

TEST(TrainGpu, AsyncStepsAndEvaluation) {
  CUDP_REQUIRE_GPU();
  auto model = net()->clone(kGpu);
  AdamW adamw(model->parameters(), {.lr = 1e-3});
  CrossEntropyLoss criterion;
  std::vector<PendingStep> pending;
  for (int step = 0; step < 4; ++step) {
    const auto [images, labels] = batch(16, 100 + step);
    pending.push_back(train_step_async(*model, criterion, adamw, images.to(kGpu), labels.to(kGpu)));
  }
  for (const PendingStep& p : pending) {
    const StepResult r = p.wait();
    EXPECT_TRUE(std::isfinite(r.loss));
    EXPECT_EQ(r.count, 16);
  }

  std::vector<std::pair<Tensor, Tensor>> test = {batch(20, 7), batch(9, 8)};
  size_t next = 0;
  const BatchSource source = [&](Tensor& images, Tensor& labels) {
    if (next == test.size()) return false;
    std::tie(images, labels) = test[next++];
    return true;
  };
  const EvalResult on_gpu = evaluate(*model, criterion, source);
  auto host_copy = model->clone(Device::cpu());
  next = 0;
  const EvalResult on_cpu = evaluate(*host_copy, criterion, source);
  EXPECT_EQ(on_gpu.count, 29);
  EXPECT_EQ(on_gpu.correct, on_cpu.correct);
  EXPECT_NEAR(on_gpu.loss, on_cpu.loss, 1e-4 * std::fabs(on_cpu.loss));
  EXPECT_TRUE(model->is_training());
}

void expect_bad_label_error(const std::function<void()>& run) {
  try {
    run();
    ADD_FAILURE() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("Target 12 is out of bounds"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("index 1"), std::string::npos) << e.what();
  }
}

TEST(TrainGpu, BadLabelsAreCaughtOnTheHostOrThroughTheFlag) {
  CUDP_REQUIRE_GPU();
  auto model = net()->clone(kGpu);
  SGD sgd(model->parameters(), {.lr = 0.01});
  CrossEntropyLoss criterion;
  auto [images, labels] = batch(3, 1);
  labels = Tensor::from_vector<int32_t>({1, 12, 0}, {3});
  expect_bad_label_error([&] { train_step(*model, criterion, sgd, images, labels); });  // host
  expect_bad_label_error(
      [&] { train_step(*model, criterion, sgd, images.to(kGpu), labels.to(kGpu)); });  // device
}

}  // namespace
}  // namespace cudp
