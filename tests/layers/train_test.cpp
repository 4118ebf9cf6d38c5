// Host tests of the training helpers: a short CPU run on a learnable synthetic set (the loss falls,
// the accuracy rises), evaluation, and the step's bookkeeping.
#include "layers/train.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <random>

#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"

namespace cudp {
namespace {

// Two classes of 8x8 one-channel images: a bright horizontal bar (class 0) or vertical bar
// (class 1) at a random position, over uniform noise. NHWC [n, 8, 8, 1] and i32 labels.
struct Batch {
  Tensor images, labels;
};

Batch make_batch(int n, uint64_t seed) {
  std::mt19937 gen(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> noise(0.f, 0.3f);
  std::uniform_int_distribution<int> position(0, 7), label(0, 1);
  std::vector<float> pixels(static_cast<size_t>(n) * 64);
  std::vector<int32_t> labels(n);
  for (int i = 0; i < n; ++i) {
    labels[i] = label(gen);
    const int at = position(gen);
    for (int y = 0; y < 8; ++y) {
      for (int x = 0; x < 8; ++x) {
        const bool on_bar = labels[i] == 0 ? y == at : x == at;
        pixels[i * 64 + y * 8 + x] = noise(gen) + (on_bar ? 1.f : 0.f);
      }
    }
  }
  return {Tensor::from_vector(pixels, {n, 8, 8, 1}), Tensor::from_vector(labels, {n})};
}

std::shared_ptr<Sequential> tiny_net() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 8, 3, 1, 1, true, 11), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2),
      std::make_shared<Conv2d>(8, 8, 3, 1, 1, true, 12), std::make_shared<ReLU>(true),
      std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(8 * 2 * 2, 2, true, 13)});
}

BatchSource batches_of(const std::vector<Batch>& batches) {
  auto next = std::make_shared<size_t>(0);
  return [&batches, next](Tensor& images, Tensor& labels) {
    if (*next == batches.size()) return false;
    images = batches[*next].images;
    labels = batches[(*next)++].labels;
    return true;
  };
}

TEST(Train, ShortCpuRunLearnsBarsOrientation) {
  auto model = tiny_net();
  SGD sgd(model->parameters(), {.lr = 0.05, .momentum = 0.9});
  CrossEntropyLoss criterion;
  const std::vector<Batch> test = {make_batch(64, 1000), make_batch(36, 1001)};
  const EvalResult before = evaluate(*model, criterion, batches_of(test));
  EXPECT_EQ(before.count, 100);

  std::vector<float> losses;
  int64_t early_correct = 0, late_correct = 0;
  const int steps = 40;
  for (int s = 0; s < steps; ++s) {
    const Batch batch = make_batch(32, s);
    const StepResult r = train_step(*model, criterion, sgd, batch.images, batch.labels);
    EXPECT_EQ(r.count, 32);
    EXPECT_TRUE(std::isfinite(r.loss));
    losses.push_back(r.loss);
    if (s < 5) early_correct += r.correct;
    if (s >= steps - 5) late_correct += r.correct;
  }
  const float first = (losses[0] + losses[1] + losses[2]) / 3;
  const float last = (losses[steps - 1] + losses[steps - 2] + losses[steps - 3]) / 3;
  EXPECT_LT(last, 0.5f * first) << "loss fell from " << first << " to " << last;
  EXPECT_GT(late_correct, early_correct);

  const EvalResult after = evaluate(*model, criterion, batches_of(test));
  std::printf("loss %.4f -> %.4f; held-out accuracy %.2f -> %.2f\n", first, last, before.accuracy(),
              after.accuracy());
  EXPECT_GE(after.accuracy(), 0.9)
      << "held-out accuracy " << after.accuracy() << " (before " << before.accuracy() << ")";
  EXPECT_LT(after.loss, before.loss);
  EXPECT_TRUE(model->is_training());  // evaluate restored the flag
}

TEST(Train, AsyncStepReportsWhatTheSyncStepDoes) {
  auto a = tiny_net(), b = tiny_net();
  SGD sa(a->parameters(), {.lr = 0.05}), sb(b->parameters(), {.lr = 0.05});
  CrossEntropyLoss ca, cb;
  const Batch batch = make_batch(16, 5);
  const StepResult sync = train_step(*a, ca, sa, batch.images, batch.labels);
  const PendingStep pending = train_step_async(*b, cb, sb, batch.images, batch.labels);
  const StepResult async = pending.wait();
  EXPECT_EQ(sync.loss, async.loss);
  EXPECT_EQ(sync.correct, async.correct);
  EXPECT_EQ(async.count, 16);
  EXPECT_EQ(pending.loss.shape(), Shape{});
}

TEST(Train, CountsCorrectAsTheArgmaxOfTheTrainingOutputs) {
  auto model = tiny_net();
  SGD sgd(model->parameters(), {.lr = 0.0});  // lr 0: the step leaves the model unchanged
  CrossEntropyLoss criterion;
  const Batch batch = make_batch(20, 9);
  // In training mode BatchNorm normalises with the batch's statistics: the same batch gives the
  // same outputs again.
  const int64_t expected = num_correct(model->forward(batch.images), batch.labels);
  const StepResult r = train_step(*model, criterion, sgd, batch.images, batch.labels);
  EXPECT_EQ(r.correct, expected);
}

TEST(Train, RejectsBadLabelsNamingThem) {
  auto model = tiny_net();
  SGD sgd(model->parameters(), {.lr = 0.05});
  CrossEntropyLoss criterion;
  Batch batch = make_batch(4, 3);
  batch.labels = Tensor::from_vector<int32_t>({0, 1, 5, 0}, {4});
  try {
    train_step(*model, criterion, sgd, batch.images, batch.labels);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("Target 5 is out of bounds"), std::string::npos)
        << e.what();
  }
}

TEST(Train, EvaluateOfNothingIsEmpty) {
  auto model = tiny_net();
  CrossEntropyLoss criterion;
  const EvalResult r = evaluate(*model, criterion, [](Tensor&, Tensor&) { return false; });
  EXPECT_EQ(r.count, 0);
  EXPECT_EQ(r.accuracy(), 0.0);
}

}  // namespace
}  // namespace cudp
