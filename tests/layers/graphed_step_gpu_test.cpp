// GPU tests of GraphedStep (layers/train.h NOTE [Graphed training steps]): training steps replayed
// from a CUDA graph against the same steps run eagerly on an identical copy of the model, bit for
// bit: every step's loss and correct count, and after K steps every parameter and buffer (BatchNorm
// running statistics and batch counts included), the optimizer's state and counts, and Dropout's
// offset. The eager run is the truth: it never touches a graph. The learning rate changes at every
// step and a batch of another shape runs eagerly between replays, so a replay that kept the
// capture's rate, Dropout offset or optimizer counts, or memory the eager step freed, would differ.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/gpu.h"
#include "common/tensor_bytes.h"
#include "engine/core/stream.h"
#include "engine/parallel/data_parallel.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dropout.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/train.h"

namespace cudp {
namespace {

using testing::bytes_of;
using testing::random_vector;

const Device kGpu = Device::cuda(0);

// VGG's pattern in small: conv-BN-ReLU-pool twice, then a classifier with Dropout.
std::shared_ptr<Module> small_vgg() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, 8, 3, 1, 1, true, 31), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2),
      std::make_shared<Conv2d>(8, 16, 3, 1, 1, true, 32), std::make_shared<BatchNorm2d>(16),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(16 * 3 * 3, 32, true, 33), std::make_shared<ReLU>(true),
      std::make_shared<Dropout>(0.5f, 34), std::make_shared<Linear>(32, 10, true, 35)});
}

// Images NHWC [n, 12, 12, 3] and labels in [0, 10), on the GPU.
std::pair<Tensor, Tensor> batch(int n, uint64_t seed) {
  std::vector<int32_t> labels(n);
  std::mt19937 gen(static_cast<uint32_t>(seed));
  for (auto& l : labels) l = static_cast<int32_t>(gen() % 10);
  return {
      Tensor::from_vector(random_vector(static_cast<size_t>(n) * 12 * 12 * 3, seed), {n, 12, 12, 3})
          .to(kGpu),
      Tensor::from_vector(labels, {n}).to(kGpu)};
}

// A rate that changes at every step (a schedule's), never repeating two steps running.
double lr_at(int step) {
  return 0.02 * (1.0 + 0.25 * (step % 4));
}

Dropout& dropout_of(Module& model) {
  for (const auto& [name, m] : model.named_modules()) {
    if (auto* d = dynamic_cast<Dropout*>(m)) return *d;
  }
  throw std::runtime_error("the model has no Dropout");
}

// What a run leaves: the per-step results' bytes and the final state's.
struct Outcome {
  std::vector<std::vector<unsigned char>> results;  // each step's results, bytes, in order
  std::map<std::string, std::vector<unsigned char>> model, optimizer;
  uint64_t dropout_offset = 0;
  int64_t steps = 0, skipped = 0;
};

using StepFn = std::function<TensorList(const Tensor& images, const Tensor& labels)>;

// Runs `step` over batches of the given sizes, setting the rate before each, and reads everything
// at the end (no read between steps: the steps stay asynchronous as in training).
Outcome run(Module& model, Optimizer& opt, const std::vector<int>& sizes, const StepFn& step,
            const std::function<Tensor(int, const Tensor&)>& poison = {}) {
  std::vector<TensorList> pending;
  for (size_t i = 0; i < sizes.size(); ++i) {
    opt.set_lr(lr_at(static_cast<int>(i)));
    auto [images, labels] = batch(sizes[i], 1000 + i);
    if (poison) images = poison(static_cast<int>(i), images);
    pending.push_back(step(images, labels));
  }
  Outcome o;
  for (const TensorList& results : pending) {
    std::vector<unsigned char> bytes;
    for (const Tensor& t : results) {
      const Tensor host = t.cpu();
      const auto* p = static_cast<const unsigned char*>(host.data_ptr());
      bytes.insert(bytes.end(), p, p + host.nbytes());
    }
    o.results.push_back(std::move(bytes));
  }
  o.model = bytes_of(model.state_dict());
  o.optimizer = bytes_of(opt.state_dict());
  o.dropout_offset = dropout_of(model).offset();
  o.steps = opt.steps();
  o.skipped = opt.skipped_steps();
  return o;
}

