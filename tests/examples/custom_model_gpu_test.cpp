// GPU tests of the custom-model example (examples/custom_model/seed_cnn.h): the two-output module
// on a GPU against its CPU path, and trained with DataParallel as examples/custom_model/main.cpp
// trains it: the loss falls on one GPU, and two GPUs end with the weights of one.
//
// Tolerances, and why they are sound:
//   - GPU against CPU (one forward and backward): the CUDA kernels and the CPU references compute
//     the same sums in other orders, in fp32 against double accumulation; errors compound over
//     the five layers as in sequential_gpu_test: 1e-4 relative, 1e-4 of the tensor's largest value
//     absolute (sums that cancel carry the rounding of their largest terms).
//   - Two GPUs against one (same initial weights, same batches, K steps of SGD with momentum): the
//     model has no BatchNorm, so every sample's forward is independent of the others and both runs
//     compute the same function. What differs is the order of the gradient sums: a weight gradient
//     is one reduction over B samples on one GPU, and two over B/2 plus an NCCL addition on two.
//     Each order rounds differently, by a few units of 2^-24 relative to the largest terms of the
//     sum (reductions over <= ~12,500 products here: 64 images x 14 x 14 positions for conv2).
//     SGD is linear in the gradients for fixed lr and momentum, so after K steps the weights
//     differ by that relative amount times the largest update, plus the same order again through
//     the slightly different weights' effect on later gradients. We allow 1e-3 of each tensor's
//     largest update |w_K - w_0| (plus 1e-6 relative): ~100x the expected rounding, while a real
//     error (a replica not stepping, a gradient averaged instead of summed, a chunk counted twice)
//     is of the order of the update itself.
//   - Gradients of one step, 2 GPUs against 1: the same argument, with 1e-3 of the tensor's largest
//     gradient: a weight gradient sums up to ~12,500 products whose magnitudes may exceed the
//     result's by ~100 where they cancel, so its rounding can reach ~1e-5 of the largest gradient;
//     a fault (a chunk's gradient lost or counted twice, the features' gradient not scattered) is
//     of the order of the gradient.
//   - Forward outputs, 2 GPUs against 1: each sample's outputs are the same sums (the kernels may
//     tile a batch of 32 and one of 64 differently): 1e-5 of the largest output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/gpu.h"
#include "examples/custom_model/seed_cnn.h"
#include "layers/layer_testing.h"

namespace cudp {
namespace {

using parallel::Replicated;
using seed::SeedCnn;
using seed::SeedCnnOptions;
using testing::random_tensor;
using testing::values;

const SGDOptions kSgd{.lr = 0.05, .momentum = 0.9};
constexpr int64_t kBatch = 64;

struct HostBatch {
  Tensor images, labels;  // host tensors, owned (cloned out of the loader's buffers)
};

// `count` batches of the synthetic set (28x28x1, 10 classes), normalised as the example does.
std::vector<HostBatch> synthetic_batches(int count) {
  data::SyntheticOptions so;
  so.n_train = count * kBatch;
  const data::Dataset set = data::make_synthetic(so, true);
  data::LoaderOptions lo;
  lo.batch_size = kBatch;
  lo.shuffle = false;
  lo.workers = 1;
  lo.normalization = data::compute_normalization(set);
  data::Loader loader(set, lo);
  std::vector<HostBatch> batches;
  loader.start_epoch(0);
  for (data::Batch b; loader.next(b) && static_cast<int>(batches.size()) < count;) {
    batches.push_back({b.images.clone(), b.labels.clone()});
  }
  return batches;
}

struct TrainRun {
  std::vector<float> losses;                          // one per step
  std::map<std::string, std::vector<float>> initial;  // parameters before the first step
  std::map<std::string, std::vector<float>> final;    // and after the last
};

std::map<std::string, std::vector<float>> parameters_of(Module& m) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, p] : m.named_parameters()) out[name] = values(p->data);
  return out;
}

