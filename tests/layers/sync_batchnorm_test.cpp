// SyncBatchNorm2d on the CPU, against an independent truth: one BatchNorm2d over the whole batch.
// N replicas, each on its shard of the batch (uneven shards, so a merge that weighted participants
// equally would fail), run on N threads with a HostStatsGroup and must reproduce the whole batch's
// outputs, input gradient, summed dgamma/dbeta and running statistics within the bounds derived in
// sync_batchnorm_testing.h; with one participant (or none, or in evaluation) the layer is
// BatchNorm2d bit for bit. Also: convert_sync_batchnorm keeps the state, and a missing participant
// ends in an error that names it instead of a hang.
#include <gtest/gtest.h>

#include <exception>
#include <thread>

#include "kernels/batchnorm.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/precision.h"
#include "layers/sequential.h"
#include "layers/sync_batchnorm.h"
#include "tests/common/tensor_bytes.h"
#include "tests/layers/layer_testing.h"
#include "tests/layers/sync_batchnorm_testing.h"

namespace cudp {
namespace {

using testing::BnStep;
using testing::random_tensor;
using testing::values;

constexpr int kC = 5;
constexpr float kEps = 1e-5f, kMomentum = 0.1f;

// A batch [n, 3, 2, kC] with a large mean (3 + 10 * channel) against a spread of ~1, so that the
// shifts matter, and its output gradient.
Tensor batch(int64_t n, uint64_t seed) {
  std::vector<float> v = values(random_tensor({n, 3, 2, kC}, seed, -1.7f, 1.7f));
  for (size_t i = 0; i < v.size(); ++i) v[i] += 3.0f + 10.0f * float(i % kC);
  return Tensor::from_vector(v, {n, 3, 2, kC});
}

void append(std::vector<float>& to, const std::vector<float>& v) {
  to.insert(to.end(), v.begin(), v.end());
}

// One training step of the whole batch on `bn` (grads zeroed first).
BnStep whole_batch_step(Module& bn, const Tensor& x, const Tensor& dy) {
  return testing::bn_training_step(bn, x, dy);
}

// The same step on replicas (one thread each), replica i on rows [begin_i, end_i) of dim 0; y and
// dx concatenated, dgamma and dbeta summed in double, running statistics replica 0's (and every
// replica's must be identical to them, bit for bit).
BnStep replicated_step(const std::vector<std::shared_ptr<Module>>& replicas,
                       const std::vector<int64_t>& bounds, const Tensor& x, const Tensor& dy) {
  const size_t n = replicas.size();
  std::vector<BnStep> out(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        out[i] = whole_batch_step(*replicas[i], x.slice(bounds[i], bounds[i + 1]),
                                  dy.slice(bounds[i], bounds[i + 1]));
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  BnStep s;
  std::vector<double> dgamma(kC, 0.0), dbeta(kC, 0.0);
  for (size_t i = 0; i < n; ++i) {
    append(s.y, out[i].y);
    append(s.dx, out[i].dx);
    for (int c = 0; c < kC; ++c) dgamma[c] += out[i].dgamma[c], dbeta[c] += out[i].dbeta[c];
    EXPECT_EQ(out[i].running_mean, out[0].running_mean) << "replica " << i;
    EXPECT_EQ(out[i].running_var, out[0].running_var) << "replica " << i;
  }
  s.dgamma.assign(dgamma.begin(), dgamma.end());
  s.dbeta.assign(dbeta.begin(), dbeta.end());
  s.running_mean = out[0].running_mean;
  s.running_var = out[0].running_var;
  return s;
}

std::vector<std::shared_ptr<Module>> sync_replicas(BatchNorm2d& bn, size_t n,
                                                   std::shared_ptr<StatsGroup> group) {
  std::vector<std::shared_ptr<Module>> replicas;
  for (size_t i = 0; i < n; ++i) {
    auto s = std::make_shared<SyncBatchNorm2d>(init::skip_init, kC, kEps, kMomentum);
    s->load_state_dict(bn.state_dict());
    s->set_stats_group(group, i);
    replicas.push_back(s);
  }
  return replicas;
}

void expect_bitwise(const BnStep& a, const BnStep& b) {
  EXPECT_EQ(a.y, b.y);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dgamma, b.dgamma);
  EXPECT_EQ(a.dbeta, b.dbeta);
  EXPECT_EQ(a.running_mean, b.running_mean);
  EXPECT_EQ(a.running_var, b.running_var);
}

TEST(SyncBatchNorm2dTest, ShardsOnThreadsEqualBatchNormOverTheWholeBatch) {
  BatchNorm2d bn(kC, kEps, kMomentum);
  testing::randomize_parameters(bn, 7, 0.5f, 1.5f);
  const std::vector<int64_t> bounds = {0, 1, 3, 6};  // shards of 1, 2 and 3 images
  auto replicas = sync_replicas(bn, 3, std::make_shared<HostStatsGroup>(3));
  for (uint64_t step = 0; step < 2; ++step) {  // the running statistics' second update too
    const Tensor x = batch(6, 11 + step), dy = random_tensor(x.shape(), 21 + step);
    const std::vector<float> gamma = values(bn.weight().data);
    const BnStep truth = whole_batch_step(bn, x, dy);
    const BnStep got = replicated_step(replicas, bounds, x, dy);
    const auto tol =
        testing::sync_bn_tolerance(values(x), values(dy), gamma, kC, kEps, kMomentum, 3, truth);
    testing::expect_within(got.y, truth.y, tol.y, "y");
    testing::expect_within(got.dx, truth.dx, tol.dx, "dx");
    testing::expect_within(got.dgamma, truth.dgamma, tol.dgamma, "dgamma");
    testing::expect_within(got.dbeta, truth.dbeta, tol.dbeta, "dbeta");
    testing::expect_within(got.running_mean, truth.running_mean,
                           tol.running_mean + (step > 0 ? tol.running_mean : 0), "running_mean");
    testing::expect_within(got.running_var, truth.running_var,
                           tol.running_var + (step > 0 ? tol.running_var : 0), "running_var");
  }
  for (auto& r : replicas) {
    EXPECT_EQ(static_cast<SyncBatchNorm2d&>(*r).num_batches_tracked(), 2);
  }
}

// bf16 activations: both sides compute from the same bf16 values and round once to bf16 on store,
// so y and dx differ by the f32 bounds plus at most one bf16 unit in the last place of the largest
// value (a rounding boundary between them); the per-channel results are f32 and keep their bounds.
TEST(SyncBatchNorm2dTest, Bf16ShardsEqualTheWholeBatch) {
  BatchNorm2d bn(kC, kEps, kMomentum);
  testing::randomize_parameters(bn, 13, 0.5f, 1.5f);
  auto replicas = sync_replicas(bn, 2, std::make_shared<HostStatsGroup>(2));
  const Tensor x = convert(batch(5, 90), DType::bf16);
  const Tensor dy = convert(random_tensor(x.shape(), 91), DType::bf16);
  const std::vector<float> gamma = values(bn.weight().data);
  const BnStep truth = whole_batch_step(bn, x, dy);
  const BnStep got = replicated_step(replicas, {0, 3, 5}, x, dy);
  const auto tol =
      testing::sync_bn_tolerance(values(x), values(dy), gamma, kC, kEps, kMomentum, 2, truth);
  const auto bf16_ulp = [](const std::vector<float>& v) {
    return std::ldexp(1.0, std::ilogb(testing::max_abs_of(v)) - 7);
  };
  testing::expect_within(got.y, truth.y, tol.y + bf16_ulp(truth.y), "y");
  testing::expect_within(got.dx, truth.dx, tol.dx + bf16_ulp(truth.dx), "dx");
  testing::expect_within(got.dgamma, truth.dgamma, tol.dgamma, "dgamma");
  testing::expect_within(got.dbeta, truth.dbeta, tol.dbeta, "dbeta");
  testing::expect_within(got.running_mean, truth.running_mean, tol.running_mean, "running_mean");
  testing::expect_within(got.running_var, truth.running_var, tol.running_var, "running_var");
}

// The fused ReLU's mask on the synchronised path: Sequential{SyncBN, ReLU} on shards against
// Sequential{BN, ReLU} on the whole batch.
TEST(SyncBatchNorm2dTest, FusedReluOnShardsEqualsTheWholeBatch) {
  auto bn = std::make_shared<BatchNorm2d>(kC, kEps, kMomentum);
  testing::randomize_parameters(*bn, 8, 0.5f, 1.5f);
  Sequential whole({bn, std::make_shared<ReLU>()});
  auto group = std::make_shared<HostStatsGroup>(2);
  std::vector<std::shared_ptr<Module>> replicas;
  for (const auto& s : sync_replicas(*bn, 2, group)) {
    replicas.push_back(std::make_shared<Sequential>(
        std::vector<std::shared_ptr<Module>>{s, std::make_shared<ReLU>()}));
  }
  const Tensor x = batch(5, 31), dy = random_tensor(x.shape(), 32);
  const std::vector<float> gamma = values(bn->weight().data);
  const BnStep truth = whole_batch_step(whole, x, dy);
  EXPECT_TRUE(whole.children()[0].second->relu_fused());
  const BnStep got = replicated_step(replicas, {0, 2, 5}, x, dy);
  // g, the gradient reaching the normalisation, is dy masked by the output.
  std::vector<float> g = values(dy);
  for (size_t i = 0; i < g.size(); ++i) g[i] = truth.y[i] > 0 ? g[i] : 0.f;
  const auto tol = testing::sync_bn_tolerance(values(x), g, gamma, kC, kEps, kMomentum, 2, truth);
  testing::expect_within(got.y, truth.y, tol.y, "y");
  testing::expect_within(got.dx, truth.dx, tol.dx, "dx");
  testing::expect_within(got.dgamma, truth.dgamma, tol.dgamma, "dgamma");
  testing::expect_within(got.dbeta, truth.dbeta, tol.dbeta, "dbeta");
}

TEST(SyncBatchNorm2dTest, OneParticipantIsBatchNormBitForBit) {
  BatchNorm2d bn(kC, kEps, kMomentum);
  testing::randomize_parameters(bn, 9, 0.5f, 1.5f);
  auto one = sync_replicas(bn, 1, std::make_shared<HostStatsGroup>(1));
  auto none = sync_replicas(bn, 1, nullptr);
  for (uint64_t step = 0; step < 2; ++step) {
    const Tensor x = batch(4, 41 + step), dy = random_tensor(x.shape(), 51 + step);
    const BnStep truth = whole_batch_step(bn, x, dy);
    expect_bitwise(whole_batch_step(*one[0], x, dy), truth);
    expect_bitwise(whole_batch_step(*none[0], x, dy), truth);
  }
}

TEST(SyncBatchNorm2dTest, EvaluationIsBatchNormAndNeedsNoPeers) {
  BatchNorm2d bn(kC, kEps, kMomentum);
  testing::randomize_parameters(bn, 10, 0.5f, 1.5f);
  bn.forward(batch(4, 60));  // running statistics away from their initial values
  // A group of two whose second participant never comes: evaluation must not call it.
  auto replicas = sync_replicas(bn, 1, std::make_shared<HostStatsGroup>(2));
  bn.eval();
  replicas[0]->eval();
  const Tensor x = batch(3, 61), dy = random_tensor(x.shape(), 62);
  expect_bitwise(whole_batch_step(*replicas[0], x, dy), whole_batch_step(bn, x, dy));
}

TEST(SyncBatchNorm2dTest, AMissingParticipantIsAnErrorNamingIt) {
  BatchNorm2d bn(kC, kEps, kMomentum);
  auto replicas =
      sync_replicas(bn, 1, std::make_shared<HostStatsGroup>(3, std::chrono::milliseconds(50)));
  EXPECT_THROW_WITH(replicas[0]->forward(batch(2, 70)), "participant(s) 1, 2 of 3");
  // The group is then unusable, and says so.
  EXPECT_THROW_WITH(replicas[0]->forward(batch(2, 70)), "make a new group");
}

// The host group sums in participant order and gives every participant the same bits; an error
// in the sum (sizes that differ) reaches every participant, naming the culprit.
TEST(SyncBatchNorm2dTest, HostGroupSumsInOrderAndReportsMismatchesToAll) {
  HostStatsGroup group(3);
  std::vector<Tensor> data = {Tensor::from_vector<float>({1e8f, 1.f}, {2}),
                              Tensor::from_vector<float>({1.f, 2.f}, {2}),
                              Tensor::from_vector<float>({-1e8f, 3.f}, {2})};
  std::vector<std::thread> threads;
  for (size_t p = 0; p < 3; ++p) {
    threads.emplace_back([&, p] { group.all_reduce_sum(p, data[p], nullptr); });
  }
  for (auto& t : threads) t.join();
  // ((1e8 + 1) + -1e8) in f32 is 0: the order (0, 1, 2), not a compensated or reordered sum.
  for (const Tensor& d : data) EXPECT_EQ(values(d), (std::vector<float>{0.f, 6.f}));

  HostStatsGroup mismatched(2);
  std::vector<Tensor> bad = {Tensor::zeros({3}), Tensor::zeros({4})};
  std::vector<std::string> errors(2);
  threads.clear();
  for (size_t p = 0; p < 2; ++p) {
    threads.emplace_back([&, p] {
      try {
        mismatched.all_reduce_sum(p, bad[p], nullptr);
      } catch (const std::exception& e) {
        errors[p] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("participant 1 gave 4 elements but participant 0 gave 3"), std::string::npos)
        << e;
  }
}

// abort() (the engine's, when a replica fails before its call) releases the waiting participants
// with its reason at once, refuses calls until reset(), and the first reason stays.
TEST(SyncBatchNorm2dTest, AbortReleasesTheWaitingAndResetRestores) {
  HostStatsGroup group(2);  // the default timeout: ten minutes, so a hang would show
  Tensor a = Tensor::from_vector<float>({1.f}, {1}), b = Tensor::from_vector<float>({2.f}, {1});
  std::string error;
  std::thread waiting([&] {
    try {
      group.all_reduce_sum(0, a, nullptr);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  group.abort("replica 1's forward failed: boom");
  group.abort("a later reason");
  waiting.join();
  // (Waiting: "participant 0 stopped waiting: ..."; arriving after the abort: "aborted: ...".)
  EXPECT_NE(error.find("replica 1's forward failed: boom"), std::string::npos) << error;
  EXPECT_THROW_WITH(group.all_reduce_sum(1, b, nullptr), "aborted: replica 1's forward failed");
  group.reset();
  std::thread first([&] { group.all_reduce_sum(0, a, nullptr); });
  group.all_reduce_sum(1, b, nullptr);
  first.join();
  EXPECT_EQ(values(a), std::vector<float>{3.f});
  EXPECT_EQ(values(b), std::vector<float>{3.f});
}

TEST(SyncBatchNorm2dTest, ConvertReplacesEveryBatchNormKeepingItsState) {
  auto bn = std::make_shared<BatchNorm2d>(kC, 1e-3f, 0.3f);
  testing::randomize_parameters(*bn, 12);
  bn->forward(batch(2, 80));  // num_batches_tracked 1, running statistics moved
  auto inner = std::make_shared<Sequential>(
      std::vector<std::shared_ptr<Module>>{std::make_shared<ReLU>(), bn});
  auto model = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{inner});
  model->eval();
  const auto before = model->state_dict();
  EXPECT_EQ(convert_sync_batchnorm(model), model);
  auto* sync = dynamic_cast<SyncBatchNorm2d*>(inner->children()[1].second.get());
  ASSERT_NE(sync, nullptr);
  EXPECT_EQ(sync->type_name(), "SyncBatchNorm");
  EXPECT_EQ(sync->eps(), 1e-3f);
  EXPECT_EQ(sync->momentum(), 0.3f);
  EXPECT_EQ(sync->num_batches_tracked(), 1);
  EXPECT_FALSE(sync->is_training());
  EXPECT_EQ(testing::bytes_of(model->state_dict()), testing::bytes_of(before));
  // A BatchNorm2d itself becomes a new layer; other modules are left as they are.
  auto lone = std::make_shared<BatchNorm2d>(kC);
  EXPECT_NE(dynamic_cast<SyncBatchNorm2d*>(convert_sync_batchnorm(lone).get()), nullptr);
  EXPECT_EQ(attach_stats_group(*model, std::make_shared<HostStatsGroup>(2), 1), 1u);
  EXPECT_EQ(sync->participant(), 1u);
  EXPECT_THROW_WITH(sync->set_stats_group(std::make_shared<HostStatsGroup>(2), 2),
                    "participant 2 is outside its group of 2");
}

}  // namespace
}  // namespace cudp
