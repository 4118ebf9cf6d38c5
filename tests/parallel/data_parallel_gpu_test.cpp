// GPU tests of DataParallel: K training steps on 2 GPUs against one GPU, device orders, uneven and
// tiny batches, the gathered loss against losses per replica, the seed's split wrapping against the
// whole model, bit-identical replicas, BatchNorm buffers, gradient accumulation, input gradients,
// data_parallel(), exceptions in a replica, and every error text.
//
// Models are VGG-11 with the compact head on 1x32x32 images (dropout 0: masks are per replica,
// replicate.h), trained with SGD (momentum 0.9, weight decay 5e-4) through parallel::Replicated.
//
// The references, and why fp32 tolerances are right:
//   - Without BatchNorm a sample's forward does not depend on the other samples, so DataParallel
//     on 2 GPUs computes the same function as one GPU on the whole batch. What differs is the order
//     of floating-point sums: a weight gradient is a sum over the batch, computed as one GEMM over
//     B rows on one GPU, and as two GEMMs over B/2 rows plus one NCCL addition on two. Each order
//     rounds differently, by a few units in the last place of the gradient (|d| <~ 1e-6 |g|); SGD
//     moves weights by lr * g, so after K = 5 steps the weights differ by about K * lr * 1e-6 |g|,
//     far below rtol = 1e-5 of weights of magnitude 1e-2..1 (atol 1e-6 covers weights near zero).
//   - With BatchNorm in training mode each replica normalises with its own chunk's statistics
//     (PyTorch's DataParallel does the same; SyncBatchNorm would not), so the 2-GPU run is not
//     the 1-GPU run on the whole batch. Its reference is one GPU running the same module on the
//     same chunks one after the other, each chunk's loss weighted by n_i / B, gradients accumulated
//     (+=), then one optimizer step: DataParallel's semantics on one device. The same sums are
//     formed with the same rounding except the order of the final addition of the chunks'
//     gradients, so the same tolerance holds.
//   - DataParallel on one GPU runs the very same kernels as the module alone: bitwise equality.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <thread>

#include "common/compare.h"
#include "common/gpu.h"
#include "common/memory_hog.h"
#include "engine/core/stream.h"
#include "engine/parallel/data_parallel.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/vgg.h"