void expect_same(const Outcome& graphed, const Outcome& eager) {
  ASSERT_EQ(graphed.results.size(), eager.results.size());
  for (size_t i = 0; i < eager.results.size(); ++i) {
    EXPECT_EQ(graphed.results[i], eager.results[i]) << "the results of step " << i << " differ";
  }
  for (const auto& [name, bytes] : eager.model) {
    EXPECT_EQ(graphed.model.at(name), bytes) << "model tensor " << name << " differs";
  }
  ASSERT_EQ(graphed.optimizer.size(), eager.optimizer.size());
  for (const auto& [name, bytes] : eager.optimizer) {
    EXPECT_EQ(graphed.optimizer.at(name), bytes) << "optimizer state " << name << " differs";
  }
  EXPECT_EQ(graphed.dropout_offset, eager.dropout_offset);
  EXPECT_EQ(graphed.steps, eager.steps);
  EXPECT_EQ(graphed.skipped, eager.skipped);
}

// Two warm-up steps, the capture, replays, a smaller batch (eager) between replays, more replays.
const std::vector<int> kSizes = {16, 16, 16, 16, 16, 7, 16, 16};

std::unique_ptr<Optimizer> make_optimizer(const std::string& kind, Module& model) {
  if (kind == "adamw") return std::make_unique<AdamW>(model.parameters(), AdamWOptions{.lr = 1e-3});
  return std::make_unique<SGD>(model.parameters(),
                               SGDOptions{.lr = 0.02, .momentum = 0.9, .weight_decay = 5e-4});
}

class GraphedStepGpu : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(GraphedStepGpu, ReplaysMatchEagerStepsBitForBit) {
  CUDP_REQUIRE_GPU();
  const auto& [kind, flat] = GetParam();
  auto eager_model = small_vgg()->clone(kGpu);
  auto graph_model = eager_model->clone(kGpu);
  if (flat) {
    eager_model->flatten_parameters();
    graph_model->flatten_parameters();
  }
  eager_model->train();
  graph_model->train();
  auto eager_opt = make_optimizer(kind, *eager_model);
  auto graph_opt = make_optimizer(kind, *graph_model);
  CrossEntropyLoss eager_loss, graph_loss;

  const Outcome eager =
      run(*eager_model, *eager_opt, kSizes, [&](const Tensor& x, const Tensor& y) {
        const PendingStep p = train_step_async(*eager_model, eager_loss, *eager_opt, x, y);
        return TensorList{p.loss, p.correct};
      });
  GraphedStep graphed(*graph_model, graph_loss, *graph_opt);
  const Outcome replayed =
      run(*graph_model, *graph_opt, kSizes, [&](const Tensor& x, const Tensor& y) {
        const PendingStep p = graphed.step(x, y);
        return TensorList{p.loss, p.correct};
      });

  EXPECT_TRUE(graphed.captured());
  EXPECT_EQ(graphed.replays(), 5);      // steps 2, 3, 4, 6, 7
  EXPECT_EQ(graphed.eager_steps(), 3);  // two warm-ups and the batch of 7
  EXPECT_GT(graphed.graph_nodes(), 20u);
  // Nothing the captured step allocated outlives it: the layers freed what they saved at
  // backward and the body released the criterion (memory.h NOTE [Allocations during stream
  // capture]: memory the graph kept would make memcheck report its reuse as out of bounds).
  EXPECT_EQ(graphed.graph_owned_allocations(), 0u);
  expect_same(replayed, eager);
  // Not a vacuous equality: the steps trained (the losses differ from step to step) and Dropout
  // drew a new mask at each.
  EXPECT_NE(eager.results[2], eager.results[3]);
  EXPECT_GT(eager.dropout_offset, 0u);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, GraphedStepGpu,
                         ::testing::Combine(::testing::Values("sgd", "adamw"), ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) +
                                  (std::get<1>(info.param) ? "_flat" : "_per_parameter");
                         });

// A convolution's and a linear layer's backward-weight on a side stream beside backward-data
// (detail::concurrent_weight_grad, every layer) against both on the layer's stream: the same
// kernels on the same data, so the same bits, eager and replayed from a graph (where the side
// stream is a branch of the captured step), in fp32 (SIMT), TF32 and bf16.
class SideStreamStepGpu : public ::testing::TestWithParam<Precision> {};

