// SyncBatchNorm2d across processes, on the host, run by ctest under mpirun with 2 and with 3 ranks
// (tests/CMakeLists.txt; built only with MPI). Each rank holds its layers on the CPU and MPI moves
// the statistics (mpi_host_group, DistributedStatsGroup), so no GPU is needed; the layer, its
// kernels and DistributedDataParallel's attaching are the ones a GPU run uses (only the sum
// differs: NCCL there).
//
// The truth is computed on every rank without MPI: one BatchNorm2d, one process, the whole batch
// of 7 rows, which the ranks hold as uneven shards (3 + 4, or 2 + 2 + 3; ddp_truth.h's shard), so
// a merge that weighted the ranks equally would fail.
//   - one SyncBatchNorm2d per rank: y, dx, the summed dgamma and dbeta and the running statistics
//     within the bounds of tests/layers/sync_batchnorm_testing.h (derived there for N
//     participants), two steps; and bit for bit what HostStatsGroup's participants on threads
//     compute, since the MPI group sums in the same (rank) order;
//   - a conv/BatchNorm/ReLU net converted to SyncBatchNorm2d under DistributedDataParallel, kSteps
//     SGD steps: against W participants of SyncBatchNorm2d on threads in one process, bit for bit
//     with 2 ranks (with 3, within the bound of MPI's own order of the gradient sum); and against
//     one process with one BatchNorm2d on the whole batch: the first logits and gradients, and the
//     parameters and running statistics after the steps, within kNetAbsolute + kNetRelative
//     (derived there);
//   - both comparisons with one BatchNorm2d can fail: plain BatchNorm2d per rank (each shard's
//     own statistics) is far outside the same bounds.
//
// Run directly (no mpirun) it is a world of one: no group is attached, and the layer is
// BatchNorm2d.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mpi_environment.h"
#include "engine/parallel/ddp.h"
#include "engine/parallel/stats_group.h"
#include "layers/sync_batchnorm.h"
#include "parallel/ddp_truth.h"
#include "tests/layers/layer_testing.h"
#include "tests/layers/sync_batchnorm_testing.h"

namespace cudp::parallel {
namespace {

using namespace testing::ddp;  // NOLINT: the shared model, batches, shards and rank checks
using testing::BnStep;
using testing::mpi_session;
using testing::random_tensor;
using testing::values;

constexpr int kC = 5;
constexpr float kEps = 1e-5f, kMomentum = 0.1f;

int this_rank() {
  return mpi_session()->info().rank;
}
int world_size() {
  return mpi_session()->info().world_size;
}

// [rows, 3, 2, kC] with a large mean per channel (3 + 10 c) against a spread of ~1, so that the
// shifts of the merge matter (as in sync_batchnorm_test.cpp).
Tensor layer_batch(int64_t rows, uint64_t seed) {
  std::vector<float> v = values(random_tensor({rows, 3, 2, kC}, seed, -1.7f, 1.7f));
  for (size_t i = 0; i < v.size(); ++i) v[i] += 3.0f + 10.0f * float(i % kC);
  return Tensor::from_vector(v, {rows, 3, 2, kC});
}

Tensor rows_of(const Tensor& t, int r, int w) {
  const int64_t b = t.size(0);
  return t.slice(shard_begin(r, w, b), shard_begin(r + 1, w, b));
}

// The elements of a [rows, ...] batch's flattened values that belong to rank r's shard.
std::vector<float> shard_values(const std::vector<float>& whole, int64_t rows, int r, int w) {
  const size_t per_row = whole.size() / static_cast<size_t>(rows);
  return {whole.begin() + static_cast<long>(per_row * shard_begin(r, w, rows)),
          whole.begin() + static_cast<long>(per_row * shard_begin(r + 1, w, rows))};
}

// Every rank's `mine` summed in double, the same on every rank.
std::vector<float> summed_over_ranks(const std::vector<float>& mine) {
  const size_t n = mine.size(), w = static_cast<size_t>(world_size());
  std::vector<float> all(n * w);
  mpi_session()->all_gather(mine.data(), n * sizeof(float), all.data());
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    double s = 0;
    for (size_t r = 0; r < w; ++r) s += all[r * n + i];
    out[i] = static_cast<float>(s);
  }
  return out;
}

double largest_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  }
  return m;
}

