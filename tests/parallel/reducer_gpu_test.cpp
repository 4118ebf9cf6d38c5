// GPU tests of the bucketed gradient all-reduce (engine/parallel/reducer.h).
//
// The truth for "overlapped" is the same run unoverlapped: the Reducer issues the same NCCL calls
// on the same buffers in the same order with overlap on or off, only earlier, so parameters after K
// training steps must be equal bit for bit. The truth for "bucketed" is one all-reduce of the whole
// flat buffer (a bucket cap above the model's size): with two ranks each element's sum is one
// addition a + b whatever the call's size, so that comparison is bitwise too (it is a fair demand
// with exactly two ranks, so the runs use GPUs 0 and 1 alone on any machine; with more ranks,
// NCCL's order of an element's additions may depend on the call's size). A CUDA graph of a step
// with several buckets is compared with eager steps bit for bit as well.
//
// On one GPU the mechanics still run through a one-rank Communicator: the buckets are issued while
// the backward runs (the reducer counts them), the step can be captured into a CUDA graph and
// replayed, and the gradients (summed over one rank: unchanged) are the model's own, bit for bit.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/gpu.h"
#include "common/tensor_bytes.h"
#include "engine/core/graph.h"
#include "engine/core/stream.h"
#include "engine/parallel/data_parallel.h"
#include "engine/parallel/reducer.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/pooling.h"
#include "layers/precision.h"
#include "layers/sequential.h"
#include "layers/train.h"

namespace cudp {
namespace {

using parallel::DataParallel;
using parallel::ReducerOptions;
using parallel::Replicated;
using testing::bitwise_equal;
using testing::bytes_of;
using testing::random_vector;

const Device kGpu = Device::cuda(0);

// conv-BN-ReLU-pool twice, then two Linear layers: twelve parameters. At 4 KiB a bucket closes at
// the parameter that takes it to 4 KiB or more, from the last parameter back: {the Linears} (the
// first's 18 KiB weight closes it), {BN 2, conv 2} (its 4.5 KiB weight), {BN 1, conv 1}: 3 buckets
// (kBuckets; the GPU run found 3 where a first version of this test guessed at least 4).
constexpr size_t kBuckets = 3;
std::shared_ptr<Module> small_net() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, 8, 3, 1, 1, true, 41), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2),
      std::make_shared<Conv2d>(8, 16, 3, 1, 1, true, 42), std::make_shared<BatchNorm2d>(16),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(16 * 3 * 3, 32, true, 43), std::make_shared<ReLU>(true),
      std::make_shared<Linear>(32, 10, true, 44)});
}

std::pair<Tensor, Tensor> batch(int n, uint64_t seed) {
  std::vector<int32_t> labels(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    labels[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + seed) % 10);
  return {
      Tensor::from_vector(random_vector(static_cast<size_t>(n) * 12 * 12 * 3, seed), {n, 12, 12, 3})
          .to(kGpu),
      Tensor::from_vector(labels, {n}).to(kGpu)};
}

std::vector<int> two_devices() {
  return {0, 1};
}

// K SGD steps of a DataParallel over {0, 1} with the given reducer options; its state after them.
std::map<std::string, std::vector<unsigned char>> train(ReducerOptions options, int steps,
                                                        size_t* buckets = nullptr,
                                                        size_t* early = nullptr) {
  auto net = small_net()->clone(kGpu);
  DataParallel model(net, two_devices());
  model.set_reducer_options(options);
  Replicated<SGD> opt(model, {.lr = 0.05, .momentum = 0.9});
  CrossEntropyLoss criterion;
  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = batch(16, 10 + static_cast<uint64_t>(step));
    const Tensor out = model.forward(x);
    criterion.forward(out, y);
    opt.zero_grad();
    model.backward(criterion.backward());
    opt.step();
  }
  model.check_replicas_identical();
  if (buckets) *buckets = model.reducer()->buckets().size();
  if (early) *early = model.reducer()->issued_before_finish();
  return bytes_of(net->state_dict());
}

TEST(ReducerGpu, OverlappedEqualsUnoverlappedAndUnbucketedBitForBit) {
  CUDP_REQUIRE_GPUS(2);  // train() runs on GPUs 0 and 1 alone, two ranks on any machine
  constexpr int kSteps = 4;
  size_t buckets = 0, early = 0, early_off = 0;
  const auto overlapped =
      train({.bucket_cap_bytes = 4096, .overlap = true}, kSteps, &buckets, &early);
  const auto unoverlapped =
      train({.bucket_cap_bytes = 4096, .overlap = false}, kSteps, nullptr, &early_off);
  const auto unbucketed = train({.bucket_cap_bytes = int64_t{1} << 40, .overlap = true}, kSteps);
  EXPECT_EQ(buckets, kBuckets);
  EXPECT_GT(early, 0u) << "no bucket was issued while the backward ran";
  EXPECT_EQ(early_off, 0u);
  EXPECT_EQ(overlapped, unoverlapped);
  EXPECT_EQ(overlapped, unbucketed);
}

