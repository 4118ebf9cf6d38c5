// DistributedDataParallel (engine/parallel/ddp.h) on the host, run by ctest under mpirun with 2 and
// with 3 ranks (tests/CMakeLists.txt; built only with MPI). Each rank holds a small
// conv/BatchNorm/linear model on the CPU, and MPI moves the data (mpi_host_group), so no GPU is
// needed; the Reducer, the loss weighting, the broadcasts and no_sync are the ones a GPU run uses.
//
// The truth is computed on every rank without DDP and without MPI: one process, one model, the
// whole global batch (ddp_truth.h says how, BatchNorm included).
//
// Run directly (no mpirun) it is a world of one, and the same checks hold.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/mpi_environment.h"
#include "engine/parallel/ddp.h"
#include "parallel/ddp_truth.h"

namespace cudp::parallel {
namespace {

using namespace testing::ddp;  // NOLINT: the shared model, batches and truth
using testing::mpi_session;

// Tolerance of the parameters (and running statistics) after kSteps steps, against the truth.
// Both runs compute every shard's gradient with the same kernels on the same values; they differ
// only in how the W shard gradients g_r of an element are added. The truth accumulates them in the
// layers' CPU kernels, which sum a shard's products in double and round once onto the gradient
// already there: fl(G + a_r) with a_r exact-ish; DDP rounds each shard's g_r = fl(a_r) alone and
// MPI adds the W floats in an order of its own. Each of the W - 1 additions on either side rounds
// once, and each g_r is rounded once more, so one element's gradients differ by at most
// about 3W u (|g_0| + ... + |g_{W-1}|), u = 2^-24: 1 to 2 ulps of the gradient's magnitude, a
// relative 4e-7 (W = 2) or 5e-7 (W = 3). The first step moves the weights by lr = 0.1 times that;
// later steps add the gradient's response to those differences (the curvature times lr, O(1) for a
// step size that trains) and momentum 0.9 carries them on, so after kSteps = 4 steps the drift is a
// few times 1e-7 relative to the parameters' and statistics' O(0.01..1) magnitudes (the test prints
// the largest it saw; about 1e-7 on this machine). 1e-5 absolute + 1e-5 relative leaves a margin
// of more than 10 over that and still catches a mis-weighted shard, which moves the parameters by
// more than 1e-3 (WeightingTheShardsByOneOverWIsCaught). The conv biases before BatchNorm have a
// true gradient of zero (BatchNorm removes the mean) and hold rounding noise of 1e-10; the
// absolute term covers them.
constexpr double kAbsolute = 1e-5, kRelative = 1e-5;

double largest_error = 0;  // the largest |got - truth| seen, printed for the record

void expect_close_to_truth(const std::vector<float>& got, const std::vector<float>& truth,
                           const std::string& what) {
  ASSERT_EQ(got.size(), truth.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    largest_error = std::max(largest_error, double(std::abs(got[i] - truth[i])));
    ASSERT_NEAR(got[i], truth[i], kAbsolute + kRelative * std::abs(truth[i]))
        << what << " element " << i;
  }
}

struct Trained {
  std::shared_ptr<Sequential> model;
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<SGD> sgd;
};

// kSteps steps of DDP, each rank on its shard, weighting its loss by ddp.loss_weight(). Deferred
// zeroing (layers/module.h) fills the gradients left to the backward with NaN first, as stale
// values a step must neither read nor keep.
// With `overlap` the optimizer updates bucket by bucket (Optimizer::set_update_overlap), on the
// CPU one piece after another; `bucket_cap_bytes`: the reducer's buckets.
Trained ddp_run(ZeroGrad how = ZeroGrad::fill, bool overlap = false,
                int64_t bucket_cap_bytes = ReducerOptions{}.bucket_cap_bytes) {
  Trained t;
  t.model = tiny_net();
  DistributedDataParallelOptions options;
  options.reducer.bucket_cap_bytes = bucket_cap_bytes;
  t.ddp =
      std::make_unique<DistributedDataParallel>(t.model, mpi_host_group(*mpi_session()), options);
  DistributedDataParallel& ddp = *t.ddp;
  t.sgd = std::make_unique<SGD>(ddp.parameters(), kSgd);
  SGD& sgd = *t.sgd;
  if (overlap) {
    EXPECT_GT(ddp.reducer().buckets().size(), 2u);
    sgd.set_update_overlap([&ddp] { return ddp.take_gradient_segments(0); });
  }
  CrossEntropyLoss criterion;
  for (int step = 0; step < kSteps; ++step) {
    const Batch s = shard(make_batch(kGlobalBatch, 500 + step), ddp.rank(), ddp.world_size());
    sgd.zero_grad(how);
    for (Parameter* p : ddp.parameters()) {
      if (p->grad_zero_pending) p->grad.fill_(std::numeric_limits<float>::quiet_NaN());
    }
    const Tensor out = ddp.forward(s.images);
    criterion.forward(out, s.labels, ddp.loss_weight());
    ddp.backward(criterion.backward());
    sgd.step();
    // The first step makes the momentum buffers: one update.
    EXPECT_EQ(sgd.last_step_overlapped(), overlap && step > 0) << "step " << step;
  }
  return t;
}

TEST(MpiDdp, KStepsOnTheRanksShardsAreOneProcessOnTheWholeBatch) {
  ASSERT_NE(mpi_session(), nullptr);
  Trained t = ddp_run();
  DistributedDataParallel& ddp = *t.ddp;
  const int world = ddp.world_size();
  std::vector<std::vector<Tensor>> truth_buffers;
  auto truth = one_process(Device::cpu(), world, share_of_batch, &truth_buffers);

  const auto got = t.model->named_parameters();
  const auto want = truth->named_parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    expect_close_to_truth(got[k].second->data.to_vector<float>(),
                          want[k].second->data.to_vector<float>(), got[k].first);
    EXPECT_EQ(differs_from_rank0(got[k].second->data), 0u)
        << "rank " << ddp.rank() << "'s " << got[k].first << " differs from rank 0's";
  }
  // Rank r's buffers are rank 0's up to the last step, then updated by shard r (the broadcast
  // before each forward): without that broadcast they would hold shard r's statistics alone.
  const auto buffers = t.model->named_buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].second->dtype() != DType::f32) continue;
    expect_close_to_truth(buffers[i].second->to_vector<float>(),
                          truth_buffers[static_cast<size_t>(ddp.rank())][i].to_vector<float>(),
                          "buffer " + buffers[i].first);
  }
  std::printf("rank %d of %d: largest |DDP - one process| after %d steps: %.3g\n", ddp.rank(),
              world, kSteps, largest_error);
  // And broadcast_buffers() makes them rank 0's, bit for bit.
  ddp.broadcast_buffers();
  for (const auto& [name, buffer] : buffers) {
    EXPECT_EQ(differs_from_rank0(*buffer), 0u) << "rank " << ddp.rank() << "'s buffer " << name;
  }
}