namespace cudp {
namespace {

using parallel::Replicated;

constexpr int kSteps = 5;
constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;
const SGDOptions kSgd{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4};

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "(no exception)";
}

std::shared_ptr<Vgg> small_vgg(bool batch_norm, int device, uint64_t seed = 5) {
  auto net = vgg11({.in_channels = 1,
                    .num_classes = 10,
                    .batch_norm = batch_norm,
                    .head = VggHead::Compact,
                    .dropout = 0.f,
                    .seed = seed});
  net->cuda(device);
  return net;
}

struct Batch {
  Tensor images;  // [B, 32, 32, 1] f32, pinned host memory
  Tensor labels;  // [B] i32, pinned host memory
};

Batch make_batch(int64_t batch, uint64_t seed) {
  Batch b;
  b.images = Tensor::empty({batch, 32, 32, 1}, DType::f32, Device::cpu(), /*pinned=*/true);
  b.images.uniform_(-1.f, 1.f, seed);
  std::vector<int32_t> labels(static_cast<size_t>(batch));
  for (size_t i = 0; i < labels.size(); ++i)
    labels[i] = static_cast<int32_t>((seed * 7 + i * 3) % 10);
  b.labels = Tensor::from_vector(labels, {batch}).pin_memory();
  return b;
}

std::vector<float> values_of(const std::vector<Parameter*>& params, bool grads = false) {
  std::vector<float> out;
  for (Parameter* p : params) {
    const auto v = (grads ? p->grad : p->data).to_vector<float>();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// One DataParallel step with the loss on the gathered output (the seed's way). Returns the loss.
template <typename Model, typename Opt>
float gathered_step(Model& model, Opt& opt, const Batch& batch, int output_device) {
  CrossEntropyLoss criterion;
  const Tensor out = model.forward(batch.images);
  EXPECT_EQ(out.device(), Device::cuda(output_device));
  criterion.forward(out, batch.labels.cuda(output_device));
  opt.zero_grad();
  model.backward(criterion.backward());
  opt.step();
  return criterion.item();
}

// DataParallel's semantics on one device: the module runs each chunk in turn, each chunk's loss
// weighted by n_i / B, gradients accumulated, one step.
float chunked_reference_step(Module& net, SGD& opt, const Batch& batch, int chunks, int device) {
  const int64_t total = batch.images.size(0);
  opt.zero_grad();
  float loss = 0.f;
  int64_t begin = 0;
  for (const int64_t n : parallel::chunk_sizes(total, chunks)) {
    CrossEntropyLoss criterion;
    const Tensor out = net.forward(batch.images.slice(begin, begin + n).cuda(device));
    criterion.forward(out, batch.labels.slice(begin, begin + n).cuda(device),
                      CrossEntropyLoss::chunk_weight(n, total));
    net.backward(criterion.backward());
    loss += criterion.item();
    begin += n;
  }
  opt.step();
  return loss;
}

// ---- 1 GPU --------------------------------------------------------------------------------------

TEST(DataParallelGpu, OneDeviceIsBitwiseTheModuleAlone) {
  CUDP_REQUIRE_GPU();
  auto reference = small_vgg(/*batch_norm=*/true, 0);
  SGD ref_opt(reference->parameters(), kSgd);
  auto net = small_vgg(true, 0);
  DataParallel model(net, {0});
  Replicated<SGD> opt(model, kSgd);
  EXPECT_EQ(opt.size(), 1u);
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = make_batch(8, 100 + step);
    const float ref_loss = chunked_reference_step(*reference, ref_opt, batch, 1, 0);
    const float loss = gathered_step(model, opt, batch, 0);
    EXPECT_EQ(loss, ref_loss) << "step " << step;
  }
  EXPECT_EQ(values_of(net->parameters()), values_of(reference->parameters()));
}

// ---- 2 GPUs against 1 ---------------------------------------------------------------------------

// Without BatchNorm: 2 GPUs against one GPU on the whole batch; orders (0,1) and (1,0); even and
// uneven batches.
TEST(DataParallelGpu, TwoGpusMatchOneGpuWithoutBatchNorm) {
  CUDP_REQUIRE_GPUS(2);
  for (const std::vector<int>& ids : {std::vector<int>{0, 1}, std::vector<int>{1, 0}}) {
    for (const int64_t batch_size : {16, 7}) {
      SCOPED_TRACE(detail::str("device_ids (", ids[0], ", ", ids[1], "), batch ", batch_size));
      auto reference = small_vgg(false, 0);
      SGD ref_opt(reference->parameters(), kSgd);
      auto net = small_vgg(false, ids[0]);
      DataParallel model(net, ids);
      EXPECT_EQ(model.output_device(), ids[0]);
      Replicated<SGD> opt(model, kSgd);
      EXPECT_EQ(opt.size(), 2u);
      for (int step = 0; step < kSteps; ++step) {
        const Batch batch = make_batch(batch_size, 200 + step);
        const float ref_loss = chunked_reference_step(*reference, ref_opt, batch, 1, 0);
        const float loss = gathered_step(model, opt, batch, ids[0]);
        EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "step " << step;
      }
      EXPECT_EQ(model.chunk_sizes(), parallel::chunk_sizes(batch_size, 2));
      EXPECT_ALL_CLOSE(values_of(net->parameters()), values_of(reference->parameters()), kRtol,
                       kAtol);
      EXPECT_NO_THROW(model.check_replicas_identical());
    }
  }
}

// With BatchNorm: 2 GPUs against one GPU running the same chunks in turn.
TEST(DataParallelGpu, TwoGpusMatchTheChunkedReferenceWithBatchNorm) {
  CUDP_REQUIRE_GPUS(2);
  for (const std::vector<int>& ids : {std::vector<int>{0, 1}, std::vector<int>{1, 0}}) {
    for (const int64_t batch_size : {16, 7}) {
      SCOPED_TRACE(detail::str("device_ids (", ids[0], ", ", ids[1], "), batch ", batch_size));
      auto reference = small_vgg(true, 0);
      SGD ref_opt(reference->parameters(), kSgd);
      auto net = small_vgg(true, ids[0]);
      DataParallel model(net, ids);
      Replicated<SGD> opt(model, kSgd);
      for (int step = 0; step < kSteps; ++step) {
        const Batch batch = make_batch(batch_size, 300 + step);
        const float ref_loss = chunked_reference_step(*reference, ref_opt, batch, 2, 0);
        const float loss = gathered_step(model, opt, batch, ids[0]);
        EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "step " << step;
      }
      EXPECT_ALL_CLOSE(values_of(net->parameters()), values_of(reference->parameters()), kRtol,
                       kAtol);
      // Replicas bit-identical after K steps, parameters and buffers alike.
      EXPECT_NO_THROW(model.check_replicas_identical());
      const auto sums = model.replica_checksums();
      ASSERT_EQ(sums.size(), 2u);
      EXPECT_EQ(sums[0], sums[1]);
    }
  }
}

TEST(DataParallelGpu, BatchOfOneOnTwoGpusRunsOnOneAndKeepsReplicasIdentical) {
  CUDP_REQUIRE_GPUS(2);
  auto reference = small_vgg(false, 0);
  SGD ref_opt(reference->parameters(), kSgd);
  auto net = small_vgg(false, 0);
  DataParallel model(net, {0, 1});
  Replicated<SGD> opt(model, kSgd);
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = make_batch(1, 400 + step);
    const float ref_loss = chunked_reference_step(*reference, ref_opt, batch, 1, 0);
    const float loss = gathered_step(model, opt, batch, 0);
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss));
    EXPECT_EQ(model.chunk_sizes(), (std::vector<int64_t>{1}));
  }
  EXPECT_ALL_CLOSE(values_of(net->parameters()), values_of(reference->parameters()), kRtol, kAtol);
  EXPECT_NO_THROW(model.check_replicas_identical());
}

