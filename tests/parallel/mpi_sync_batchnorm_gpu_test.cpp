// SyncBatchNorm2d across processes on GPUs: ctest runs it as `mpirun -np 2` (tests/CMakeLists.txt;
// built only with MPI). Each process drives the GPU of its local rank (ProcessGroup::from_mpi), a
// DistributedDataParallel over nccl_group wraps one SyncBatchNorm2d and attaches the ranks' group
// (DistributedStatsGroup), so the statistics are summed by NCCL on the layer's stream; each rank
// holds its uneven shard of a batch of 7 (4 + 3). Against one BatchNorm2d over the whole batch on
// the CPU: y, dx, dgamma and dbeta (summed over the ranks by DDP's gradient all-reduce) and the
// running statistics within the bounds of tests/layers/sync_batchnorm_testing.h for GPU
// participants (f32_arithmetic, as tests/layers/sync_batchnorm_gpu_test.cpp's two GPUs of one
// process), two steps; the running statistics bit-identical on every rank.
//
// Written but not yet run: it needs a machine with 2 GPUs and MPI (CI skips it; every rank sees the
// same GPU count, so all skip together). Run directly, it is a world of one: BatchNorm2d.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "common/gpu.h"
#include "engine/parallel/ddp.h"
#include "engine/parallel/mpi_bootstrap.h"
#include "layers/sync_batchnorm.h"
#include "parallel/ddp_truth.h"
#include "parallel/mpi_gpu_testing.h"
#include "tests/layers/layer_testing.h"
#include "tests/layers/sync_batchnorm_testing.h"

namespace cudp::parallel {
namespace {

using testing::BnStep;
using testing::random_tensor;
using testing::values;
using testing::ddp::differs_from_rank0;
using testing::ddp::shard_begin;

constexpr int kC = 5;
constexpr int64_t kRows = 7;
constexpr float kEps = 1e-5f, kMomentum = 0.1f;

// [rows, 3, 2, kC] with a large mean per channel (3 + 10 c) against a spread of ~1.
Tensor layer_batch(int64_t rows, uint64_t seed) {
  std::vector<float> v = values(random_tensor({rows, 3, 2, kC}, seed, -1.7f, 1.7f));
  for (size_t i = 0; i < v.size(); ++i) v[i] += 3.0f + 10.0f * float(i % kC);
  return Tensor::from_vector(v, {rows, 3, 2, kC});
}

std::vector<float> shard_values(const std::vector<float>& whole, int r, int w) {
  const size_t per_row = whole.size() / static_cast<size_t>(kRows);
  return {whole.begin() + static_cast<long>(per_row * shard_begin(r, w, kRows)),
          whole.begin() + static_cast<long>(per_row * shard_begin(r + 1, w, kRows))};
}

class MpiSyncBatchNormGpu : public testing::MpiRankOnGpu {};

TEST_F(MpiSyncBatchNormGpu, GpusInSeveralProcessesEqualBatchNormOverTheWholeBatch) {
  const int rank = info.rank, world = info.world_size;

  BatchNorm2d truth_bn(kC, kEps, kMomentum);
  testing::randomize_parameters(truth_bn, 9, 0.5f, 1.5f);
  auto sync = convert_sync_batchnorm(truth_bn.clone(gpu));
  auto& layer = static_cast<BatchNorm2d&>(*sync);
  DistributedDataParallel ddp(sync, nccl_group(group));
  if (world > 1) {
    ASSERT_NE(static_cast<SyncBatchNorm2d&>(layer).stats_group(), nullptr);
  }
  for (uint64_t step = 0; step < 2; ++step) {
    const Tensor x = layer_batch(kRows, 30 + step), dy = random_tensor(x.shape(), 40 + step);
    const std::vector<float> gamma = values(truth_bn.weight().data);
    const BnStep truth = testing::bn_training_step(truth_bn, x, dy);
    const int64_t begin = shard_begin(rank, world, kRows),
                  end = shard_begin(rank + 1, world, kRows);
    ddp.zero_grad();
    BnStep got;
    got.y = values(ddp.forward(x.slice(begin, end).to(gpu)));
    got.dx = values(ddp.backward(dy.slice(begin, end).to(gpu)));
    group->comm().synchronize();               // a hang or an NCCL error becomes an error here
    got.dgamma = values(layer.weight().grad);  // DDP's all-reduce: every rank's share summed
    got.dbeta = values(layer.bias().grad);
    got.running_mean = values(layer.running_mean());
    got.running_var = values(layer.running_var());
    const auto tol = testing::sync_bn_tolerance(values(x), values(dy), gamma, kC, kEps, kMomentum,
                                                world, truth, /*f32_arithmetic=*/true);
    testing::expect_within(got.y, shard_values(truth.y, rank, world), tol.y, "y");
    testing::expect_within(got.dx, shard_values(truth.dx, rank, world), tol.dx, "dx");
    testing::expect_within(got.dgamma, truth.dgamma, tol.dgamma, "dgamma");
    testing::expect_within(got.dbeta, truth.dbeta, tol.dbeta, "dbeta");
    const double again = step > 0 ? 2 : 1;  // the second update carries the first one's error
    testing::expect_within(got.running_mean, truth.running_mean, again * tol.running_mean,
                           "running_mean");
    testing::expect_within(got.running_var, truth.running_var, again * tol.running_var,
                           "running_var");
    EXPECT_EQ(differs_from_rank0(layer.running_mean()), 0u) << "rank " << rank;
    EXPECT_EQ(differs_from_rank0(layer.running_var()), 0u) << "rank " << rank;
  }
}

}  // namespace
}  // namespace cudp::parallel