// Deferred zeroing gives the same sums: every rank's parameters after kSteps steps are those of
// zeroing first, bit for bit (== on each value). Ranks other than 0 drop the all-reduced total
// before each backward, leaving the flagged gradients to it.
TEST(MpiDdp, DeferredZeroingTrainsAsZeroingFirst) {
  ASSERT_NE(mpi_session(), nullptr);
  std::vector<std::vector<float>> filled;
  {
    const Trained t = ddp_run(ZeroGrad::fill);
    for (const auto& [name, p] : t.model->named_parameters()) {
      filled.push_back(p->data.to_vector<float>());
    }
  }
  const Trained t = ddp_run(ZeroGrad::deferred);
  const auto got = t.model->named_parameters();
  ASSERT_EQ(got.size(), filled.size());
  for (size_t k = 0; k < got.size(); ++k) {
    const std::vector<float> v = got[k].second->data.to_vector<float>();
    size_t differ = 0;
    for (size_t i = 0; i < v.size(); ++i) differ += v[i] == filled[k][i] ? 0 : 1;
    EXPECT_EQ(differ, 0u) << "rank " << t.ddp->rank() << "'s " << got[k].first;
  }
}

// The update beside the backward: the optimizer updates each bucket of the reducer as a piece of
// its own; the parameters after kSteps steps are one update's, bit for bit, with the same buckets
// (with 3 ranks MPI's order of an element's additions may depend on the call's size). A second
// step() after the same backward finds no buckets left, and takes one update; so does a step after
// a backward without sync, or after a forward.
TEST(MpiDdp, BucketByBucketUpdatesAreOneUpdate) {
  ASSERT_NE(mpi_session(), nullptr);
  std::vector<std::vector<float>> whole;
  {
    const Trained t = ddp_run(ZeroGrad::deferred, /*overlap=*/false, /*bucket_cap_bytes=*/256);
    for (const auto& [name, p] : t.model->named_parameters()) {
      whole.push_back(p->data.to_vector<float>());
    }
  }
  const Trained t = ddp_run(ZeroGrad::deferred, /*overlap=*/true, /*bucket_cap_bytes=*/256);
  const auto got = t.model->named_parameters();
  ASSERT_EQ(got.size(), whole.size());
  for (size_t k = 0; k < got.size(); ++k) {
    const std::vector<float> v = got[k].second->data.to_vector<float>();
    size_t differ = 0;
    for (size_t i = 0; i < v.size(); ++i) differ += v[i] == whole[k][i] ? 0 : 1;
    EXPECT_EQ(differ, 0u) << "rank " << t.ddp->rank() << "'s " << got[k].first;
  }
  t.sgd->step();
  EXPECT_FALSE(t.sgd->last_step_overlapped());
  // A backward without sync, or a forward alone, leaves no buckets to update beside.
  DistributedDataParallel& ddp = *t.ddp;
  CrossEntropyLoss criterion;
  const Batch s = shard(make_batch(kGlobalBatch, 900), ddp.rank(), ddp.world_size());
  {
    const auto no_sync = ddp.no_sync();
    criterion.forward(ddp.forward(s.images), s.labels, ddp.loss_weight());
    ddp.backward(criterion.backward());
  }
  t.sgd->step();
  EXPECT_FALSE(t.sgd->last_step_overlapped());
  criterion.forward(ddp.forward(s.images), s.labels, ddp.loss_weight());
  ddp.backward(criterion.backward());
  ddp.forward(s.images);
  t.sgd->step();
  EXPECT_FALSE(t.sgd->last_step_overlapped()) << "a forward ends the last backward's buckets";
}