// ---- the loss per replica -----------------------------------------------------------------------

TEST(DataParallelGpu, GatheredLossEqualsWeightedLossesPerReplica) {
  CUDP_REQUIRE_GPUS(2);
  const Batch batch = make_batch(7, 500);
  auto net_a = small_vgg(true, 0);
  auto net_b = small_vgg(true, 0);
  DataParallel gathered(net_a, {0, 1});
  DataParallel per_replica(net_b, {0, 1});

  CrossEntropyLoss criterion;
  criterion.forward(gathered.forward(batch.images), batch.labels.cuda(0));
  gathered.backward(criterion.backward());
  const float gathered_loss = criterion.item();

  const std::vector<TensorList> outputs = per_replica.forward_replicas({batch.images});
  ASSERT_EQ(outputs.size(), 2u);
  const std::vector<int64_t> sizes = per_replica.chunk_sizes();
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 3}));
  const std::vector<double> weights = per_replica.chunk_weights();
  EXPECT_DOUBLE_EQ(weights[0], 4.0 / 7.0);
  EXPECT_DOUBLE_EQ(weights[1], 3.0 / 7.0);
  std::vector<TensorList> grads;
  double loss = 0;
  int64_t begin = 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const int device = per_replica.device_ids()[i];
    EXPECT_EQ(outputs[i][0].device(), Device::cuda(device));
    CrossEntropyLoss replica_criterion;
    replica_criterion.forward(outputs[i][0],
                              batch.labels.slice(begin, begin + sizes[i]).cuda(device), weights[i]);
    grads.push_back({replica_criterion.backward()});
    loss += replica_criterion.item();
    begin += sizes[i];
  }
  per_replica.backward_replicas(grads);
  EXPECT_NEAR(loss, gathered_loss, 1e-6 * std::abs(gathered_loss));
  EXPECT_ALL_CLOSE(values_of(net_b->parameters(), true), values_of(net_a->parameters(), true),
                   kRtol, 1e-7);
}

// ---- the seed's split wrapping ------------------------------------------------------------------

// The seed program's model: features and classifier wrapped separately, flattened in between on the
// output device.
class SplitVgg : public Module {
 public:
  SplitVgg(const std::shared_ptr<Vgg>& vgg, const std::vector<int>& ids) {
    features_ = register_module("features", std::make_shared<DataParallel>(vgg->features(), ids));
    flatten_ = register_module("flatten", vgg->flatten());
    classifier_ =
        register_module("classifier", std::make_shared<DataParallel>(vgg->classifier(), ids));
    device_ = Device::cuda(ids[0]);  // where its input and output gradient live
  }
  std::string type_name() const override { return "SplitVgg"; }
  DataParallel& features() { return *features_; }
  DataParallel& classifier() { return *classifier_; }

 protected:
  Tensor forward_one(const Tensor& x) override {
    return classifier_->forward(flatten_->forward(features_->forward(x)));
  }
  Tensor backward_one(const Tensor& grad) override {
    return features_->backward(flatten_->backward(classifier_->backward(grad)));
  }
  std::shared_ptr<Module> make_empty_copy() const override {
    CUDP_THROW(ValueError, "SplitVgg is not cloned in these tests");
  }

 private:
  std::shared_ptr<DataParallel> features_;
  std::shared_ptr<Flatten> flatten_;
  std::shared_ptr<DataParallel> classifier_;
};