// Captured steps with several buckets against eager steps without overlap: bit for bit.
TEST(ReducerGpu, AGraphedStepWithBucketsMatchesEagerSteps) {
  CUDP_REQUIRE_GPUS(2);
  auto eager_net = small_net()->clone(kGpu);
  auto graph_net = eager_net->clone(kGpu);
  DataParallel eager_dp(eager_net, two_devices()), graph_dp(graph_net, two_devices());
  eager_dp.set_reducer_options({.bucket_cap_bytes = 4096, .overlap = false});
  graph_dp.set_reducer_options({.bucket_cap_bytes = 4096, .overlap = true});
  Replicated<SGD> eager_opt(eager_dp, {.lr = 0.05, .momentum = 0.9});
  Replicated<SGD> graph_opt(graph_dp, {.lr = 0.05, .momentum = 0.9});
  CrossEntropyLoss eager_loss, graph_loss;
  const auto body = [](DataParallel& dp, CrossEntropyLoss& criterion, Replicated<SGD>& opt) {
    return [&](const Tensor& x, const Tensor& y) {
      const Tensor out = dp.forward(x);
      const Tensor loss = criterion.forward(out, y);
      opt.zero_grad();
      dp.backward(criterion.backward());
      opt.step();
      criterion.release();  // the graph keeps no memory past the step (layers/train.h)
      return TensorList{loss};
    };
  };
  GraphedStep graphed(body(graph_dp, graph_loss, graph_opt), kGpu,
                      {.warmup_steps = 2,
                       .enabled = true,
                       .before_replay = [&] { graph_opt.follow_primary(); },
                       .after_launch = {}},
                      two_devices());
  const auto eager_step = body(eager_dp, eager_loss, eager_opt);
  std::vector<float> eager_losses, graph_losses;
  for (int step = 0; step < 6; ++step) {
    const auto [x, y] = batch(16, 20 + static_cast<uint64_t>(step));
    eager_losses.push_back(eager_step(x, y)[0].to_vector<float>()[0]);
    graph_losses.push_back(graphed.run(x, y)[0].to_vector<float>()[0]);
  }
  EXPECT_EQ(graphed.replays(), 4);
  EXPECT_EQ(graph_dp.reducer()->buckets().size(), kBuckets);
  EXPECT_TRUE(bitwise_equal(graph_losses, eager_losses));
  EXPECT_EQ(bytes_of(graph_net->state_dict()), bytes_of(eager_net->state_dict()));
  graph_dp.check_replicas_identical();
}

// One GPU: a one-rank communicator, buckets issued during the backward, eager and captured. A
// one-rank all-reduce changes no value, so this checks that the bucketed path runs, overlaps and is
// legal inside a capture, not that it sums: the two-GPU tests above check the sums.
TEST(ReducerGpu, OneRankOverlapsAndCapturesIntoAGraph) {
  CUDP_REQUIRE_GPU();
  auto reference = small_net()->clone(kGpu);
  auto net = reference->clone(kGpu);
  Tensor flat_grad = net->flatten_parameters().second;
  parallel::Communicator comm({0});
  parallel::CommunicatorGroup group(comm);
  parallel::Reducer reducer({net->parameters()}, {flat_grad}, group,
                            {.bucket_cap_bytes = 4096, .overlap = true});
  reducer.attach(0, *net);
  ASSERT_EQ(reducer.buckets().size(), kBuckets);
  const auto [x, y] = batch(8, 3);
  CrossEntropyLoss criterion, reference_criterion;
  reference->set_input_grad(false);
  net->set_input_grad(false);
  reference_criterion.forward(reference->forward(x), y);
  reference->zero_grad();
  reference->backward(reference_criterion.backward());
  std::vector<float> expected;
  for (Parameter* p : reference->parameters()) {
    const auto g = p->grad.to_vector<float>();
    expected.insert(expected.end(), g.begin(), g.end());
  }
  const auto grads = [&] {
    std::vector<float> out;
    for (Parameter* p : net->parameters()) {
      const auto g = p->grad.to_vector<float>();
      out.insert(out.end(), g.begin(), g.end());
    }
    return out;
  };
  const cuda::Stream stream = cuda::Stream::create(0);
  const cuda::StreamGuard guard(0, stream.get());
  const auto step = [&] {
    criterion.forward(net->forward(x), y);
    net->zero_grad();
    reducer.prepare(1);
    net->backward(criterion.backward());
    reducer.finish();
    criterion.release();  // a captured step keeps no memory past its end (as GraphedStep's)
  };
  step();  // eager (and the warm-up of plans and pool for the capture)
  EXPECT_EQ(reducer.issued_before_finish(), reducer.buckets().size());
  EXPECT_TRUE(bitwise_equal(grads(), expected));
  step();
  cuda::CudaGraph graph;
  graph.capture_begin(0, stream.get(), "a step with a bucketed all-reduce");
  step();
  graph.capture_end();
  // An allocation the graph kept would be live from the start of every replay, where
  // compute-sanitizer takes an earlier node's reuse of its address for an out-of-bounds access.
  EXPECT_EQ(graph.graph_owned_allocations(), 0u);
  flat_grad.fill_(123.f);  // what the replay must overwrite
  graph.launch(stream.get());
  stream.synchronize();
  EXPECT_TRUE(bitwise_equal(grads(), expected));
}

