// Gradient accumulation on the CPU (layers/train.h, forward_backward_micro_batches): N
// micro-batches against one batch of all their rows, same model, same data.
//
// The tolerance, derived. Write each parameter gradient element as g = sum over samples s of t_s
// (sample s's contribution, which carries the factor 1/B). One batch forms every t_s with the
// 1/B inside dlogits and sums them in one GEMM; the CPU kernels accumulate in double and round once
// to fp32 (docs/architecture.md §2.5). The accumulated path forms micro-batch j's dlogits as
// (softmax - onehot) * (n_j / B) / n_j, which rounds differently from (softmax - onehot) / B by at
// most 2 units of u = 2^-24 relative, sums the micro-batch in one GEMM (one rounding) and adds the
// N partial sums in fp32 (N - 1 more roundings of at most u of the running sum). Through the
// hidden layer each term meets at most 3 roundings per path (dlogits, the hidden gradient, the
// final GEMM). So |accumulated - batch| <= (2 * 3 + N + 2) * u * S with S = sum_s |t_s|, computed
// here from each sample's own gradient. A wrong weighting (n_j / B left out, or 1 / N for uneven
// micro-batches) errs by a fraction of |g| itself, orders of magnitude above this bound.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/compare.h"
#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/sequential.h"
#include "layers/train.h"

namespace cudp {
namespace {

using testing::random_vector;

constexpr int64_t kBatch = 24, kIn = 10, kClasses = 5;

std::shared_ptr<Module> mlp() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Linear>(kIn, 16, true, 11), std::make_shared<ReLU>(),
      std::make_shared<Linear>(16, kClasses, true, 12)});
}

Tensor images() {
  return Tensor::from_vector(random_vector(kBatch * kIn, 5, -2.f, 2.f), {kBatch, kIn});
}
Tensor labels() {
  std::vector<int32_t> l(kBatch);
  for (int64_t i = 0; i < kBatch; ++i)
    l[static_cast<size_t>(i)] = static_cast<int32_t>((i * 3) % kClasses);
  return Tensor::from_vector(l, {kBatch});
}

std::vector<float> gradients(Module& m) {
  std::vector<float> out;
  for (Parameter* p : m.parameters()) {
    const auto g = p->grad.to_vector<float>();
    out.insert(out.end(), g.begin(), g.end());
  }
  return out;
}

// S: per element, the sum over samples of |that sample's term| (its gradient with weight 1/B).
std::vector<double> term_magnitudes() {
  auto m = mlp();
  std::vector<double> s;
  const Tensor x = images(), y = labels();
  for (int64_t i = 0; i < kBatch; ++i) {
    m->zero_grad();
    CrossEntropyLoss criterion;
    criterion.forward(m->forward(x.slice(i, i + 1)), y.slice(i, i + 1), 1.0 / kBatch);
    m->backward(criterion.backward());
    const auto g = gradients(*m);
    s.resize(g.size(), 0.0);
    for (size_t k = 0; k < g.size(); ++k) s[k] += std::fabs(g[k]);
  }
  return s;
}

void expect_accumulation_matches_one_batch(int64_t micro_batches) {
  auto whole = mlp(), accumulated = mlp();
  CrossEntropyLoss whole_loss, accumulated_loss;
  const Tensor x = images(), y = labels();
  const float loss = whole_loss.forward(whole->forward(x), y).to_vector<float>()[0];
  whole->backward(whole_loss.backward());
  const MicroBatchStep step =
      forward_backward_micro_batches(*accumulated, accumulated_loss, x, y, micro_batches);
  const auto a = gradients(*accumulated), b = gradients(*whole);
  const auto s = term_magnitudes();
  const double u = std::ldexp(1.0, -24);
  const double factor = 2 * 3 + static_cast<double>(micro_batches) + 2;
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_LE(std::fabs(static_cast<double>(a[k]) - b[k]), factor * u * s[k])
        << "element " << k << " with " << micro_batches << " micro-batches: " << a[k] << " vs "
        << b[k] << " (sum of |terms| " << s[k] << ")";
  }
  // The loss: the weighted micro losses add to the batch mean (same bound, on the losses).
  EXPECT_NEAR(step.loss.to_vector<float>()[0], loss, 1e-5 * std::fabs(loss));
  EXPECT_EQ(step.logits.shape(), (Shape{kBatch, kClasses}));
  EXPECT_EQ(step.logits.to_vector<float>(), whole->forward(x).to_vector<float>());
}

TEST(GradientAccumulation, EvenMicroBatchesMatchOneBatchWithinTheDerivedBound) {
  expect_accumulation_matches_one_batch(3);  // 8, 8, 8
  expect_accumulation_matches_one_batch(4);  // 6 x 4
}

TEST(GradientAccumulation, UnevenMicroBatchesAreWeightedByTheirRows) {
  expect_accumulation_matches_one_batch(5);  // 5, 5, 5, 5, 4
  expect_accumulation_matches_one_batch(7);  // 4 x 6: torch.chunk gives 6 micro-batches
}

TEST(GradientAccumulation, TheBackwardCallbackSeesOnlyTheLastMicroBatchAsLast) {
  auto m = mlp();
  CrossEntropyLoss criterion;
  std::vector<bool> lasts;
  forward_backward_micro_batches(*m, criterion, images(), labels(), 5,
                                 [&](const Tensor& g, bool last) {
                                   lasts.push_back(last);
                                   m->backward(g);
                                 });
  EXPECT_EQ(lasts, (std::vector<bool>{false, false, false, false, true}));
  EXPECT_THROW(
      forward_backward_micro_batches(*m, criterion, images().slice(0, 2), labels().slice(0, 2), 3),
      ValueError);
}

// batch_weight (a rank's n_r / B under DistributedDataParallel) scales every micro-batch's weight:
// with 0.5, a power of two, every gradient and the loss are exactly half of batch_weight 1's (each
// rounding of the scaled values is the unscaled rounding, halved).
TEST(GradientAccumulation, TheBatchWeightScalesEveryMicroBatch) {
  auto one = mlp(), half = mlp();
  CrossEntropyLoss a, b;
  const MicroBatchStep s1 = forward_backward_micro_batches(*one, a, images(), labels(), 5);
  const MicroBatchStep s2 =
      forward_backward_micro_batches(*half, b, images(), labels(), 5, {}, {}, 0.5);
  std::vector<float> halved = gradients(*one);
  for (float& g : halved) g *= 0.5f;
  EXPECT_EQ(gradients(*half), halved);
  EXPECT_EQ(s2.loss.to_vector<float>()[0], 0.5f * s1.loss.to_vector<float>()[0]);
  EXPECT_THROW(forward_backward_micro_batches(*half, b, images(), labels(), 5, {}, {}, 0.0),
               ValueError);
}

}  // namespace
}  // namespace cudp