// The example's loop: DataParallel over `gpus`, Replicated<SGD>, the features' gradient undefined.
TrainRun train(const std::vector<int>& gpus, const std::vector<HostBatch>& batches,
               int epochs = 1) {
  auto net = std::make_shared<SeedCnn>(SeedCnnOptions{.seed = 5});
  net->cuda(gpus[0]);
  DataParallel model(net, gpus);
  Replicated<SGD> opt(model, kSgd);
  CrossEntropyLoss criterion;
  TrainRun run;
  run.initial = parameters_of(*net);
  for (int e = 0; e < epochs; ++e) {
    for (const HostBatch& b : batches) {
      const TensorList out = model.forward_all({b.images});  // a host batch: scatter copies it
      EXPECT_EQ(out[0].device(), Device::cuda(gpus[0]));
      EXPECT_EQ(out[1].shape(), (Shape{b.images.size(0), 1568}));
      criterion.forward(out[0], b.labels.cuda(gpus[0]));
      run.losses.push_back(criterion.item());
      opt.zero_grad();
      model.backward_all({criterion.backward(), Tensor()});
      opt.step();
    }
  }
  model.check_replicas_identical();  // every replica stepped with the same summed gradient
  run.final = parameters_of(*net);
  return run;
}

TEST(CustomModelGpuTest, GpuMatchesCpuWithBothOutputsUsed) {
  CUDP_REQUIRE_GPU();
  auto cpu = std::make_shared<SeedCnn>(SeedCnnOptions{.seed = 1});
  testing::randomize_parameters(*cpu, 2, -0.1f, 0.1f);
  std::shared_ptr<Module> gpu = cpu->clone(Device::cuda(0));
  const Tensor x = random_tensor({5, 28, 28, 1}, 3);
  const TensorList y_cpu = cpu->forward_all({x});
  const TensorList y_gpu = gpu->forward_all({x.cuda(0)});
  ASSERT_EQ(y_gpu.size(), 2u);
  EXPECT_TRUE(testing::gpu_close(y_gpu[0], y_cpu[0], 1e-4, 1e-4)) << "logits";
  EXPECT_TRUE(testing::gpu_close(y_gpu[1], y_cpu[1], 1e-4, 1e-4)) << "features";
  // Both gradients defined: the features' gradient is added on the device (kernels::axpy).
  const Tensor g0 = random_tensor(y_cpu[0].shape(), 4), g1 = random_tensor(y_cpu[1].shape(), 5);
  const Tensor dx_cpu = cpu->backward_all({g0, g1})[0];
  const Tensor dx_gpu = gpu->backward_all({g0.cuda(0), g1.cuda(0)})[0];
  EXPECT_TRUE(testing::gpu_close(dx_gpu, dx_cpu, 1e-4, 1e-4)) << "input gradient";
  const auto a = gpu->named_parameters(), b = cpu->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(testing::gpu_close(a[i].second->grad, b[i].second->grad, 1e-4, 1e-4)) << b[i].first;
  }
}

// The example's model under the bf16 policy on tensor cores against its CPU path, which rounds the
// same operands the same way. Products agree exactly; what differs is the summation order and, where
// an intermediate value lies within that difference of a bf16 rounding boundary, its rounding (one
// bf16 unit, 2^-8 relative, of an activation entering 25 products of weights below 0.1): 1e-3.
TEST(CustomModelGpuTest, Bf16GpuMatchesTheCpuPath) {
  CUDP_REQUIRE_TENSOR_CORES();
  auto cpu = std::make_shared<SeedCnn>(SeedCnnOptions{.seed = 1});
  testing::randomize_parameters(*cpu, 2, -0.1f, 0.1f);
  cpu->set_precision(Precision::bf16);
  std::shared_ptr<Module> gpu = cpu->clone(Device::cuda(0));
  const Tensor x = random_tensor({5, 28, 28, 1}, 3);
  const TensorList y_cpu = cpu->forward_all({x});
  const TensorList y_gpu = gpu->forward_all({x.cuda(0)});
  EXPECT_TRUE(testing::gpu_close(y_gpu[0], y_cpu[0], 1e-3, 1e-3)) << "logits";
  // The features are bf16 under the bf16 policy (Flatten keeps the activations' dtype), and a
  // gradient has its value's dtype.
  EXPECT_EQ(y_cpu[1].dtype(), DType::bf16);
  const Tensor g0 = random_tensor(y_cpu[0].shape(), 4);
  const Tensor g1 = convert(random_tensor(y_cpu[1].shape(), 5), DType::bf16);
  const Tensor dx_cpu = cpu->backward_all({g0, g1})[0];
  const Tensor dx_gpu = gpu->backward_all({g0.cuda(0), g1.cuda(0)})[0];
  EXPECT_TRUE(testing::gpu_close(dx_gpu, dx_cpu, 1e-3, 1e-3)) << "input gradient";
  const auto a = gpu->named_parameters(), b = cpu->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(testing::gpu_close(a[i].second->grad, b[i].second->grad, 1e-3, 1e-3)) << b[i].first;
  }
}