TEST(DataParallelGpu, SplitWrappingMatchesWholeModelWrapping) {
  CUDP_REQUIRE_GPUS(2);
  auto whole_net = small_vgg(true, 0);
  auto split_net = small_vgg(true, 0);
  DataParallel whole(whole_net, {0, 1});
  auto split = std::make_shared<SplitVgg>(split_net, std::vector<int>{0, 1});
  Replicated<SGD> whole_opt(whole, kSgd);
  Replicated<SGD> split_opt(*split, kSgd);
  ASSERT_EQ(split_opt.size(), 2u);
  EXPECT_EQ(split_opt.replica(1).params().size(), split->parameters().size());
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = make_batch(16, 600 + step);
    const float whole_loss = gathered_step(whole, whole_opt, batch, 0);
    // The outer module takes its input on cuda:0 (Module::forward checks the device): the features'
    // scatter then sends a view to replica 0 and a peer copy to replica 1.
    CrossEntropyLoss criterion;
    const Tensor out = split->forward(batch.images.cuda(0));
    criterion.forward(out, batch.labels.cuda(0));
    split_opt.zero_grad();
    const Tensor dx = split->backward(criterion.backward());
    EXPECT_EQ(dx.device(), Device::cuda(0));  // gathered back to the input's device
    split_opt.step();
    EXPECT_NEAR(criterion.item(), whole_loss, 1e-5 * std::abs(whole_loss)) << "step " << step;
  }
  EXPECT_ALL_CLOSE(values_of(split_net->parameters()), values_of(whole_net->parameters()), kRtol,
                   kAtol);
  EXPECT_NO_THROW(split->features().check_replicas_identical());
  EXPECT_NO_THROW(split->classifier().check_replicas_identical());
  // The two members share their communicator (one per device list in the process).
  EXPECT_EQ(split->features().communicator(), split->classifier().communicator());
  // PyTorch's names through the wrappers.
  EXPECT_EQ(split->named_parameters()[0].first, "features.module.0.weight");
}

// ---- replicas -----------------------------------------------------------------------------------

TEST(DataParallelGpu, ReplicasStartIdenticalAndDriftWithoutAReplicatedOptimizer) {
  CUDP_REQUIRE_GPUS(2);
  auto net = small_vgg(true, 0);
  DataParallel model(net, {0, 1});
  EXPECT_EQ(model.num_replicas(), 2u);
  EXPECT_EQ(model.replica(0), net);
  EXPECT_EQ(model.replica(1)->device(), Device::cuda(1));
  EXPECT_NO_THROW(model.check_replicas_identical());
  // A plain optimizer steps replica 0 only: the check names the first difference.
  SGD plain(model.parameters(), kSgd);
  gathered_step(model, plain, make_batch(8, 700), 0);
  const std::string text = error_of([&] { model.check_replicas_identical(); });
  EXPECT_EQ(
      text.rfind("replicas differ: replica 1 (cuda:1) parameter 'features.0.weight' element ", 0),
      0u)
      << text;
  EXPECT_NE(model.replica_checksums()[0], model.replica_checksums()[1]);
  // broadcast_parameters() brings them back in step.
  model.broadcast_parameters();
  EXPECT_NO_THROW(model.check_replicas_identical());
}

TEST(DataParallelGpu, BatchNormBuffersAreReplicaZerosAndBroadcast) {
  CUDP_REQUIRE_GPUS(2);
  auto reference = small_vgg(true, 0);
  auto net = small_vgg(true, 0);
  DataParallel model(net, {0, 1});
  const Batch batch = make_batch(8, 800);
  model.forward(batch.images);
  reference->forward(batch.images.slice(0, 4).cuda(0));  // replica 0's chunk only
  const auto buffers = [](Module& m, size_t k) {
    return m.named_buffers()[k].second->to_vector<float>();
  };
  // Replica 0's running statistics are those of its chunk (PyTorch's behaviour)...
  EXPECT_ALL_CLOSE(buffers(*net, 0), buffers(*reference, 0), 1e-6, 1e-7);
  // ...and the other replicas received them.
  EXPECT_EQ(buffers(*model.replica(1), 0), buffers(*net, 0));
  EXPECT_NO_THROW(model.check_replicas_identical());
  // In evaluation mode nothing is broadcast, and replicas follow replica 0's mode.
  model.eval();
  EXPECT_FALSE(net->is_training());
  model.forward(batch.images);
  EXPECT_FALSE(model.replica(1)->is_training());
  model.train();
  model.forward(batch.images);
  EXPECT_TRUE(model.replica(1)->is_training());
}

// Gradients accumulate across backward calls exactly as on one device (NOTE [Replica gradients are
// scratch] in replicate.h).
TEST(DataParallelGpu, GradientAccumulationMatchesOneDevice) {
  CUDP_REQUIRE_GPUS(2);
  auto reference = small_vgg(false, 0);
  auto net = small_vgg(false, 0);
  DataParallel model(net, {0, 1});
  Replicated<SGD> opt(model, kSgd);
  opt.zero_grad();
  reference->zero_grad();
  for (int micro = 0; micro < 3; ++micro) {
    const Batch batch = make_batch(6, 900 + micro);
    CrossEntropyLoss criterion;
    criterion.forward(model.forward(batch.images), batch.labels.cuda(0));
    model.backward(criterion.backward());
    CrossEntropyLoss ref_criterion;
    ref_criterion.forward(reference->forward(batch.images.cuda(0)), batch.labels.cuda(0));
    reference->backward(ref_criterion.backward());
  }
  EXPECT_ALL_CLOSE(values_of(net->parameters(), true), values_of(reference->parameters(), true),
                   kRtol, 1e-7);
  // Every replica holds the same accumulated gradient.
  EXPECT_EQ(values_of(model.replica_parameters()[1], true), values_of(net->parameters(), true));
  opt.step();
  EXPECT_NO_THROW(model.check_replicas_identical());
}