TEST_P(SideStreamStepGpu, BackwardWeightBesideBackwardDataChangesNoBit) {
  CUDP_REQUIRE_TENSOR_CORES();
  struct Restore {
    int64_t rows = detail::concurrent_weight_grad_rows();
    ~Restore() { detail::set_concurrent_weight_grad(rows); }
  } restore;
  auto base = small_vgg()->clone(kGpu);
  base->set_precision(GetParam());
  base->train();
  const auto outcome = [&](bool side, bool graphs) {
    detail::set_concurrent_weight_grad(side ? -1 : 0);
    auto model = base->clone(kGpu);
    model->train();
    auto opt = make_optimizer("sgd", *model);
    CrossEntropyLoss loss;
    if (!graphs) {
      return run(*model, *opt, kSizes, [&](const Tensor& x, const Tensor& y) {
        const PendingStep p = train_step_async(*model, loss, *opt, x, y);
        return TensorList{p.loss, p.correct};
      });
    }
    GraphedStep graphed(*model, loss, *opt);
    Outcome o = run(*model, *opt, kSizes, [&](const Tensor& x, const Tensor& y) {
      const PendingStep p = graphed.step(x, y);
      return TensorList{p.loss, p.correct};
    });
    EXPECT_EQ(graphed.replays(), 5);
    return o;
  };
  const uint64_t forks = cuda::SideStream::forks();
  const Outcome one_stream = outcome(false, false);
  EXPECT_EQ(cuda::SideStream::forks(), forks) << "off, yet a side stream was forked";
  expect_same(outcome(true, false), one_stream);
  EXPECT_GT(cuda::SideStream::forks(), forks) << "on, yet no side stream was forked";
  expect_same(outcome(true, true), one_stream);
  EXPECT_NE(one_stream.results[2], one_stream.results[3]);  // the steps trained
}

INSTANTIATE_TEST_SUITE_P(Precisions, SideStreamStepGpu,
                         ::testing::Values(Precision::fp32, Precision::tf32, Precision::bf16),
                         [](const auto& info) { return std::string(precision_name(info.param)); });

// --on-nan skip-step inside the graph: a batch with a NaN image at a replayed step makes the
// device skip that update; the following replays must correct the optimizer's counts as eager
// steps do (kernels/optim.h, StepGate).
TEST(GraphedStepGpuGated, SkippedStepsInReplaysMatchEagerSteps) {
  CUDP_REQUIRE_GPU();
  auto eager_model = small_vgg()->clone(kGpu);
  auto graph_model = eager_model->clone(kGpu);
  eager_model->flatten_parameters();
  graph_model->flatten_parameters();
  SGD eager_opt(eager_model->parameters(), {.lr = 0.02, .momentum = 0.9});
  SGD graph_opt(graph_model->parameters(), {.lr = 0.02, .momentum = 0.9});
  CrossEntropyLoss eager_loss, graph_loss;
  const auto gated_step = [](Module& model, CrossEntropyLoss& criterion, SGD& opt) {
    return [&](const Tensor& x, const Tensor& y) {
      const Tensor out = model.forward(x);
      const Tensor loss = criterion.forward(out, y);
      opt.zero_grad();
      model.backward(criterion.backward());
      const Tensor norm = grad_norm(opt.params());
      opt.step(nonfinite_flag(loss, norm));
      criterion.release();
      return TensorList{loss, norm};
    };
  };
  // Step 4 (a replay) sees a NaN pixel.
  const auto poison = [](int step, const Tensor& images) {
    if (step != 4) return images;
    std::vector<float> v = images.to_vector<float>();
    v[5] = std::numeric_limits<float>::quiet_NaN();
    return Tensor::from_vector(v, images.shape()).to(kGpu);
  };
  const std::vector<int> sizes = {16, 16, 16, 16, 16, 16, 16};
  const Outcome eager =
      run(*eager_model, eager_opt, sizes, gated_step(*eager_model, eager_loss, eager_opt), poison);
  GraphedStep graphed(gated_step(*graph_model, graph_loss, graph_opt), kGpu, {});
  const Outcome replayed = run(
      *graph_model, graph_opt, sizes,
      [&](const Tensor& x, const Tensor& y) { return graphed.run(x, y); }, poison);
  EXPECT_EQ(graphed.replays(), 5);
  EXPECT_EQ(graphed.graph_owned_allocations(), 0u);
  EXPECT_EQ(eager.skipped, 1);
  expect_same(replayed, eager);
}