// no_sync accumulation on 2 GPUs: two micro-batches of 8 (the first under no_sync) against one
// batch of 16, without BatchNorm (each micro-batch would use its own statistics). The gradients
// agree up to the order of fp32 sums (a micro-batch's GEMM over 4 rows per GPU, then += and the
// all-reduce, against 8 rows per GPU): a few units in the last place of |g|, below rtol 1e-5 with
// atol 1e-6 for elements near zero (tests/parallel/data_parallel_gpu_test.cpp derives the same
// bound for 1 against 2 GPUs). After the first micro-batch alone the replicas hold different
// gradients: no all-reduce ran.
TEST(ReducerGpu, NoSyncAccumulationMatchesOneBatch) {
  CUDP_REQUIRE_GPUS(2);
  const auto mlp = [] {
    return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
        std::make_shared<Flatten>(), std::make_shared<Linear>(12 * 12 * 3, 64, true, 51),
        std::make_shared<ReLU>(), std::make_shared<Linear>(64, 10, true, 52)});
  };
  auto whole_net = mlp()->clone(kGpu);
  auto acc_net = whole_net->clone(kGpu);
  DataParallel whole(whole_net, two_devices()), acc(acc_net, two_devices());
  acc.set_reducer_options({.bucket_cap_bytes = 4096, .overlap = true});
  const auto [x, y] = batch(16, 77);
  CrossEntropyLoss whole_loss, acc_loss;
  whole_loss.forward(whole.forward(x), y);
  whole.backward(whole_loss.backward());
  bool checked_local = false;
  forward_backward_micro_batches(acc, acc_loss, x, y, 2, [&](const Tensor& g, bool last) {
    if (last) {
      acc.backward(g);
      return;
    }
    {
      const auto no_sync = acc.no_sync();
      acc.backward(g);
    }
    const auto r0 = acc.replica_parameters()[0].back()->grad.to_vector<float>();
    const auto r1 = acc.replica_parameters()[1].back()->grad.to_vector<float>();
    EXPECT_NE(r0, r1) << "the replicas' gradients were summed under no_sync";
    checked_local = true;
  });
  EXPECT_TRUE(checked_local);
  EXPECT_TRUE(acc.gradient_sync());  // the guard restored it
  const auto params = whole.replica_parameters();
  const auto acc_params = acc.replica_parameters();
  for (size_t r = 0; r < 2; ++r) {
    for (size_t k = 0; k < params[0].size(); ++k) {
      EXPECT_ALL_CLOSE(acc_params[r][k]->grad.to_vector<float>(),
                       params[0][k]->grad.to_vector<float>(), 1e-5, 1e-6);
    }
  }
}

// ---- the update beside the backward (Optimizer::set_update_overlap) -----------------------------
//
// The truth is the same training with one update after the whole backward: the updates are per
// element, so bucket by bucket on the optimizers' own streams they must give the same parameters,
// bf16 copies and state bit for bit, eager and captured. A piece that ran before its bucket was
// final, or a forward that read weights before their update, would change them.

struct Trained {
  std::map<std::string, std::vector<unsigned char>> model, state;
  bool overlapped = false;
  size_t buckets = 0;
};