// The test above can fail: the truth with each shard weighted 1 / W (PyTorch's averaging applied to
// our summed convention with uneven shards) is far from DDP's result beyond the tolerance.
TEST(MpiDdp, WeightingTheShardsByOneOverWIsCaught) {
  ASSERT_NE(mpi_session(), nullptr);
  const int world = mpi_session()->info().world_size;
  if (world == 1) GTEST_SKIP() << "one rank: 1 / W is n_r / B";
  Trained t = ddp_run();
  static int w = 0;
  w = world;
  auto wrong = one_process(
      Device::cpu(), world, [](int64_t, int64_t) { return 1.0 / w; }, nullptr);
  double largest = 0;
  const auto got = t.model->parameters();
  const auto want = wrong->parameters();
  for (size_t k = 0; k < got.size(); ++k) {
    const auto a = got[k]->data.to_vector<float>(), b = want[k]->data.to_vector<float>();
    for (size_t i = 0; i < a.size(); ++i)
      largest = std::max(largest, double(std::abs(a[i] - b[i])));
  }
  EXPECT_GT(largest, 1e-3) << "a 1 / W weighting is not told apart from n_r / B";
}

TEST(MpiDdp, ConstructionMakesEveryRankRankZerosModel) {
  ASSERT_NE(mpi_session(), nullptr);
  const int rank = mpi_session()->info().rank;
  // Each rank initialises with its own seeds and moves its running statistics with its own data.
  auto model = tiny_net(static_cast<uint64_t>(rank) * 100);
  model->forward(make_batch(5, 900 + static_cast<uint64_t>(rank)).images);
  const std::vector<Tensor> own_params = [&] {
    std::vector<Tensor> out;
    for (Parameter* p : model->parameters()) out.push_back(p->data.clone());
    return out;
  }();
  if (mpi_session()->info().world_size > 1) {
    size_t differing = 0;
    for (const Tensor& p : own_params) differing += differs_from_rank0(p);
    if (rank > 0) {
      EXPECT_GT(differing, 0u) << "the ranks' models must differ before DDP for this test to mean "
                                  "anything";
    }
  }
  DistributedDataParallel ddp(model, mpi_host_group(*mpi_session()));
  const auto params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_EQ(differs_from_rank0(params[k]->data), 0u) << "rank " << rank << " parameter " << k;
    if (rank == 0) {
      EXPECT_EQ(params[k]->data.to_vector<float>(), own_params[k].to_vector<float>())
          << "rank 0's parameter " << k << " changed";
    }
  }
  for (const auto& [name, buffer] : model->named_buffers()) {
    EXPECT_EQ(differs_from_rank0(*buffer), 0u) << "rank " << rank << " buffer " << name;
  }
}