// --on-nan skip-step on 2 GPUs: the flag is written on replica 0's device and reaches replica 1 on
// its own stream (no host read). Skipped calls (with NaN gradients) leave every replica's
// parameters and optimizer state as they were; the replicas stay bit-identical and equal, bit for
// bit, a run on the same devices that was never issued the skipped calls.
template <class Opt>
void expect_replicas_skip_together(const typename Replicated<Opt>::Options& options) {
  auto net = std::make_shared<Linear>(32, 16, true, 9);
  auto ref_net = std::make_shared<Linear>(32, 16, true, 9);
  net->cuda(0);
  ref_net->cuda(0);
  DataParallel model(net, {0, 1}), ref_model(ref_net, {0, 1});
  Replicated<Opt> opt(model, options), ref_opt(ref_model, options);
  const std::vector<bool> skips = {true, false, true, false, false};
  for (int step = 0; step < static_cast<int>(skips.size()); ++step) {
    Tensor x = Tensor::empty({10, 32}, DType::f32, Device::cuda(0));
    x.uniform_(-1.f, 1.f, 40 + step);
    opt.zero_grad();
    const Tensor y = model.forward(x);
    model.backward(Tensor::full(y.shape(), skips[step] ? std::nanf("") : 0.1f * (step + 1),
                                Device::cuda(0)));
    const Tensor norm = clip_grad_norm(opt.primary().params(), 1e30);
    const Tensor skip = nonfinite_flag(Tensor::full({}, 0.5f, Device::cuda(0)), norm);
    if (skips[step]) {
      const std::vector<float> before0 = values_of(model.replica_parameters()[0]);
      const std::vector<float> before1 = values_of(model.replica_parameters()[1]);
      opt.step(skip);
      EXPECT_EQ(values_of(model.replica_parameters()[0]), before0) << "step " << step;
      EXPECT_EQ(values_of(model.replica_parameters()[1]), before1) << "step " << step;
      continue;
    }
    opt.step(skip);
    ref_opt.zero_grad();
    const Tensor ry = ref_model.forward(x);
    ref_model.backward(Tensor::full(ry.shape(), 0.1f * (step + 1), Device::cuda(0)));
    clip_grad_norm(ref_opt.primary().params(), 1e30);
    ref_opt.step();
  }
  EXPECT_NO_THROW(model.check_replicas_identical());
  EXPECT_EQ(values_of(model.replica_parameters()[1]), values_of(ref_model.replica_parameters()[1]));
  EXPECT_EQ(values_of(net->parameters()), values_of(ref_net->parameters()));
  EXPECT_EQ(opt.skipped_steps(), 2);
  EXPECT_EQ(opt.replica(1).skipped_steps(), 2);
  EXPECT_EQ(opt.replica(1).steps(), 3);
  const TensorMap state = opt.replica(1).state_dict(), ref_state = ref_opt.replica(1).state_dict();
  ASSERT_EQ(state.size(), ref_state.size());
  for (const auto& entry : ref_state) {
    const std::string& name = entry.first;
    const Tensor& mine = state.at(name);
    EXPECT_EQ(mine.to_vector<float>(), entry.second.to_vector<float>()) << name;
  }
}

TEST(DataParallelGpu, ReplicatedSkipFlagSkipsEveryReplica) {
  CUDP_REQUIRE_GPUS(2);
  expect_replicas_skip_together<SGD>(kSgd);
  expect_replicas_skip_together<AdamW>({.lr = 1e-3, .weight_decay = 0.01});
}

// Out of memory in a replica's forward names the replica, its device, its share of the batch and
// what the caller was doing (its purpose reaches the worker thread), with the caller's advice.
TEST(DataParallelGpu, OutOfMemoryNamesTheReplicaItsShareAndTheCallersPurpose) {
  CUDP_REQUIRE_GPU();
  auto net = small_vgg(/*batch_norm=*/false, 0);
  DataParallel model(net, {0});
  const Batch batch = make_batch(512, 77);  // 128 MiB for the first convolution's output alone
  // The batch goes to the GPU before the memory is filled, so that what fails is the replica's
  // forward, not the scatter's copy (the allocator's pool grows by more than a 2 MiB request).
  const Tensor images = batch.images.cuda(0);
  std::string what;
  {
    testing::MemoryHog hog(0, size_t{64} << 20);
    ASSERT_LT(hog.free_bytes(), size_t{128} << 20);
    const cuda::AllocationPurpose purpose("the test's training step", "Use a smaller test batch.");
    try {
      model.forward(images);
      ADD_FAILURE() << "the forward fitted in " << hog.free_bytes() << " free bytes";
    } catch (const OutOfMemoryError& e) {
      what = e.what();
    }
  }
  for (const std::string part :
       {"Caught OutOfMemoryError in replica 0 on device 0", "CUDA out of memory on cuda:0",
        "for the test's training step: replica 0's forward on cuda:0 (activations of 512 of the "
        "batch's 512 rows)",
        "Use a smaller test batch."}) {
    EXPECT_NE(what.find(part), std::string::npos) << "lacks \"" << part << "\": " << what;
  }
}

