// DistributedDataParallel (engine/parallel/ddp.h) on one GPU through NCCL: a world of one
// (ProcessGroup::local({0})), where the all-reduce of each bucket sums one rank and so must leave
// every gradient as it was. The truth is the plain module, trained beside it from the same
// initialisation without any DDP: gradients and weights are compared bit for bit after every step
// (several buckets, so the reducer's slicing of the flat buffer is exercised). The multi-rank
// semantics are tested on the host under mpirun (mpi_ddp_test.cpp); this test shows that the NCCL
// group, the reducer's events and streams and the wrapping leave a GPU step unchanged, eager and
// replayed from a CUDA graph.
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <utility>

#include "common/gpu.h"
#include "common/tensor_bytes.h"
#include "engine/parallel/comm.h"
#include "engine/parallel/ddp.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/train.h"

namespace cudp::parallel {
namespace {

using testing::bytes_of;

std::shared_ptr<Sequential> tiny_net() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, 16, 3, 1, 1, true, 11), std::make_shared<BatchNorm2d>(16),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2),
      std::make_shared<Conv2d>(16, 16, 3, 1, 1, true, 12), std::make_shared<BatchNorm2d>(16),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(16 * 2 * 2, 10, true, 13)});
}

// Six random 8x8 RGB images and their labels (of 10 classes) on `gpu`.
std::pair<Tensor, Tensor> random_batch(std::mt19937& gen, Device gpu) {
  std::uniform_real_distribution<float> pixel(-1.f, 1.f);
  std::uniform_int_distribution<int32_t> label(0, 9);
  const int n = 6;
  std::vector<float> images(static_cast<size_t>(n) * 8 * 8 * 3);
  for (float& v : images) v = pixel(gen);
  std::vector<int32_t> labels(n);
  for (int32_t& v : labels) v = label(gen);
  return {Tensor::from_vector(images, {n, 8, 8, 3}).to(gpu),
          Tensor::from_vector(labels, {n}).to(gpu)};
}

TEST(DdpGpu, AWorldOfOneGivesThePlainModulesGradientsBitForBit) {
  CUDP_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  auto plain = tiny_net();
  plain->cuda(0);
  auto wrapped = tiny_net();
  wrapped->cuda(0);
  DistributedDataParallel ddp(wrapped, nccl_group(ProcessGroup::local({0})),
                              {.reducer = {.bucket_cap_bytes = 4096, .overlap = true}});
  ASSERT_GT(ddp.reducer().buckets().size(), 1u);
  SGD sgd_plain(plain->parameters(), {.lr = 0.1, .momentum = 0.9});
  SGD sgd_ddp(ddp.parameters(), {.lr = 0.1, .momentum = 0.9});
  CrossEntropyLoss crit_plain, crit_ddp;
  std::mt19937 gen(5);
  for (int step = 0; step < 3; ++step) {
    const auto [x, y] = random_batch(gen, gpu);

    sgd_plain.zero_grad();
    crit_plain.forward(plain->forward(x), y);
    plain->backward(crit_plain.backward());

    sgd_ddp.zero_grad();
    const Tensor out = ddp.forward(x);
    EXPECT_EQ(ddp.loss_weight(), 1.0);  // one rank holds the whole batch
    crit_ddp.forward(out, y, ddp.loss_weight());
    ddp.backward(crit_ddp.backward());
    EXPECT_EQ(ddp.reducer().issued_before_finish(), ddp.reducer().buckets().size())
        << "every bucket's all-reduce starts during the backward";

    const auto a = plain->named_parameters(), b = wrapped->named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_EQ(a[k].second->grad.to_vector<float>(), b[k].second->grad.to_vector<float>())
          << "step " << step << ": the gradient of " << a[k].first;
    }
    sgd_plain.step();
    sgd_ddp.step();
  }
  EXPECT_EQ(bytes_of(plain->state_dict()), bytes_of(wrapped->state_dict()));
}