// `steps` steps of a DataParallel over `devices` (buckets of 4 KiB), the learning rate changing at
// every step as a schedule's does, eager or through a GraphedStep.
template <typename Opt>
Trained train_updates(const typename Replicated<Opt>::Options& options,
                      const std::vector<int>& devices, bool overlap, bool graphs,
                      Precision precision = Precision::fp32, int steps = 6) {
  auto net = small_net()->clone(kGpu);
  net->set_precision(precision);
  DataParallel dp(net, devices);
  dp.set_reducer_options({.bucket_cap_bytes = 4096, .overlap = true});
  Replicated<Opt> opt(dp, options);
  if (overlap) opt.set_update_overlap(dp, true);
  CrossEntropyLoss criterion;
  const auto body = [&](const Tensor& x, const Tensor& y) {
    const Tensor out = dp.forward(x);
    const Tensor loss = criterion.forward(out, y);
    opt.zero_grad(ZeroGrad::deferred);
    dp.backward(criterion.backward());
    opt.step();
    criterion.release();  // the graph keeps no memory past the step (layers/train.h)
    return TensorList{loss};
  };
  GraphedStep graphed(body, kGpu,
                      {.warmup_steps = 2,
                       .enabled = graphs,
                       .before_replay = [&] { opt.follow_primary(); },
                       .after_launch = {}},
                      devices);
  for (int step = 0; step < steps; ++step) {
    opt.set_lr(options.lr / (1 + step));
    const auto [x, y] = batch(16, 30 + static_cast<uint64_t>(step));
    graphed.run(x, y);
  }
  EXPECT_EQ(graphed.captured(), graphs);
  dp.check_replicas_identical();
  Trained t;
  t.overlapped = opt.last_step_overlapped();
  t.buckets = dp.reducer() != nullptr ? dp.reducer()->buckets().size() : 0;
  t.model = bytes_of(net->state_dict());
  t.state = bytes_of(opt.state_dict());
  // The bf16 copies the pieces wrote are bf16(data), as the next forward reads them.
  for (Parameter* p : net->parameters()) {
    if (!p->compute.defined()) continue;
    EXPECT_EQ(bytes_of(TensorMap{{"c", p->compute.to(Device::cpu())}}),
              bytes_of(TensorMap{{"c", convert(p->data, DType::bf16).to(Device::cpu())}}));
  }
  return t;
}

template <typename Opt>
void expect_pieces_equal_one_update(const typename Replicated<Opt>::Options& options,
                                    const std::vector<int>& devices,
                                    Precision precision = Precision::fp32) {
  const Trained one = train_updates<Opt>(options, devices, false, false, precision);
  EXPECT_FALSE(one.overlapped);
  for (const bool graphs : {false, true}) {
    SCOPED_TRACE(graphs ? "captured" : "eager");
    const Trained pieces = train_updates<Opt>(options, devices, true, graphs, precision);
    EXPECT_TRUE(pieces.overlapped);
    EXPECT_EQ(pieces.buckets, kBuckets);
    EXPECT_EQ(pieces.model, one.model);
    EXPECT_EQ(pieces.state, one.state);
  }
}

TEST(UpdateOverlapGpu, OneGpuSgdBucketByBucketEqualsOneUpdateBitForBit) {
  CUDP_REQUIRE_GPU();
  // On one device a DataParallel has no reducer until the overlap asks for one.
  EXPECT_EQ(train_updates<SGD>({.lr = 0.05}, {0}, false, false, Precision::fp32, 1).buckets, 0u);
  expect_pieces_equal_one_update<SGD>(
      {.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true}, {0});
}

TEST(UpdateOverlapGpu, OneGpuAdamWBucketByBucketEqualsOneUpdateBitForBit) {
  CUDP_REQUIRE_GPU();
  expect_pieces_equal_one_update<AdamW>({.lr = 1e-3, .weight_decay = 0.01}, {0});
}

// bf16: the pieces write the bf16 compute copies too (the parameter store).
TEST(UpdateOverlapGpu, OneGpuBf16BucketByBucketEqualsOneUpdateBitForBit) {
  CUDP_REQUIRE_TENSOR_CORES();
  expect_pieces_equal_one_update<SGD>({.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4}, {0},
                                      Precision::bf16);
}

// Two GPUs: each piece waits for its bucket's all-reduce on that device.
TEST(UpdateOverlapGpu, TwoGpusBucketByBucketEqualsOneUpdateBitForBit) {
  CUDP_REQUIRE_GPUS(2);
  expect_pieces_equal_one_update<SGD>({.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4},
                                      two_devices());
}