// Out of memory while copying the model to another GPU names the replica and what to change.
TEST(DataParallelGpu, OutOfMemoryWhileReplicatingNamesTheReplica) {
  CUDP_REQUIRE_GPUS(2);
  auto net = small_vgg(/*batch_norm=*/true, 0);
  std::string what;
  {
    testing::MemoryHog hog(1, size_t{4} << 20);
    ASSERT_LT(hog.free_bytes(), size_t{16} << 20);
    try {
      DataParallel model(net, {0, 1});
      ADD_FAILURE() << "the replica fitted in " << hog.free_bytes() << " free bytes";
    } catch (const OutOfMemoryError& e) {
      what = e.what();
    }
  }
  for (const std::string part :
       {"CUDA out of memory on cuda:1",
        "for replica 1 of the model on cuda:1 (a copy of its parameters, gradients and buffers)",
        "Every GPU holds a whole copy of the model"}) {
    EXPECT_NE(what.find(part), std::string::npos) << "lacks \"" << part << "\": " << what;
  }
}

// A scheduler drives the primary optimizer; every replica takes its learning rate and momentum.
TEST(DataParallelGpu, ReplicatedOptimizersFollowThePrimarysHyperparameters) {
  CUDP_REQUIRE_GPUS(2);
  auto net = std::make_shared<Linear>(32, 16, true, 9);
  net->cuda(0);
  DataParallel model(net, {0, 1});
  Replicated<AdamW> opt(model, {.lr = 1e-3});
  ASSERT_EQ(opt.size(), 2u);
  Tensor x = Tensor::empty({10, 32}, DType::f32, Device::cuda(0));
  x.uniform_(-1.f, 1.f, 21);
  for (int step = 0; step < kSteps; ++step) {
    opt.primary().set_lr(1e-3 * (step + 1));  // what an LR scheduler does
    opt.primary().set_momentum(0.9 - 0.01 * step);
    opt.zero_grad();
    const Tensor y = model.forward(x);
    model.backward(Tensor::full(y.shape(), 0.1f, Device::cuda(0)));
    opt.step();
    EXPECT_EQ(opt.replica(1).lr(), opt.primary().lr());
    EXPECT_EQ(opt.replica(1).momentum(), opt.primary().momentum());
  }
  EXPECT_NO_THROW(model.check_replicas_identical());
  // The replicas' optimizer state is the primary's, bit for bit.
  const TensorMap primary = opt.state_dict();
  const TensorMap mirror = opt.replica(1).state_dict();
  ASSERT_EQ(primary.size(), mirror.size());
  for (const auto& [name, t] : primary) {
    if (t.dtype() == DType::f32) {
      EXPECT_EQ(t.to_vector<float>(), mirror.at(name).to_vector<float>()) << name;
    }
  }
}

// ---- input gradients ----------------------------------------------------------------------------

TEST(DataParallelGpu, InputGradientGoesBackToAGpuInputAndIsSkippedForAHostBatch) {
  CUDP_REQUIRE_GPUS(2);
  auto reference = std::make_shared<Linear>(16, 8, true, 3);
  reference->cuda(0);
  auto net = std::make_shared<Linear>(16, 8, true, 3);
  net->cuda(0);
  DataParallel model(net, {0, 1});
  Tensor x = Tensor::empty({7, 16}, DType::f32, Device::cuda(0));
  x.uniform_(-1.f, 1.f, 17);
  Tensor g = Tensor::empty({7, 8}, DType::f32, Device::cuda(0));
  g.uniform_(-1.f, 1.f, 18);
  const Tensor y = model.forward(x);
  EXPECT_ALL_CLOSE(y.to_vector<float>(), reference->forward(x).to_vector<float>(), 1e-6, 1e-7);
  const Tensor dx = model.backward(g);
  ASSERT_TRUE(dx.defined());
  EXPECT_EQ(dx.device(), Device::cuda(0));
  EXPECT_ALL_CLOSE(dx.to_vector<float>(), reference->backward(g).to_vector<float>(), 1e-6, 1e-7);
  EXPECT_ALL_CLOSE(values_of(net->parameters(), true), values_of(reference->parameters(), true),
                   1e-5, 1e-7);
  // A host batch: the input gradient is not brought back to the host.
  model.forward(x.cpu());
  EXPECT_FALSE(model.backward(g).defined());
}

