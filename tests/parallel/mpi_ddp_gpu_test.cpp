// DistributedDataParallel on GPUs, one rank per process: ctest runs it as `mpirun -np 2`
// (tests/CMakeLists.txt; built only with MPI). Each process's local rank picks its GPU
// (ProcessGroup::from_mpi), NCCL moves the data (nccl_group). The same model, shards and truth as
// the host test (ddp_truth.h): K SGD steps of DDP, each rank on its uneven shard, equal one process
// on the whole batch (computed on each rank's own GPU, without DDP) within the host test's bound,
// and every rank's parameters are bit-identical. Skips where there are fewer GPUs than ranks
// (every rank sees the same count, so all skip together). Run directly, it is a world of one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "common/gpu.h"
#include "engine/parallel/ddp.h"
#include "engine/parallel/mpi_bootstrap.h"
#include "parallel/ddp_truth.h"
#include "parallel/mpi_gpu_testing.h"

namespace cudp::parallel {
namespace {

using namespace testing::ddp;  // NOLINT: the shared model, batches and truth

// The host test's tolerance (mpi_ddp_test.cpp derives it): the runs differ only in the order in
// which the ranks' shard gradients are added, a few roundings of each gradient element per step.
constexpr double kAbsolute = 1e-5, kRelative = 1e-5;

class MpiDdpGpu : public testing::MpiRankOnGpu {};

TEST_F(MpiDdpGpu, KStepsOnTwoGpusInTwoProcessesAreOneProcessOnTheWholeBatch) {
  auto model = tiny_net();
  model->to(gpu);
  // Small buckets: several all-reduces per backward, overlapped with it.
  DistributedDataParallel ddp(model, nccl_group(group),
                              {.reducer = {.bucket_cap_bytes = 1024, .overlap = true}});
  ASSERT_GT(ddp.reducer().buckets().size(), 1u);
  SGD sgd(ddp.parameters(), kSgd);
  CrossEntropyLoss criterion;
  for (int step = 0; step < kSteps; ++step) {
    const Batch s = shard(make_batch(kGlobalBatch, 500 + step, gpu), ddp.rank(), ddp.world_size());
    sgd.zero_grad();
    const Tensor out = ddp.forward(s.images);
    criterion.forward(out, s.labels, ddp.loss_weight());
    ddp.backward(criterion.backward());
    sgd.step();
  }
  group->comm().synchronize();

  const auto truth = one_process(gpu, info.world_size, share_of_batch, nullptr);
  const auto got = model->named_parameters();
  const auto want = truth->named_parameters();
  ASSERT_EQ(got.size(), want.size());
  double largest = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    const auto a = got[k].second->data.to_vector<float>();
    const auto b = want[k].second->data.to_vector<float>();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      largest = std::max(largest, double(std::abs(a[i] - b[i])));
      ASSERT_NEAR(a[i], b[i], kAbsolute + kRelative * std::abs(b[i]))
          << got[k].first << " element " << i;
    }
    EXPECT_EQ(differs_from_rank0(got[k].second->data), 0u)
        << "rank " << info.rank << "'s " << got[k].first << " differs from rank 0's";
  }
  std::printf("rank %d of %d on cuda:%d: largest |DDP - one process| after %d steps: %.3g\n",
              info.rank, info.world_size, gpu.index, kSteps, largest);
}

// The update beside the backward (Optimizer::set_update_overlap): each bucket's update on the
// optimizer's stream after that bucket's all-reduce, against one update after the backward, with
// the same buckets: every parameter bit for bit after kSteps steps, on every rank.
TEST_F(MpiDdpGpu, BucketByBucketUpdatesAreOneUpdateBitForBit) {
  const auto train = [&](bool overlap) {
    auto model = tiny_net();
    model->to(gpu);
    DistributedDataParallel ddp(model, nccl_group(group),
                                {.reducer = {.bucket_cap_bytes = 1024, .overlap = true}});
    SGD sgd(ddp.parameters(), kSgd);
    if (overlap) sgd.set_update_overlap([&ddp] { return ddp.take_gradient_segments(0); });
    CrossEntropyLoss criterion;
    for (int step = 0; step < kSteps; ++step) {
      const Batch s =
          shard(make_batch(kGlobalBatch, 500 + step, gpu), ddp.rank(), ddp.world_size());
      sgd.zero_grad(ZeroGrad::deferred);
      const Tensor out = ddp.forward(s.images);
      criterion.forward(out, s.labels, ddp.loss_weight());
      ddp.backward(criterion.backward());
      sgd.step();
      EXPECT_EQ(sgd.last_step_overlapped(), overlap && step > 0) << "step " << step;
    }
    group->comm().synchronize();
    std::vector<std::vector<float>> params;
    for (const auto& [name, p] : model->named_parameters()) {
      params.push_back(p->data.to_vector<float>());
    }
    return params;
  };
  const auto whole = train(false);
  const auto pieces = train(true);
  ASSERT_EQ(pieces.size(), whole.size());
  for (size_t k = 0; k < whole.size(); ++k) {
    EXPECT_EQ(pieces[k], whole[k]) << "rank " << info.rank << ", parameter " << k;
  }
}

}  // namespace
}  // namespace cudp::parallel