// Clipping scales gradients after the backward, where a piece may already have read them: refused
// while the overlap is on, allowed once it is off. The buckets of a backward serve one step.
TEST(UpdateOverlapGpu, ClippingIsRefusedWhileTheUpdateOverlaps) {
  CUDP_REQUIRE_GPU();
  auto net = small_net()->clone(kGpu);
  DataParallel dp(net, {0});
  Replicated<SGD> opt(dp, {.lr = 0.05});
  opt.set_update_overlap(dp, true);
  CrossEntropyLoss criterion;
  const auto [x, y] = batch(8, 5);
  criterion.forward(dp.forward(x), y);
  opt.zero_grad();
  dp.backward(criterion.backward());
  try {
    opt.clip_grad_norm(1.0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.message()).find("turn that overlap off"), std::string::npos)
        << e.message();
  }
  opt.set_update_overlap(dp, false);
  opt.clip_grad_norm(1.0);
  opt.step();
  EXPECT_FALSE(opt.last_step_overlapped());
  // On again (the state exists now): a step after a backward overlaps; a second step() after the
  // same backward does not (each backward's buckets go to one step), nor one after a forward alone.
  opt.set_update_overlap(dp, true);
  criterion.forward(dp.forward(x), y);
  opt.zero_grad();
  dp.backward(criterion.backward());
  opt.step();
  EXPECT_TRUE(opt.last_step_overlapped());
  opt.step();
  EXPECT_FALSE(opt.last_step_overlapped());
  criterion.forward(dp.forward(x), y);
  opt.step();
  EXPECT_FALSE(opt.last_step_overlapped());
}

// A step that cannot overlap uses its backward's buckets up: a second step() after it (the first
// step, which makes the state; a step taken while the overlap was off) finds none, and takes one
// update, ordered after the first on the compute stream.
TEST(UpdateOverlapGpu, AStepThatCannotOverlapUsesTheBucketsUp) {
  CUDP_REQUIRE_GPU();
  auto net = small_net()->clone(kGpu);
  DataParallel dp(net, {0});
  Replicated<SGD> opt(dp, {.lr = 0.05, .momentum = 0.9});
  opt.set_update_overlap(dp, true);
  CrossEntropyLoss criterion;
  const auto [x, y] = batch(8, 6);
  const auto backward = [&] {
    criterion.forward(dp.forward(x), y);
    opt.zero_grad();
    dp.backward(criterion.backward());
  };
  backward();
  opt.step();  // makes the momentum buffers: one update
  EXPECT_FALSE(opt.last_step_overlapped());
  opt.step();
  EXPECT_FALSE(opt.last_step_overlapped());
  opt.set_update_overlap(dp, false);
  backward();
  opt.step();
  opt.set_update_overlap(dp, true);  // the buckets of the backward before are used up
  opt.step();
  EXPECT_FALSE(opt.last_step_overlapped());
  backward();
  opt.step();
  EXPECT_TRUE(opt.last_step_overlapped());
}

// ReducerOptions::sum = false on two GPUs (bench_train's step without communication): the pieces
// wait on the buckets' ready events (CommunicatorGroup::ready_event; no all-reduce records the done
// ones), and give one update's bits on each replica, whose gradients are its own.
TEST(UpdateOverlapGpu, WithoutSumsThePiecesWaitForTheReadyEvents) {
  CUDP_REQUIRE_GPUS(2);
  const auto train = [](bool overlap) {
    auto net = small_net()->clone(kGpu);
    DataParallel dp(net, two_devices());
    dp.set_reducer_options({.bucket_cap_bytes = 4096, .overlap = true, .sum = false});
    Replicated<SGD> opt(dp, {.lr = 0.05, .momentum = 0.9});
    if (overlap) opt.set_update_overlap(dp, true);
    CrossEntropyLoss criterion;
    for (int step = 0; step < 5; ++step) {
      const auto [x, y] = batch(16, 40 + static_cast<uint64_t>(step));
      criterion.forward(dp.forward(x), y);
      opt.zero_grad(ZeroGrad::deferred);
      dp.backward(criterion.backward());
      opt.step();
      EXPECT_EQ(opt.last_step_overlapped(), overlap && step > 0) << "step " << step;
    }
    std::vector<std::map<std::string, std::vector<unsigned char>>> replicas;
    for (size_t r = 0; r < dp.num_replicas(); ++r) {
      replicas.push_back(bytes_of(dp.replica(r)->state_dict()));
    }
    return replicas;
  };
  const auto whole = train(false);
  const auto pieces = train(true);
  ASSERT_EQ(whole.size(), 2u);
  EXPECT_NE(whole[0], whole[1]) << "nothing summed: the replicas' own gradients differ";
  EXPECT_EQ(pieces, whole);
}

}  // namespace
}  // namespace cudp