// ---- data_parallel() ----------------------------------------------------------------------------

TEST(DataParallelGpu, OneCallForwardUsesPersistentReplicasAndSeesModuleChanges) {
  CUDP_REQUIRE_GPUS(2);
  auto net = small_vgg(true, 0);
  net->eval();
  const Batch batch = make_batch(6, 1000);
  const Tensor expected = net->forward(batch.images.cuda(0));
  const Tensor out = data_parallel(net, batch.images, {0, 1});
  EXPECT_EQ(out.device(), Device::cuda(0));
  EXPECT_ALL_CLOSE(out.to_vector<float>(), expected.to_vector<float>(), 1e-5, 1e-6);
  // Changed outside any optimizer: the next call broadcasts replica 0 first.
  net->parameters().back()->data.fill_(0.25f);
  const Tensor expected2 = net->forward(batch.images.cuda(0));
  const Tensor out2 = data_parallel(net, batch.images, {0, 1}, /*output_device=*/-1);
  EXPECT_TRUE(out2.is_cpu());
  EXPECT_ALL_CLOSE(out2.to_vector<float>(), expected2.to_vector<float>(), 1e-5, 1e-6);
  parallel::clear_replica_cache();
}

TEST(DataParallelGpu, EachDataParallelOwnsItsReplicasAndMayShareACommunicator) {
  CUDP_REQUIRE_GPUS(2);
  auto net = small_vgg(false, 0);
  auto other_net = small_vgg(false, 0);
  other_net->cuda(0);
  DataParallel model(net, {0, 1});
  DataParallel other(other_net, {0, 1},
                     parallel::DataParallelOptions{.output_device = std::nullopt,
                                                   .communicator = model.shared_communicator(),
                                                   .reducer = {}});
  EXPECT_NE(model.replicas(), other.replicas());
  EXPECT_EQ(model.communicator(), other.communicator());
  // The optimizer finds the replicas through the DataParallel it is given, nothing global.
  const auto lists = parallel::replica_parameter_lists(model);
  ASSERT_EQ(lists.size(), 2u);
  EXPECT_EQ(lists[1], model.replica_parameters()[1]);
  // A communicator over other devices is refused, naming both.
  auto third_net = small_vgg(false, 0);
  third_net->cuda(1);
  EXPECT_THROW(
      DataParallel(
          third_net, {1, 0},
          parallel::DataParallelOptions{
              .output_device = std::nullopt,
              .communicator = std::make_shared<parallel::Communicator>(std::vector<int>{0, 1}),
              .reducer = {}}),
      ValueError);
}

// ---- threads ------------------------------------------------------------------------------------

TEST(DataParallelGpu, ReplicasRunOnPersistentThreadsWithTheirDeviceAndTheCallersStream) {
  CUDP_REQUIRE_GPUS(2);
  auto net = small_vgg(false, 0);
  DataParallel model(net, {0, 1});
  const cuda::Stream s1 = cuda::Stream::create(1);
  cuda::StreamGuard guard(1, s1);
  std::vector<std::thread::id> first(2), second(2);
  std::vector<int> devices(2);
  std::vector<cudaStream_t> streams(2);
  model.for_each_replica([&](Module& replica, size_t r, int device) {
    first[r] = std::this_thread::get_id();
    devices[r] = cuda::current_device();
    streams[r] = cuda::current_stream(device);
    EXPECT_EQ(replica.device(), Device::cuda(device));
  });
  model.for_each_replica([&](Module&, size_t r, int) { second[r] = std::this_thread::get_id(); });
  EXPECT_EQ(first, second);
  EXPECT_NE(first[0], first[1]);
  EXPECT_NE(first[0], std::this_thread::get_id());
  EXPECT_EQ(devices, (std::vector<int>{0, 1}));
  EXPECT_EQ(streams[0], cuda::default_stream(0).get());
  EXPECT_EQ(streams[1], s1.get());
}

// ---- exceptions and error texts -----------------------------------------------------------------

// A module that refuses to run on one device.
class FailOnDevice : public Module {
 public:
  explicit FailOnDevice(int bad) : bad_(bad) {}
  std::string type_name() const override { return "FailOnDevice"; }

 protected:
  Tensor forward_one(const Tensor& x) override {
    CUDP_CHECK(device_.index != bad_, "FailOnDevice: refusing to run on ", device_);
    return x;
  }
  std::shared_ptr<Module> make_empty_copy() const override {
    return std::make_shared<FailOnDevice>(bad_);
  }