TEST(CustomModelGpuTest, LossFallsOnOneGpu) {
  CUDP_REQUIRE_GPU();
  const TrainRun run = train({0}, synthetic_batches(8), /*epochs=*/3);
  // The mean loss of the last epoch against the first.
  auto mean = [&](size_t from) {
    double s = 0;
    for (size_t i = from; i < from + 8; ++i) s += run.losses[i];
    return s / 8;
  };
  EXPECT_LT(mean(16), 0.5 * mean(0)) << "first epoch " << mean(0) << ", last " << mean(16);
}

TEST(CustomModelGpuTest, TwoGpusEndWithTheWeightsOfOne) {
  CUDP_REQUIRE_GPUS(2);
  const std::vector<HostBatch> batches = synthetic_batches(5);
  const TrainRun one = train({0}, batches);
  const TrainRun two = train({0, 1}, batches);
  ASSERT_EQ(one.initial, two.initial);  // the same seed: the same start, bit for bit
  for (const auto& [name, w1] : one.final) {
    double largest_update = 0;
    for (size_t i = 0; i < w1.size(); ++i) {
      largest_update = std::max(largest_update, std::fabs(double{w1[i]} - one.initial.at(name)[i]));
    }
    ASSERT_GT(largest_update, 0) << name << " did not move";
    EXPECT_TRUE(testing::all_close(two.final.at(name), w1, 1e-6, 1e-3 * largest_update)) << name;
  }
  for (size_t s = 0; s < one.losses.size(); ++s) {
    EXPECT_NEAR(two.losses[s], one.losses[s], 1e-4 * one.losses[s] + 1e-5) << "step " << s;
  }
}

// Both outputs through DataParallel: the features are gathered like the logits, and their
// gradient is scattered back with the chunk sizes of the forward.
TEST(CustomModelGpuTest, TwoGpusGiveTheGradientsOfOneWithBothOutputsUsed) {
  CUDP_REQUIRE_GPUS(2);
  const HostBatch b = synthetic_batches(1)[0];
  const Tensor g1 = random_tensor({kBatch, 1568}, 6, -1e-3f, 1e-3f);
  std::vector<std::map<std::string, std::vector<float>>> grads;
  std::vector<std::vector<float>> features;
  for (const std::vector<int>& gpus : {std::vector<int>{0}, std::vector<int>{0, 1}}) {
    auto net = std::make_shared<SeedCnn>(SeedCnnOptions{.seed = 5});
    net->cuda(0);
    DataParallel model(net, gpus);
    CrossEntropyLoss criterion;
    const TensorList out = model.forward_all({b.images});
    features.push_back(values(out[1]));
    criterion.forward(out[0], b.labels.cuda(0));
    model.zero_grad();
    model.backward_all({criterion.backward(), g1.cuda(0)});
    std::map<std::string, std::vector<float>> g;
    for (const auto& [name, p] : net->named_parameters()) g[name] = values(p->grad);
    grads.push_back(std::move(g));
  }
  EXPECT_TRUE(
      testing::all_close(features[1], features[0], 1e-5, 1e-5 * testing::max_abs(features[0])));
  for (const auto& [name, g] : grads[0]) {
    EXPECT_TRUE(testing::all_close(grads[1].at(name), g, 1e-5, 1e-3 * testing::max_abs(g))) << name;
  }
}

}  // namespace
}  // namespace cudp