// The same through DataParallel over every visible GPU (one graph spanning the devices, the
// gradient all-reduce inside it) with the replicas' optimizers following the primary's rate.
TEST(GraphedStepGpuDataParallel, ReplaysMatchEagerStepsBitForBit) {
  CUDP_REQUIRE_GPU();
  std::vector<int> ids(static_cast<size_t>(cuda::device_count()));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int>(i);
  auto eager_net = small_vgg()->clone(kGpu);
  auto graph_net = eager_net->clone(kGpu);
  DataParallel eager_dp(eager_net, ids), graph_dp(graph_net, ids);
  parallel::Replicated<SGD> eager_opt(eager_dp, {.lr = 0.02, .momentum = 0.9});
  parallel::Replicated<SGD> graph_opt(graph_dp, {.lr = 0.02, .momentum = 0.9});
  CrossEntropyLoss eager_loss, graph_loss;
  const auto dp_step = [](DataParallel& dp, CrossEntropyLoss& criterion,
                          parallel::Replicated<SGD>& opt) {
    return [&](const Tensor& x, const Tensor& y) {
      const Tensor out = dp.forward(x);
      const Tensor loss = criterion.forward(out, y);
      opt.zero_grad();
      dp.backward(criterion.backward());
      opt.step();
      criterion.release();
      return TensorList{loss};
    };
  };
  const std::vector<int> sizes = {16, 16, 16, 16, 16, 16};
  const Outcome eager =
      run(*eager_net, eager_opt.primary(), sizes, dp_step(eager_dp, eager_loss, eager_opt));
  GraphedStep graphed(dp_step(graph_dp, graph_loss, graph_opt), kGpu,
                      {.warmup_steps = 2,
                       .enabled = true,
                       .before_replay = [&] { graph_opt.follow_primary(); },
                       .after_launch = {}},
                      ids);
  const Outcome replayed = run(*graph_net, graph_opt.primary(), sizes,
                               [&](const Tensor& x, const Tensor& y) { return graphed.run(x, y); });
  EXPECT_EQ(graphed.replays(), 4);
  EXPECT_EQ(graphed.graph_owned_allocations(), 0u);
  expect_same(replayed, eager);
  graph_dp.check_replicas_identical();
}

// An evaluation through a GraphedStep (the trainer's, examples/vgg/main.cpp): the eval forward
// saves its inputs for a backward that never comes, which a capture would keep as graph-owned
// memory; Module::release_forward_state drops them, so the graph owns none, and the replays give
// the eager evaluation's bits. The second test shows what the release prevents (so the first can
// fail). It is a test of its own because it leaves the graph owning memory on purpose, which
// compute-sanitizer's memcheck misreads (engine/core/memory.h, NOTE [Allocations during stream
// capture]): scripts/sanitize.sh leaves it out. (When the two were one test, memcheck reported
// invalid writes in it; which of the two cases made them is not yet known.)
std::function<TensorList(const Tensor&, const Tensor&)> evaluation_body(Module& model,
                                                                        CrossEntropyLoss& criterion,
                                                                        bool release) {
  return [&model, &criterion, release](const Tensor& x, const Tensor& y) {
    const Tensor out = model.forward(x);
    const Tensor loss = criterion.forward(out, y);
    criterion.release();
    if (release) model.release_forward_state();
    return TensorList{loss, out};
  };
}

TEST(GraphedStepGpuEvaluation, ReleasedForwardStateLeavesTheGraphNoMemory) {
  CUDP_REQUIRE_GPU();
  auto model = small_vgg();
  model->to(kGpu);
  model->eval();
  CrossEntropyLoss criterion;
  const auto body = evaluation_body(*model, criterion, /*release=*/true);
  GraphedStep graphed(
      body, kGpu, {.warmup_steps = 1, .enabled = true, .before_replay = {}, .after_launch = {}});
  std::vector<std::vector<unsigned char>> eager, replayed;
  for (int i = 0; i < 4; ++i) {
    const auto [x, y] = batch(8, 70 + static_cast<uint64_t>(i));
    const TensorList r = graphed.run(x, y);
    const TensorList e = body(x, y);
    replayed.push_back(
        testing::bytes_of(TensorMap{{"loss", r[0].cpu()}, {"out", r[1].cpu()}}).at("out"));
    eager.push_back(
        testing::bytes_of(TensorMap{{"loss", e[0].cpu()}, {"out", e[1].cpu()}}).at("out"));
  }
  EXPECT_EQ(graphed.replays(), 3);
  EXPECT_EQ(replayed, eager);
  EXPECT_EQ(graphed.graph_owned_allocations(), 0u);
}

TEST(GraphedStepGpuEvaluation, WithoutTheReleaseTheGraphKeepsTheSavedInputs) {
  CUDP_REQUIRE_GPU();
  auto model = small_vgg();
  model->to(kGpu);
  model->eval();
  CrossEntropyLoss criterion;
  GraphedStep graphed(
      evaluation_body(*model, criterion, /*release=*/false), kGpu,
      {.warmup_steps = 1, .enabled = true, .before_replay = {}, .after_launch = {}});
  for (int i = 0; i < 2; ++i) {  // one eager batch, then the capture: what it keeps
    const auto [x, y] = batch(8, 70 + static_cast<uint64_t>(i));
    graphed.run(x, y);
  }
  EXPECT_TRUE(graphed.captured());
  EXPECT_GT(graphed.graph_owned_allocations(), 0u) << "the saved inputs were not kept";
}

}  // namespace
}  // namespace cudp