 private:
  int bad_;
};

TEST(DataParallelGpu, AnExceptionInReplicaOneNamesIt) {
  CUDP_REQUIRE_GPUS(2);
  auto module = std::make_shared<FailOnDevice>(1);
  module->cuda(0);
  DataParallel model(module, {0, 1});
  const Tensor x = Tensor::zeros({4, 3});
  EXPECT_THROW(model.forward(x), ValueError);
  EXPECT_EQ(error_of([&] { model.forward(x); }),
            "Caught ValueError in replica 1 on device 1: FailOnDevice: refusing to run on cuda:1");
  // Batch 1 runs on replica 0 only: no failure.
  EXPECT_NO_THROW(model.forward(Tensor::zeros({1, 3})));
  // Device order (1, 0): replica 0 is on device 1.
  auto other = std::make_shared<FailOnDevice>(1);
  other->cuda(1);
  DataParallel reversed(other, {1, 0});
  EXPECT_EQ(error_of([&] { reversed.forward(x); }),
            "Caught ValueError in replica 0 on device 1: FailOnDevice: refusing to run on cuda:1");
}

TEST(DataParallelGpu, ErrorTexts) {
  CUDP_REQUIRE_GPUS(2);
  auto on1 = std::make_shared<Linear>(4, 3, true, 1);
  on1->cuda(1);
  EXPECT_EQ(
      error_of([&] {
        DataParallel dp(on1, {0, 1});
      }),
      "module must have its parameters and buffers on device cuda:0 (device_ids[0]) but found "
      "one of them on device: cuda:1");
  auto net = std::make_shared<Linear>(4, 3, true, 1);
  net->cuda(0);
  EXPECT_EQ(error_of([&] { DataParallel dp(net, std::vector<int>{}); }),
            "DataParallel: device_ids is empty; give at least one CUDA device id");
  EXPECT_EQ(error_of([&] {
              DataParallel dp(net, {0, 1, 1});
            }),
            "DataParallel: device_ids has device 1 twice (at index 1 and 2); each device holds one "
            "replica");
  const int count = cuda::device_count();
  std::string text = error_of([&] { DataParallel dp(net, {0, count}); });
  EXPECT_EQ(text.rfind(detail::str("DataParallel: device_ids[1]: invalid device id ", count,
                                   ": valid ids are 0..", count - 1),
                       0),
            0u)
      << text;
  text = error_of([&] { DataParallel dp(net, {0, 1}, count + 1); });
  EXPECT_EQ(
      text.rfind(detail::str("DataParallel: output_device: invalid device id ", count + 1), 0), 0u)
      << text;

  DataParallel model(net, {0, 1});
  const Tensor x8 = Tensor::zeros({8, 4});
  EXPECT_EQ(error_of([&] {
              model.forward_all({x8, Tensor::zeros({7, 4})});
            }),
            "DataParallel: input 1 (Tensor[7, 4] f32 cpu) has 7 rows along dim 0 but input 0 "
            "(Tensor[8, 4] f32 cpu) has 8; every input is split into the same chunks");
  EXPECT_EQ(error_of([&] {
              model.forward(Tensor::zeros({0, 4}));
            }),
            "DataParallel: input 0 (Tensor[0, 4] f32 cpu) is an empty batch: there is nothing to "
            "split across devices");
  EXPECT_EQ(error_of([&] { model.forward(Tensor::full({}, 1.f)); }),
            "DataParallel: input 0 is Tensor[] f32 cpu, a scalar; inputs are split along dim 0 and "
            "need at least one dimension");
  EXPECT_EQ(error_of([&] { model.forward_all({}); }),
            "DataParallel: forward needs at least one input");
  // A replica's own shape check, re-raised with the replica's name.
  text = error_of([&] { model.forward(Tensor::zeros({8, 5})); });
  EXPECT_EQ(text.rfind("Caught ValueError in replica 0 on device 0: ", 0), 0u) << text;
  model.forward(x8);
  EXPECT_EQ(
      error_of([&] {
        model.backward(Tensor::zeros({8, 2}, DType::f32, Device::cuda(0)));
      }),
      "DataParallel: grad_output 0 has shape [8, 2] but output 0 of the forward had shape [8, 3]");
  EXPECT_EQ(error_of([&] { model.backward_replicas({}); }),
            "DataParallel: backward_replicas got gradients for 0 replicas, but 2 ran the forward");
  EXPECT_EQ(
      error_of([&] {
        parallel::data_parallel(model.module(), x8, {0, 0});
      }),
      "data_parallel: device_ids has device 0 twice (at index 0 and 1); each device holds one "
      "replica");
}

}  // namespace
}  // namespace cudp