// Every parameter's gradient, one after the other.
std::vector<float> gradients(Module& model) {
  std::vector<float> all;
  for (Parameter* p : model.parameters()) {
    const auto v = p->grad.to_vector<float>();
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

// own[m][r]: the gradient of shard r of micro-batch m, from a plain model of the same
// initialisation (no DDP), weighted as its share of the micro-batch.
std::vector<std::vector<std::vector<float>>> own_gradients(const Batch (&micro)[2], int world) {
  std::vector<std::vector<std::vector<float>>> own(2);
  for (int m = 0; m < 2; ++m) {
    for (int r = 0; r < world; ++r) {
      auto plain = tiny_net();
      const Batch s = shard(micro[m], r, world);
      CrossEntropyLoss c;
      const Tensor out = plain->forward(s.images);
      c.forward(out, s.labels, CrossEntropyLoss::chunk_weight(s.images.size(0), kGlobalBatch));
      plain->backward(c.backward());
      own[m].push_back(gradients(*plain));
    }
  }
  return own;
}

// After two backwards over the micro-batches, every rank must hold the sum of the 2W terms
// own[m][r], each counted once. DDP adds each rank's two (the kernel rounding the second,
// accumulated in double, onto the first) and the all-reduce the W results in its order; the truth
// here adds them in float in its own order. Each side rounds at most 2W + 1 times, each rounding
// off by at most u = 2^-24 times the sum of the terms' magnitudes, so per element |DDP - truth| <=
// 2 (2W + 1) u sum |own[m][r]|: a bound derived for each element, not a guess.
void expect_both_micro_batches_summed_once(Module& model, const Batch (&micro)[2], int rank,
                                           int world, const char* what) {
  const auto own = own_gradients(micro, world);
  const std::vector<float> got = gradients(model);
  std::vector<float> truth(got.size(), 0.f);
  std::vector<double> magnitude(got.size(), 0.0);
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < truth.size(); ++i) {
      truth[i] += own[0][r][i] + own[1][r][i];
      magnitude[i] += std::abs(double(own[0][r][i])) + std::abs(double(own[1][r][i]));
    }
  }
  const double u = std::ldexp(1.0, -24);
  double worst = 0;  // the largest |error| / bound seen
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = 2 * (2 * world + 1) * u * magnitude[i];
    const double error = std::abs(double(got[i]) - double(truth[i]));
    if (bound > 0) worst = std::max(worst, error / bound);
    ASSERT_LE(error, bound) << what << ": gradient element " << i << ": " << got[i] << " against "
                            << truth[i];
  }
  std::printf("rank %d of %d: %s: largest error %.2f of its bound\n", rank, world, what, worst);
  for (Parameter* p : model.parameters()) EXPECT_EQ(differs_from_rank0(p->grad), 0u);
}