// A DistributedDataParallel step replayed from a CUDA graph (GraphedStep, layers/train.h): the
// buckets' all-reduces (NCCL, a world of one) are captured with the rest of the step, and each
// launch is watched by the collective watchdog (Communicator::watch_graph_launch). The truth: the
// same steps run eagerly on a twin from the same initialisation, compared bit for bit after every
// step (the loss, every parameter, buffer and gradient).
TEST(DdpGpu, AReplayedStepGivesTheEagerStepsBitsAndEachLaunchIsWatched) {
  CUDP_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  auto eager_net = tiny_net();
  eager_net->cuda(0);
  auto graph_net = tiny_net();
  graph_net->cuda(0);
  const auto eager_group = ProcessGroup::local({0}), graph_group = ProcessGroup::local({0});
  const DistributedDataParallelOptions options{
      .reducer = {.bucket_cap_bytes = 4096, .overlap = true}};
  DistributedDataParallel eager(eager_net, nccl_group(eager_group), options);
  DistributedDataParallel graphed_ddp(graph_net, nccl_group(graph_group), options);
  ASSERT_GT(graphed_ddp.reducer().buckets().size(), 1u);
  SGD eager_sgd(eager.parameters(), {.lr = 0.1, .momentum = 0.9});
  SGD graph_sgd(graphed_ddp.parameters(), {.lr = 0.1, .momentum = 0.9});
  CrossEntropyLoss eager_crit, graph_crit;
  const auto step = [](DistributedDataParallel& ddp, SGD& sgd, CrossEntropyLoss& crit,
                       const Tensor& x, const Tensor& y) {
    sgd.zero_grad();
    const Tensor loss = crit.forward(ddp.forward(x), y);
    ddp.backward(crit.backward());
    sgd.step();
    crit.release();
    return TensorList{loss};
  };
  Communicator& comm = graph_group->comm();
  const Communicator::Captured before = comm.captured();
  const std::function<void()> watch = comm.launch_watcher("a replayed test step");
  int launches = 0;
  GraphedStep graphed(
      [&](const Tensor& x, const Tensor& y) {
        return step(graphed_ddp, graph_sgd, graph_crit, x, y);
      },
      gpu, {.warmup_steps = 1, .enabled = true, .before_replay = {}, .after_launch = [&] {
              ++launches;
              watch();
            }});
  std::mt19937 gen(9);
  for (int i = 0; i < 5; ++i) {
    const auto [x, y] = random_batch(gen, gpu);
    const TensorList replayed = graphed.run(x, y);
    const TensorList eager_out = step(eager, eager_sgd, eager_crit, x, y);
    comm.synchronize();  // every watched launch so far has completed (else it throws)
    EXPECT_EQ(replayed[0].to_vector<float>(), eager_out[0].to_vector<float>()) << "step " << i;
    EXPECT_EQ(bytes_of(graph_net->state_dict()), bytes_of(eager_net->state_dict())) << "step " << i;
    const auto a = eager_net->named_parameters(), b = graph_net->named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_EQ(a[k].second->grad.to_vector<float>(), b[k].second->grad.to_vector<float>())
          << "step " << i << ": the gradient of " << a[k].first;
    }
  }
  EXPECT_EQ(graphed.eager_steps(), 1);
  EXPECT_EQ(graphed.replays(), 4);
  EXPECT_EQ(launches, 4);
  const Communicator::Captured holds = comm.captured() - before;  // what the graph holds
  int64_t bucket_bytes = 0;
  for (const auto& bucket : graphed_ddp.reducer().buckets()) {
    bucket_bytes += (bucket.end - bucket.begin) * static_cast<int64_t>(sizeof(float));
  }
  EXPECT_EQ(holds.collectives, static_cast<int64_t>(graphed_ddp.reducer().buckets().size()))
      << "one all-reduce a bucket, captured";
  EXPECT_EQ(holds.bytes, bucket_bytes);
}

// A module without parameters has no gradient to synchronise: refused with a message that says
// so (PyTorch refuses it too), not the reducer's.
TEST(DdpGpu, AModuleWithoutParametersIsRefused) {
  CUDP_REQUIRE_GPU();
  auto no_params = std::make_shared<Sequential>(
      std::vector<std::shared_ptr<Module>>{std::make_shared<ReLU>(), std::make_shared<Flatten>()});
  no_params->cuda(0);
  try {
    DistributedDataParallel ddp(no_params, nccl_group(ProcessGroup::local({0})));
    FAIL() << "a module without parameters was wrapped";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("the module has no parameters"), std::string::npos)
        << e.what();
  }
}

TEST(DdpGpu, AWorldOfOneIsRankZeroAndSumsToItself) {
  CUDP_REQUIRE_GPU();
  auto group = nccl_group(ProcessGroup::local({0}));
  EXPECT_EQ(group->world_size(), 1);
  EXPECT_EQ(group->rank(), 0);
  EXPECT_EQ(group->sum(7), 7);
}

}  // namespace
}  // namespace cudp::parallel