// The same step on `participants` SyncBatchNorm2d layers on threads, sharing a HostStatsGroup,
// participant p on shard p: what each participant holds after it.
std::vector<BnStep> threads_step(const std::vector<std::shared_ptr<SyncBatchNorm2d>>& layers,
                                 const Tensor& x, const Tensor& dy) {
  const int n = static_cast<int>(layers.size());
  std::vector<BnStep> out(layers.size());
  std::vector<std::exception_ptr> errors(layers.size());
  std::vector<std::thread> threads;
  for (int p = 0; p < n; ++p) {
    threads.emplace_back([&, p] {
      try {
        out[p] = testing::bn_training_step(*layers[p], rows_of(x, p, n), rows_of(dy, p, n));
      } catch (...) {
        errors[p] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

std::shared_ptr<SyncBatchNorm2d> sync_copy(BatchNorm2d& bn) {
  auto s = std::make_shared<SyncBatchNorm2d>(init::skip_init, kC, kEps, kMomentum);
  s->load_state_dict(bn.state_dict());
  return s;
}

TEST(MpiSyncBatchNorm, OneLayerPerRankIsBatchNormOverTheWholeBatch) {
  ASSERT_NE(mpi_session(), nullptr);
  const int rank = this_rank(), world = world_size();
  const auto group = std::make_shared<DistributedStatsGroup>(mpi_host_group(*mpi_session()));
  EXPECT_EQ(group->size(), static_cast<size_t>(world));
  BatchNorm2d truth_bn(kC, kEps, kMomentum);
  testing::randomize_parameters(truth_bn, 7, 0.5f, 1.5f);
  auto mine = sync_copy(truth_bn);
  mine->set_stats_group(group, static_cast<size_t>(rank));
  auto plain = std::make_shared<BatchNorm2d>(kC, kEps, kMomentum);  // the failing comparison
  plain->load_state_dict(truth_bn.state_dict());
  std::vector<std::shared_ptr<SyncBatchNorm2d>> on_threads;
  const auto host_group = std::make_shared<HostStatsGroup>(static_cast<size_t>(world));
  for (int p = 0; p < world; ++p) {
    on_threads.push_back(sync_copy(truth_bn));
    on_threads.back()->set_stats_group(host_group, static_cast<size_t>(p));
  }
  double largest_y = 0, plain_y = 0, tol_y = 0;
  for (uint64_t step = 0; step < 2; ++step) {  // the running statistics' second update too
    const Tensor x = layer_batch(kGlobalBatch, 11 + step), dy = random_tensor(x.shape(), 21 + step);
    const std::vector<float> gamma = values(truth_bn.weight().data);
    const BnStep truth = testing::bn_training_step(truth_bn, x, dy);
    const BnStep got =
        testing::bn_training_step(*mine, rows_of(x, rank, world), rows_of(dy, rank, world));
    const auto tol =
        testing::sync_bn_tolerance(values(x), values(dy), gamma, kC, kEps, kMomentum, world, truth);
    const std::vector<float> y = shard_values(truth.y, kGlobalBatch, rank, world);
    testing::expect_within(got.y, y, tol.y, "y");
    testing::expect_within(got.dx, shard_values(truth.dx, kGlobalBatch, rank, world), tol.dx, "dx");
    testing::expect_within(summed_over_ranks(got.dgamma), truth.dgamma, tol.dgamma, "dgamma");
    testing::expect_within(summed_over_ranks(got.dbeta), truth.dbeta, tol.dbeta, "dbeta");
    // The second update adds the first's error, carried by 1 - momentum.
    const double twice = step > 0 ? 2 : 1;
    testing::expect_within(got.running_mean, truth.running_mean, twice * tol.running_mean,
                           "running_mean");
    testing::expect_within(got.running_var, truth.running_var, twice * tol.running_var,
                           "running_var");
    for (const Tensor* t : {&mine->running_mean(), &mine->running_var()}) {
      EXPECT_EQ(differs_from_rank0(*t), 0u) << "rank " << rank << "'s running statistics";
    }
    largest_y = std::max(largest_y, largest_difference(got.y, y));
    tol_y = tol.y;

    // The MPI group adds the ranks' sums in rank order, as HostStatsGroup adds its participants':
    // the same bits as the participants on threads in one process.
    const std::vector<BnStep> threads = threads_step(on_threads, x, dy);
    const BnStep& twin = threads[static_cast<size_t>(rank)];
    EXPECT_EQ(got.y, twin.y);
    EXPECT_EQ(got.dx, twin.dx);
    EXPECT_EQ(got.dgamma, twin.dgamma);
    EXPECT_EQ(got.dbeta, twin.dbeta);
    EXPECT_EQ(got.running_mean, twin.running_mean);
    EXPECT_EQ(got.running_var, twin.running_var);

    // The comparison can fail: each rank's own BatchNorm2d normalises its shard by the shard's
    // statistics (a channel mean of 3 + 10 c moves with the shard), far outside the bound.
    if (world > 1) {
      const BnStep own =
          testing::bn_training_step(*plain, rows_of(x, rank, world), rows_of(dy, rank, world));
      plain_y = std::max(plain_y, largest_difference(own.y, y));
      EXPECT_GT(largest_difference(own.y, y), 100 * tol.y)
          << "rank " << rank << ": BatchNorm2d of the shard alone is not told apart";
    }
  }
  EXPECT_EQ(mine->num_batches_tracked(), 2);
  std::printf(
      "rank %d of %d: one layer: largest |y - truth| %.3g (bound %.3g); plain BatchNorm2d per "
      "rank: %.3g\n",
      rank, world, largest_y, tol_y, plain_y);
}

// ---- a net under DistributedDataParallel --------------------------------------------------------

// What a run records: the first step's logits (this rank's rows) and gradients (after the
// all-reduce: the global batch's), and the model after kSteps steps.
struct NetRun {
  std::vector<float> logits;
  std::vector<std::vector<float>> grads;
  std::shared_ptr<Sequential> model;
};

std::vector<std::vector<float>> gradients_of(Module& m) {
  std::vector<std::vector<float>> out;
  for (Parameter* p : m.parameters()) out.push_back(p->grad.to_vector<float>());
  return out;
}

// The truth: one process, plain BatchNorm2d, the whole batch of kGlobalBatch each step.
NetRun one_process_whole_batch() {
  NetRun run;
  run.model = tiny_net();
  run.model->flatten_parameters();
  SGD sgd(run.model->parameters(), kSgd);
  CrossEntropyLoss criterion;
  for (int step = 0; step < kSteps; ++step) {
    const Batch b = make_batch(kGlobalBatch, 500 + step);
    sgd.zero_grad();
    const Tensor out = run.model->forward(b.images);
    criterion.forward(out, b.labels);
    run.model->backward(criterion.backward());
    if (step == 0) {
      run.logits = shard_values(out.to_vector<float>(), kGlobalBatch, this_rank(), world_size());
      run.grads = gradients_of(*run.model);
    }
    sgd.step();
  }
  return run;
}

// kSteps steps of DDP, each rank on its shard; `sync`: the BatchNorm layers converted to
// SyncBatchNorm2d first (DistributedDataParallel attaches them to the ranks' group).
NetRun ddp_run(bool sync) {
  NetRun run;
  run.model = tiny_net();
  if (sync) convert_sync_batchnorm(run.model);
  DistributedDataParallel ddp(run.model, mpi_host_group(*mpi_session()));
  SGD sgd(ddp.parameters(), kSgd);
  CrossEntropyLoss criterion;
  for (int step = 0; step < kSteps; ++step) {
    const Batch s = shard(make_batch(kGlobalBatch, 500 + step), ddp.rank(), ddp.world_size());
    sgd.zero_grad();
    const Tensor out = ddp.forward(s.images);
    criterion.forward(out, s.labels, ddp.loss_weight());
    ddp.backward(criterion.backward());
    if (step == 0) {
      run.logits = out.to_vector<float>();
      run.grads = gradients_of(*run.model);
    }
    sgd.step();
  }
  return run;
}

// The one-process twin of the ranks: W replicas of the converted net, replica p participant p of
// a HostStatsGroup on shard p, on threads (what DataParallel's replicas compute), their gradients
// summed in rank order in f32, then an SGD step on each. Returns replica `rank`'s run.
NetRun participants_on_threads() {
  const int world = world_size(), rank = this_rank();
  const auto group = std::make_shared<HostStatsGroup>(static_cast<size_t>(world));
  std::vector<std::shared_ptr<Sequential>> replicas;
  std::vector<Tensor> flat_grads;
  std::vector<std::unique_ptr<SGD>> sgd;
  for (int p = 0; p < world; ++p) {
    replicas.push_back(tiny_net());
    convert_sync_batchnorm(replicas.back());
    attach_stats_group(*replicas.back(), group, static_cast<size_t>(p));
    flat_grads.push_back(replicas.back()->flatten_parameters().second);
    sgd.push_back(std::make_unique<SGD>(replicas.back()->parameters(), kSgd));
  }
  NetRun run;
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = make_batch(kGlobalBatch, 500 + step);
    std::vector<Tensor> outs(static_cast<size_t>(world));
    std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    for (int p = 0; p < world; ++p) {
      threads.emplace_back([&, p] {
        try {
          const Batch s = shard(batch, p, world);
          CrossEntropyLoss criterion;
          sgd[p]->zero_grad();
          outs[p] = replicas[p]->forward(s.images);
          criterion.forward(outs[p], s.labels,
                            CrossEntropyLoss::chunk_weight(s.images.size(0), kGlobalBatch));
          replicas[p]->backward(criterion.backward());
        } catch (...) {
          errors[p] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    std::vector<float> sum = flat_grads[0].to_vector<float>();
    for (int p = 1; p < world; ++p) {
      const std::vector<float> g = flat_grads[p].to_vector<float>();
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
    }
    const Tensor total = Tensor::from_vector(sum, flat_grads[0].shape());
    for (Tensor& g : flat_grads) g.copy_from(total);
    if (step == 0) {
      run.logits = outs[static_cast<size_t>(rank)].to_vector<float>();
      run.grads = gradients_of(*replicas[static_cast<size_t>(rank)]);
    }
    for (auto& o : sgd) o->step();
  }
  run.model = replicas[static_cast<size_t>(rank)];
  return run;
}

// Against the participants on threads, the comparison that can be made exactly. The ranks compute
// each layer as those participants do (the MPI group sums the statistics in rank order, as
// HostStatsGroup does), so the first logits are the same bits with any W. The gradient all-reduce
// is MPI's: two floats have one sum whatever the order, so with W = 2 everything stays bit for bit
// over the kSteps steps; with W = 3 MPI may add the ranks' gradients in another order than
// ((g_0 + g_1) + g_2), and two orders of three floats differ by at most 4 u sum_r |g_r| (two
// roundings of at most u = 2^-24 of the partial sums each, on either side): the first gradients
// are checked against that bound element by element, and the later steps carry such differences
// on as mpi_ddp_test.cpp derives (1e-5 + 1e-5 relative after its kSteps steps).
TEST(MpiSyncBatchNorm, DdpOverSyncBatchNormIsTheParticipantsOfOneProcess) {
  ASSERT_NE(mpi_session(), nullptr);
  const int rank = this_rank(), world = world_size();
  const NetRun twin = participants_on_threads();
  const NetRun got = ddp_run(/*sync=*/true);
  EXPECT_EQ(got.logits, twin.logits) << "rank " << rank << ": the first logits";
  ASSERT_EQ(got.grads.size(), twin.grads.size());
  if (world <= 2) {
    EXPECT_EQ(got.grads, twin.grads) << "rank " << rank << ": the first gradients";
  } else {
    // The bound needs every rank's own shard gradient (before the sum): each rank computes its own
    // with the converted net and the ranks' group, without DDP, and the ranks gather them.
    std::vector<float> own;
    {
      auto net = tiny_net();
      convert_sync_batchnorm(net);
      const auto group = std::make_shared<DistributedStatsGroup>(mpi_host_group(*mpi_session()));
      attach_stats_group(*net, group, static_cast<size_t>(rank));
      const Batch s = shard(make_batch(kGlobalBatch, 500), rank, world);
      CrossEntropyLoss criterion;
      const Tensor out = net->forward(s.images);
      criterion.forward(out, s.labels,
                        CrossEntropyLoss::chunk_weight(s.images.size(0), kGlobalBatch));
      net->backward(criterion.backward());
      for (const auto& g : gradients_of(*net)) own.insert(own.end(), g.begin(), g.end());
    }
    std::vector<float> all(own.size() * static_cast<size_t>(world));
    mpi_session()->all_gather(own.data(), own.size() * sizeof(float), all.data());
    const double u = std::ldexp(1.0, -24);
    size_t i = 0;
    double worst = 0;  // the largest |difference| / bound
    for (size_t k = 0; k < got.grads.size(); ++k) {
      for (size_t j = 0; j < got.grads[k].size(); ++j, ++i) {
        double magnitude = 0;
        for (int r = 0; r < world; ++r) magnitude += std::abs(double(all[r * own.size() + i]));
        const double d = std::abs(double(got.grads[k][j]) - double(twin.grads[k][j]));
        const double bound = 4 * u * magnitude;
        if (bound > 0) worst = std::max(worst, d / bound);
        ASSERT_LE(d, bound) << "rank " << rank << ": gradient " << k << " element " << j;
      }
    }
    std::printf("rank %d of %d: first gradients against the participants': %.2f of the bound\n",
                rank, world, worst);
  }
  const auto p = got.model->parameters(), q = twin.model->parameters();
  const auto b = got.model->named_buffers(), c = twin.model->named_buffers();
  ASSERT_EQ(p.size(), q.size());
  ASSERT_EQ(b.size(), c.size());
  if (world <= 2) {
    for (size_t k = 0; k < p.size(); ++k) {
      EXPECT_EQ(p[k]->data.to_vector<float>(), q[k]->data.to_vector<float>()) << "parameter " << k;
    }
    for (size_t k = 0; k < b.size(); ++k) {
      if (b[k].second->dtype() != DType::f32) continue;
      EXPECT_EQ(b[k].second->to_vector<float>(), c[k].second->to_vector<float>()) << b[k].first;
    }
  } else {
    double largest = 0;
    for (size_t k = 0; k < p.size(); ++k) {
      const auto x = p[k]->data.to_vector<float>(), y = q[k]->data.to_vector<float>();
      for (size_t j = 0; j < x.size(); ++j) {
        largest = std::max(largest, std::abs(double(x[j]) - double(y[j])));
        ASSERT_NEAR(x[j], y[j], 1e-5 + 1e-5 * std::abs(y[j])) << "parameter " << k;
      }
    }
    std::printf("rank %d of %d: parameters after %d steps against the participants': %.3g\n", rank,
                world, kSteps, largest);
  }
}

// Against one BatchNorm2d over the whole batch. The test above pins the ranks to W participants of
// SyncBatchNorm2d in one process; what separates those from one BatchNorm2d is the layer's own
// split of its sums, each term derived in sync_batchnorm_testing.h (u = 2^-24):
//   - forward: each participant's summary rounded to f32 and merged moves the mean by at most
//     e std and invstd relatively by e, e = u (R invstd + (var + 4 R^2) / (var + eps)) + 2 u
//     (R: the channel's range);
//   - backward: the sums [sum g | sum g xhat] rounded per participant and added, W u relatively;
//   - the gradients: each shard's rounded and the W added, 3 W u (mpi_ddp_test.cpp).
// The one-layer test above checks those bounds. Through this net the errors are not worst cases
// lined up: every one is a rounding of at most half an ulp, as likely up as down and independent
// of the others, so a sum of k of them is typically sqrt(k) u of its terms, and the normalised
// values move by a few u (the one-layer test sees 2.4e-7 on values of up to ~3, 2 to 3 u, against
// its worst case of 1.5e-5). The net's two normalisations pass on only the relative error of their
// input's deviations (they remove shift and scale), ReLU and max pooling do not enlarge an error,
// and the convolution and linear layers add independent errors in quadrature with weights below
// 0.2, so the first logits and gradients move by a few u relatively (about 1e-7 of their O(0.1..1)
// magnitudes). Each of the kSteps steps at lr 0.1 adds lr times such a gradient error and the
// curvature's response to the earlier drift, O(1) times lr (mpi_ddp_test.cpp's argument), and
// momentum 0.9 carries them on: a few 1e-7 after 4 steps, for the running statistics too (the
// moving average of the statistics, whose errors are the forward's). kNetAbsolute = 1e-5 +
// kNetRelative = 1e-5 of the value is more than 30 times that (the test prints the largest share of
// the bound it saw: 0.005) and covers the conv biases before BatchNorm, whose true gradient is zero
// and holds rounding noise of 1e-9. It is not a worst-case bound: lining every rounding up through
// the two normalisations, the next convolution's 72 inputs and the linear layer's 32 gives about
// 2e-3 for the logits, within a factor of 10 of what plain BatchNorm2d per rank changes (it
// normalises by a shard's statistics: logits O(0.02) off, parameters O(0.1) after 4 steps, both
// checked to be more than 100 bounds off below), so such a bound would hardly tell them apart.
constexpr double kNetAbsolute = 1e-5, kNetRelative = 1e-5;

struct Worst {
  double error = 0;   // the largest |got - truth|
  double excess = 0;  // the largest |got - truth| / (kNetAbsolute + kNetRelative |truth|)
  void add(const std::vector<float>& got, const std::vector<float>& truth) {
    for (size_t i = 0; i < got.size() && i < truth.size(); ++i) {
      const double d = std::abs(double(got[i]) - double(truth[i]));
      error = std::max(error, d);
      excess = std::max(excess, d / (kNetAbsolute + kNetRelative * std::abs(double(truth[i]))));
    }
  }
};

TEST(MpiSyncBatchNorm, DdpOverSyncBatchNormIsOneProcessOnTheWholeBatch) {
  ASSERT_NE(mpi_session(), nullptr);
  const int rank = this_rank(), world = world_size();
  const NetRun truth = one_process_whole_batch();
  const NetRun got = ddp_run(/*sync=*/true);
  // Which layers were synchronised: DDP attached them while it lived, and detached them at its end.
  size_t sync_layers = 0;
  for (const auto& [name, m] : got.model->named_modules()) {
    if (auto* s = dynamic_cast<SyncBatchNorm2d*>(m)) {
      ++sync_layers;
      EXPECT_EQ(s->stats_group(), nullptr) << name << " is still attached after DDP's end";
    }
  }
  EXPECT_EQ(sync_layers, 2u);

  Worst logits, grads, params, buffers;
  logits.add(got.logits, truth.logits);
  ASSERT_EQ(got.grads.size(), truth.grads.size());
  for (size_t k = 0; k < got.grads.size(); ++k) grads.add(got.grads[k], truth.grads[k]);
  const auto p = got.model->parameters(), q = truth.model->parameters();
  for (size_t k = 0; k < p.size(); ++k) {
    params.add(p[k]->data.to_vector<float>(), q[k]->data.to_vector<float>());
    EXPECT_EQ(differs_from_rank0(p[k]->data), 0u) << "rank " << rank << "'s parameter " << k;
    EXPECT_EQ(differs_from_rank0(p[k]->grad), 0u) << "rank " << rank << "'s gradient " << k;
  }
  // The running statistics are the whole batch's on every rank, without DDP's broadcast of rank
  // 0's (every rank merges the same summaries to the same bits).
  const auto b = got.model->named_buffers(), c = truth.model->named_buffers();
  ASSERT_EQ(b.size(), c.size());
  for (size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(differs_from_rank0(*b[i].second), 0u) << "rank " << rank << "'s " << b[i].first;
    if (b[i].second->dtype() != DType::f32) continue;
    buffers.add(b[i].second->to_vector<float>(), c[i].second->to_vector<float>());
  }
  for (const auto& [what, w] : {std::pair<const char*, const Worst&>{"first logits", logits},
                                {"first gradients", grads},
                                {"parameters", params},
                                {"running statistics", buffers}}) {
    EXPECT_LE(w.excess, 1.0) << what << ": largest difference " << w.error;
  }
  std::printf(
      "rank %d of %d: DDP + SyncBatchNorm against one process, largest differences: first logits "
      "%.3g, first gradients %.3g, parameters after %d steps %.3g, running statistics %.3g "
      "(bound 1e-5 + 1e-5 relative; largest share of it %.3g)\n",
      rank, world, logits.error, grads.error, kSteps, params.error, buffers.error,
      std::max({logits.excess, grads.excess, params.excess, buffers.excess}));

  // The comparison can fail: plain BatchNorm2d per rank (no conversion) is far outside the bound.
  if (world > 1) {
    const NetRun plain = ddp_run(/*sync=*/false);
    Worst plain_logits, plain_params;
    plain_logits.add(plain.logits, truth.logits);
    const auto pp = plain.model->parameters();
    for (size_t k = 0; k < pp.size(); ++k) {
      plain_params.add(pp[k]->data.to_vector<float>(), q[k]->data.to_vector<float>());
    }
    EXPECT_GT(plain_logits.excess, 100.0) << "per-rank BatchNorm2d's logits are not told apart";
    EXPECT_GT(plain_params.excess, 100.0) << "per-rank BatchNorm2d's training is not told apart";
    std::printf("rank %d of %d: plain BatchNorm2d per rank: logits %.3g, parameters %.3g off\n",
                rank, world, plain_logits.error, plain_params.error);
  }
}

// DistributedDataParallel gives the SyncBatchNorm2d layers its group while it lives: this rank as
// participant rank() of world_size(); none in a world of one.
TEST(MpiSyncBatchNorm, DdpAttachesTheRanksGroupAndDetachesIt) {
  ASSERT_NE(mpi_session(), nullptr);
  const int rank = this_rank(), world = world_size();
  auto model = tiny_net();
  convert_sync_batchnorm(model);
  auto* first = dynamic_cast<SyncBatchNorm2d*>(model->children()[1].second.get());
  ASSERT_NE(first, nullptr);
  {
    DistributedDataParallel ddp(model, mpi_host_group(*mpi_session()));
    if (world == 1) {
      EXPECT_EQ(first->stats_group(), nullptr);
    } else {
      ASSERT_NE(first->stats_group(), nullptr);
      EXPECT_EQ(first->stats_group()->size(), static_cast<size_t>(world));
      EXPECT_EQ(first->participant(), static_cast<size_t>(rank));
    }
  }
  EXPECT_EQ(first->stats_group(), nullptr);
}

// The group's checks: a process is its own rank only; abort refuses this rank's later calls with
// its reason until reset (it cannot release the peers, which the collective timeout does).
TEST(MpiSyncBatchNorm, TheRanksGroupRefusesAnotherParticipantAndFollowsAbort) {
  ASSERT_NE(mpi_session(), nullptr);
  const int rank = this_rank(), world = world_size();
  DistributedStatsGroup group(mpi_host_group(*mpi_session()));
  Tensor t = Tensor::from_vector<float>({1.f, float(rank)}, {2});
  EXPECT_THROW_WITH(group.all_reduce_sum(static_cast<size_t>(rank + 1), t, nullptr),
                    "a process takes part as its own rank only");
  group.abort("rank " + std::to_string(rank) + "'s forward failed");
  EXPECT_THROW_WITH(group.all_reduce_sum(static_cast<size_t>(rank), t, nullptr),
                    "aborted: rank " + std::to_string(rank) + "'s forward failed");
  group.reset();
  group.all_reduce_sum(static_cast<size_t>(rank), t, nullptr);
  EXPECT_EQ(values(t), (std::vector<float>{float(world), float(world * (world - 1) / 2)}));
}

}  // namespace
}  // namespace cudp::parallel