// no_sync: a backward inside it leaves this rank's own gradient (what a plain model computes on the
// shard, bit for bit); the next backward, synced, sums both micro-batches over every rank.
TEST(MpiDdp, NoSyncKeepsGradientsLocalUntilTheNextSyncedBackward) {
  ASSERT_NE(mpi_session(), nullptr);
  auto model = tiny_net();
  DistributedDataParallel ddp(model, mpi_host_group(*mpi_session()));
  const int rank = ddp.rank(), world = ddp.world_size();
  CrossEntropyLoss criterion;
  const Batch micro[2] = {make_batch(kGlobalBatch, 700), make_batch(kGlobalBatch, 701)};
  ddp.zero_grad();
  {
    const auto guard = ddp.no_sync();
    const Batch s = shard(micro[0], rank, world);
    const Tensor out = ddp.forward(s.images);  // before loss_weight(): it is the forward's
    criterion.forward(out, s.labels, ddp.loss_weight());
    ddp.backward(criterion.backward());
  }
  EXPECT_TRUE(ddp.gradient_sync());
  EXPECT_EQ(gradients(*model), own_gradients(micro, world)[0][static_cast<size_t>(rank)])
      << "inside no_sync the gradient must be this rank's own";

  const Batch s = shard(micro[1], rank, world);
  const Tensor out = ddp.forward(s.images);
  criterion.forward(out, s.labels, ddp.loss_weight());
  ddp.backward(criterion.backward());
  expect_both_micro_batches_summed_once(*model, micro, rank, world, "no_sync, then synced");
}

// zero_grad, then each micro-batch's shard through a synced forward and backward, no zero_grad
// between them.
void two_synced_backwards(DistributedDataParallel& ddp, const Batch (&micro)[2]) {
  CrossEntropyLoss criterion;
  ddp.zero_grad();
  for (const Batch& b : micro) {
    const Batch s = shard(b, ddp.rank(), ddp.world_size());
    const Tensor out = ddp.forward(s.images);
    criterion.forward(out, s.labels, ddp.loss_weight());
    ddp.backward(criterion.backward());
  }
}

// Two synced backwards with no zero_grad between them accumulate as one model would: the first
// backward's total counts once, not once per rank (every rank holds it after the all-reduce; the
// ranks other than 0 drop it before the next backward adds to it, as DataParallel's replicas do).
TEST(MpiDdp, TwoSyncedBackwardsWithoutZeroGradCountTheFirstOnce) {
  ASSERT_NE(mpi_session(), nullptr);
  auto model = tiny_net();
  DistributedDataParallel ddp(model, mpi_host_group(*mpi_session()));
  const int rank = ddp.rank(), world = ddp.world_size();
  const Batch micro[2] = {make_batch(kGlobalBatch, 710), make_batch(kGlobalBatch, 711)};
  two_synced_backwards(ddp, micro);
  expect_both_micro_batches_summed_once(*model, micro, rank, world, "two synced backwards");
}

// A second DistributedDataParallel around a wrapped model is refused before it changes anything
// (flattening the parameters again left the first one's gradients outside its flat buffer, and its
// reducer's hooks replaced), and the first one trains on: its synced backward still sums both
// micro-batches once, as in the test above.
TEST(MpiDdp, ASecondWrapperIsRefusedAndTheFirstTrainsOn) {
  ASSERT_NE(mpi_session(), nullptr);
  auto model = tiny_net();
  DistributedDataParallel ddp(model, mpi_host_group(*mpi_session()));
  try {
    DistributedDataParallel second(model, mpi_host_group(*mpi_session()));
    FAIL() << "a second DistributedDataParallel wrapped the same model";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("wrap the model once"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(ddp.reducer().layout_intact());
  const int rank = ddp.rank(), world = ddp.world_size();
  const Batch micro[2] = {make_batch(kGlobalBatch, 720), make_batch(kGlobalBatch, 721)};
  two_synced_backwards(ddp, micro);
  expect_both_micro_batches_summed_once(*model, micro, rank, world, "after a refused wrapper");
}

// loss_weight(rows), the weight of a batch run as several forwards (gradient accumulation): this
// rank's rows over every rank's, here uneven (rank r has r + 1 rows).
TEST(MpiDdp, LossWeightOfABatchIsItsRowsOverEveryRanks) {
  ASSERT_NE(mpi_session(), nullptr);
  DistributedDataParallel ddp(tiny_net(), mpi_host_group(*mpi_session()));
  const int rank = ddp.rank(), world = ddp.world_size();
  EXPECT_EQ(ddp.loss_weight(rank + 1), double(rank + 1) / double(world * (world + 1) / 2));
  EXPECT_THROW(ddp.loss_weight(0), ValueError);
}

}  // namespace
}  // namespace cudp::parallel
