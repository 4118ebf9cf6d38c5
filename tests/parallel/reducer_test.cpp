// Host tests of the Reducer (engine/parallel/reducer.h) on CPU "ranks": two copies of a small model
// with flat parameters, run one after the other on this thread, and a ReduceGroup that sums on the
// host in rank order and logs every call. They check the bucket plan (reverse parameter order,
// tiling the flat buffer), that a bucket is summed as soon as every rank has completed it (during
// the backward, not after), only after each rank's mark, strictly in bucket order, that unused
// modules and ranks without work are handled at finish/prepare, and that the sums are bit for bit
// the element-wise sums of the ranks' own gradients (the truth computed here without any reducer).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/tensor_bytes.h"
#include "engine/parallel/reducer.h"
#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/optim.h"
#include "layers/sequential.h"

namespace cudp {
namespace {

using parallel::ReduceGroup;
using parallel::Reducer;
using parallel::ReducerOptions;
using testing::random_vector;

// Sums views in rank order (r0 + r1 + ...) on the host, and logs "begin", "ready r b", "reduce b",
// "finish". `backward_running` is set by the test while a backward runs, so the log shows which
// reductions started during one.
class HostGroup final : public ReduceGroup {
 public:
  explicit HostGroup(size_t ranks) : ranks_(ranks) {}
  size_t local_ranks() const override { return ranks_; }
  void begin(size_t buckets) override {
    ready_.assign(buckets, std::vector<bool>(ranks_, false));
    log.push_back("begin");
  }
  void mark_ready(size_t rank, size_t bucket) override {
    EXPECT_FALSE(ready_[bucket][rank])
        << "rank " << rank << " marked bucket " << bucket << " twice";
    ready_[bucket][rank] = true;
    log.push_back("ready " + std::to_string(rank) + " " + std::to_string(bucket));
  }
  void all_reduce(size_t bucket, const TensorList& views) override {
    for (size_t r = 0; r < ranks_; ++r) {
      EXPECT_TRUE(ready_[bucket][r])
          << "bucket " << bucket << " reduced before rank " << r << " marked it";
    }
    std::vector<float> sum = views[0].to_vector<float>();
    for (size_t r = 1; r < views.size(); ++r) {
      const std::vector<float> v = views[r].to_vector<float>();
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += v[i];
    }
    for (Tensor view : views) view.copy_from(Tensor::from_vector(sum, view.shape()));
    log.push_back("reduce " + std::to_string(bucket));
    if (backward_running) ++during_backward;
  }
  void finish() override { log.push_back("finish"); }

  std::vector<std::string> log;
  bool backward_running = false;
  int during_backward = 0;

 private:
  size_t ranks_;
  std::vector<std::vector<bool>> ready_;
};

// Linear(8, 16) - ReLU - Linear(16, 12) - ReLU - Linear(12, 4): six parameters of 128, 16, 192,
// 12, 48 and 4 floats; in the flat buffer each starts on a 64-float boundary.
std::shared_ptr<Module> small_mlp() {
  auto net = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Linear>(8, 16, true, 1), std::make_shared<ReLU>(),
      std::make_shared<Linear>(16, 12, true, 2), std::make_shared<ReLU>(),
      std::make_shared<Linear>(12, 4, true, 3)});
  return net;
}

struct Ranks {
  std::vector<std::shared_ptr<Module>> models;
  std::vector<std::vector<Parameter*>> params;
  TensorList flat;
};

Ranks make_ranks(size_t n) {
  Ranks ranks;
  auto first = small_mlp();
  for (size_t r = 0; r < n; ++r) {
    auto model = r == 0 ? first : first->clone(Device::cpu());
    ranks.flat.push_back(model->flatten_parameters().second);
    ranks.params.push_back(model->parameters());
    ranks.models.push_back(std::move(model));
  }
  return ranks;
}

Tensor input(size_t rank) {
  return Tensor::from_vector(random_vector(5 * 8, 100 + rank), {5, 8});
}
Tensor grad_output(size_t rank) {
  return Tensor::from_vector(random_vector(5 * 4, 200 + rank), {5, 4});
}

// The tests of the update beside the backward (Optimizer::set_update_overlap) compare
// optimizers' results: this says what a failure was about.
using testing::bytes_of;

// Each rank's own flat gradient after one forward and backward, without any reducer.
std::vector<std::vector<float>> own_gradients(size_t n) {
  Ranks ranks = make_ranks(n);
  std::vector<std::vector<float>> grads;
  for (size_t r = 0; r < n; ++r) {
    ranks.models[r]->forward(input(r));
    ranks.models[r]->backward(grad_output(r));
    grads.push_back(ranks.flat[r].to_vector<float>());
  }
  return grads;
}

// One step through the reducer: prepare, each active rank's forward and backward in turn, finish.
void reduced_step(Ranks& ranks, Reducer& reducer, HostGroup& group, size_t active) {
  reducer.prepare(active);
  for (size_t r = 0; r < active; ++r) {
    ranks.models[r]->forward(input(r));
    group.backward_running = true;
    ranks.models[r]->backward(grad_output(r));
    group.backward_running = false;
  }
  reducer.finish();
}

TEST(Reducer, BucketsTileTheFlatBufferInReverseParameterOrder) {
  Ranks ranks = make_ranks(2);
  HostGroup group(2);
  // 1 KiB = 256 floats: each parameter (padded to 64-float multiples) is 192, 64, 192, 64, 64, 64.
  Reducer reducer(ranks.params, ranks.flat, group, {.bucket_cap_bytes = 1024, .overlap = true});
  const auto& buckets = reducer.buckets();
  // From the last parameter: {5, 4, 3, 2} reaches 64 + 64 + 64 + 192 = 384 floats >= 256, then
  // {1, 0} = 64 + 192 floats, the rest.
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0].params, (std::vector<size_t>{5, 4, 3, 2}));
  EXPECT_EQ(buckets[1].params, (std::vector<size_t>{1, 0}));
  EXPECT_EQ(buckets[1].begin, 0);
  EXPECT_EQ(buckets[1].end, buckets[0].begin);
  EXPECT_EQ(buckets[0].end, ranks.flat[0].numel());
  // A cap below every parameter: one bucket each, still in reverse order.
  Reducer fine(ranks.params, ranks.flat, group, {.bucket_cap_bytes = 4, .overlap = true});
  ASSERT_EQ(fine.buckets().size(), 6u);
  for (size_t b = 0; b < 6; ++b) EXPECT_EQ(fine.buckets()[b].params, (std::vector<size_t>{5 - b}));
  // The default: one bucket for a model far below 25 MiB.
  Reducer whole(ranks.params, ranks.flat, group);
  EXPECT_EQ(whole.buckets().size(), 1u);
  EXPECT_EQ(whole.options().bucket_cap_bytes, 25 << 20);
}

TEST(Reducer, SumsEveryBucketDuringTheBackwardBitForBit) {
  const auto own = own_gradients(2);
  Ranks ranks = make_ranks(2);
  HostGroup group(2);
  Reducer reducer(ranks.params, ranks.flat, group, {.bucket_cap_bytes = 4, .overlap = true});
  for (size_t r = 0; r < 2; ++r) reducer.attach(r, *ranks.models[r]);
  reduced_step(ranks, reducer, group, 2);
  // Every bucket was complete on both ranks during rank 1's backward, so all six were reduced
  // then. A Linear's hook completes its weight (bucket 2i + 1) before its bias (bucket 2i), so
  // bucket 2i + 1 waits for 2i: buckets go out strictly in order.
  EXPECT_EQ(group.during_backward, 6);
  EXPECT_EQ(reducer.issued_before_finish(), 6u);
  const std::vector<std::string> expected = {
      "begin",     "ready 0 1", "ready 0 0", "ready 0 3", "ready 0 2", "ready 0 5", "ready 0 4",
      "ready 1 1", "ready 1 0", "reduce 0",  "reduce 1",  "ready 1 3", "ready 1 2", "reduce 2",
      "reduce 3",  "ready 1 5", "ready 1 4", "reduce 4",  "reduce 5",  "finish"};
  EXPECT_EQ(group.log, expected);
  // The truth: each element is rank 0's gradient plus rank 1's, one float addition.
  for (size_t r = 0; r < 2; ++r) {
    const std::vector<float> got = ranks.flat[r].to_vector<float>();
    ASSERT_EQ(got.size(), own[0].size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], own[0][i] + own[1][i]) << "rank " << r << " element " << i;
    }
  }
}

// A module's backward signals one reducer: a second one attached to the same model is refused
// (the first one's hooks would be replaced and its buckets never completed), and the refusal
// leaves the first reducer working, its sums still the truth; once it is destroyed, another may
// attach.
TEST(Reducer, ASecondReducerOnTheSameModelIsRefusedAndTheFirstStillWorks) {
  const auto own = own_gradients(2);
  Ranks ranks = make_ranks(2);
  HostGroup group(2), other_group(2);
  auto first = std::make_unique<Reducer>(ranks.params, ranks.flat, group,
                                         ReducerOptions{.bucket_cap_bytes = 4, .overlap = true});
  for (size_t r = 0; r < 2; ++r) first->attach(r, *ranks.models[r]);
  Reducer second(ranks.params, ranks.flat, other_group, {.bucket_cap_bytes = 4, .overlap = true});
  try {
    second.attach(1, *ranks.models[1]);
    FAIL() << "a second reducer attached to rank 1's model";
  } catch (const ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("already signals its backward to a gradient reducer"), std::string::npos)
        << what;
    EXPECT_NE(what.find("wrap the model once"), std::string::npos) << what;
  }
  reduced_step(ranks, *first, group, 2);
  EXPECT_EQ(first->issued_before_finish(), 6u) << "the refused attach took the first's hooks";
  EXPECT_TRUE(other_group.log.empty());
  for (size_t r = 0; r < 2; ++r) {
    const std::vector<float> got = ranks.flat[r].to_vector<float>();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], own[0][i] + own[1][i]) << "rank " << r << " element " << i;
    }
  }
  first.reset();  // removes its hooks
  EXPECT_NO_THROW(second.attach(0, *ranks.models[0]));
}

TEST(Reducer, OverlapOffIssuesTheSameCallsAfterTheBackward) {
  Ranks on = make_ranks(2), off = make_ranks(2);
  HostGroup group_on(2), group_off(2);
  Reducer reducer_on(on.params, on.flat, group_on, {.bucket_cap_bytes = 1024, .overlap = true});
  Reducer reducer_off(off.params, off.flat, group_off,
                      {.bucket_cap_bytes = 1024, .overlap = false});
  for (size_t r = 0; r < 2; ++r) {
    reducer_on.attach(r, *on.models[r]);
    reducer_off.attach(r, *off.models[r]);
  }
  reduced_step(on, reducer_on, group_on, 2);
  reduced_step(off, reducer_off, group_off, 2);
  EXPECT_EQ(group_on.during_backward, 2);
  EXPECT_EQ(group_off.during_backward, 0);
  EXPECT_EQ(reducer_off.issued_before_finish(), 0u);
  const std::vector<std::string> off_expected = {"begin",     "ready 0 0", "ready 1 0", "ready 0 1",
                                                 "ready 1 1", "reduce 0",  "reduce 1",  "finish"};
  EXPECT_EQ(group_off.log, off_expected);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(on.flat[r].to_vector<float>(), off.flat[r].to_vector<float>()) << "rank " << r;
  }
}

TEST(Reducer, ARankWithoutWorkIsReadyAtOnceAndAModuleWithoutBackwardAtFinish) {
  Ranks ranks = make_ranks(2);
  HostGroup group(2);
  Reducer reducer(ranks.params, ranks.flat, group, {.bucket_cap_bytes = 4, .overlap = true});
  for (size_t r = 0; r < 2; ++r) reducer.attach(r, *ranks.models[r]);
  // Rank 1 gets no chunk (a batch of 1 on 2 GPUs): its zero gradients are ready at prepare, and
  // rank 0's backward issues every bucket.
  reduced_step(ranks, reducer, group, 1);
  EXPECT_EQ(group.during_backward, 6);

  // The last Linear's backward is not run (as for a module whose output went unused): its two
  // buckets (0 and 1) are marked and issued by finish, and the ones after them wait, in order.
  HostGroup group2(2);
  Ranks partial = make_ranks(2);
  // The children's backward runs by hand below: each ReLU module must have run its own forward,
  // not inside the Linear before it (Module::can_fuse_relu).
  for (auto& model : partial.models) model->set_fusion(false);
  Reducer reducer2(partial.params, partial.flat, group2, {.bucket_cap_bytes = 4, .overlap = true});
  for (size_t r = 0; r < 2; ++r) reducer2.attach(r, *partial.models[r]);
  reducer2.prepare(2);
  for (size_t r = 0; r < 2; ++r) {
    auto& model = dynamic_cast<Sequential&>(*partial.models[r]);
    model.forward(input(r));
    // Backward from the second Linear's output, by hand, skipping the last Linear.
    Tensor g = Tensor::from_vector(random_vector(5 * 12, 300 + r), {5, 12});
    for (size_t m = 4; m-- > 0;) g = model.children()[m].second->backward(g);
  }
  EXPECT_EQ(reducer2.issued_before_finish(), 0u);  // bucket 0 never completed during backward
  reducer2.finish();
  const std::vector<std::string> expected = {
      "begin",     "ready 0 3", "ready 0 2", "ready 0 5", "ready 0 4", "ready 1 3", "ready 1 2",
      "ready 1 5", "ready 1 4", "ready 0 0", "ready 1 0", "ready 0 1", "ready 1 1", "reduce 0",
      "reduce 1",  "reduce 2",  "reduce 3",  "reduce 4",  "reduce 5",  "finish"};
  EXPECT_EQ(group2.log, expected);
}

// Deferred zeroing (layers/module.h): every gradient of both ranks holds a stale NaN and counts
// as zero. Rank 1 has no chunk and rank 0 skips the last Linear's backward, so the reducer sums
// gradients no backward wrote: it must zero them first, so that the sums are rank 0's own
// gradients where it ran and zero where nobody did.
TEST(Reducer, GradientsADeferredZeroGradLeftUnwrittenAreSummedAsZero) {
  Ranks ranks = make_ranks(2);
  for (auto& model : ranks.models) model->set_fusion(false);  // backward by hand below
  HostGroup group(2);
  Reducer reducer(ranks.params, ranks.flat, group, {.bucket_cap_bytes = 4, .overlap = true});
  for (size_t r = 0; r < 2; ++r) reducer.attach(r, *ranks.models[r]);
  for (size_t r = 0; r < 2; ++r) {
    // Every Linear parameter writes its gradient whole; the first bias is made one that does not
    // (zeroed, not flagged, as zero_grad leaves such a one), so that both kinds are summed.
    ranks.params[r][1]->backward_writes_grad = false;
    for (Parameter* p : ranks.params[r]) {
      p->grad_zero_pending = p->backward_writes_grad;
      p->grad.fill_(p->grad_zero_pending ? std::numeric_limits<float>::quiet_NaN() : 0.f);
    }
  }
  reducer.prepare(1);
  auto& model = dynamic_cast<Sequential&>(*ranks.models[0]);
  model.forward(input(0));
  Tensor g = Tensor::from_vector(random_vector(5 * 12, 300), {5, 12});
  for (size_t m = 4; m-- > 0;) g = model.children()[m].second->backward(g);
  reducer.finish();
  // The truth: the same backward on a fresh copy whose gradients start at zero.
  Ranks fresh = make_ranks(1);
  fresh.models[0]->set_fusion(false);
  auto& truth = dynamic_cast<Sequential&>(*fresh.models[0]);
  truth.forward(input(0));
  Tensor t = Tensor::from_vector(random_vector(5 * 12, 300), {5, 12});
  for (size_t m = 4; m-- > 0;) t = truth.children()[m].second->backward(t);
  for (size_t r = 0; r < 2; ++r) {
    for (size_t k = 0; k < ranks.params[r].size(); ++k) {
      EXPECT_FALSE(ranks.params[r][k]->grad_zero_pending) << "rank " << r << " parameter " << k;
      EXPECT_EQ(ranks.params[r][k]->grad.to_vector<float>(),
                fresh.params[0][k]->grad.to_vector<float>())
          << "rank " << r << " parameter " << k;
    }
  }
}

TEST(Reducer, AModuleWhoseBackwardRunsTwiceIsAnErrorThatSaysWhatToDo) {
  Ranks ranks = make_ranks(1);
  HostGroup group(1);
  Reducer reducer(ranks.params, ranks.flat, group, {.bucket_cap_bytes = 4, .overlap = true});
  reducer.attach(0, *ranks.models[0]);
  reducer.prepare(1);
  auto& last = *dynamic_cast<Sequential&>(*ranks.models[0]).children()[4].second;
  const Tensor x = Tensor::from_vector(random_vector(5 * 12, 7), {5, 12});
  last.forward(x);
  last.backward(grad_output(0));
  try {
    last.forward(x);  // a module used twice in one step (a backward frees what its forward saved)
    last.backward(grad_output(0));
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.message()).find("completed twice in one backward"), std::string::npos)
        << e.message();
    EXPECT_NE(std::string(e.message()).find("overlap off"), std::string::npos) << e.message();
  }
  reducer.abandon();
}

TEST(Reducer, RefusesGradientsThatAreNotFlat) {
  auto a = small_mlp(), b = small_mlp();
  HostGroup group(2);
  const Tensor flat_a = a->flatten_parameters().second;
  // b is not flattened: its gradients are separate tensors.
  const Tensor not_flat = Tensor::zeros({flat_a.numel()});
  try {
    Reducer reducer({a->parameters(), b->parameters()}, {flat_a, not_flat}, group);
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.message()).find("call flatten_parameters()"), std::string::npos)
        << e.message();
  }
}

// ---- the update beside the backward (Optimizer::set_update_overlap) -----------------------------

// The buckets of the last completed step, in bucket order, each with its rank's buffer and (on the
// CPU, where everything has run) no event; none before the first finish, between prepare and
// finish, after abandon, or for a rank that does not exist.
TEST(Reducer, GradientSegmentsAreTheLastStepsBucketsInOrder) {
  Ranks ranks = make_ranks(2);
  HostGroup group(2);
  Reducer reducer(ranks.params, ranks.flat, group, {.bucket_cap_bytes = 1024, .overlap = true});
  for (size_t r = 0; r < 2; ++r) reducer.attach(r, *ranks.models[r]);
  EXPECT_TRUE(reducer.gradient_segments(0).empty());
  reduced_step(ranks, reducer, group, 2);
  for (size_t r = 0; r < 2; ++r) {
    const std::vector<GradientSegment> segments = reducer.gradient_segments(r);
    ASSERT_EQ(segments.size(), reducer.buckets().size());
    for (size_t b = 0; b < segments.size(); ++b) {
      EXPECT_EQ(segments[b].buffer, ranks.flat[r].data<float>()) << "rank " << r;
      EXPECT_EQ(segments[b].begin, reducer.buckets()[b].begin);
      EXPECT_EQ(segments[b].end, reducer.buckets()[b].end);
      EXPECT_EQ(segments[b].ready, nullptr);
    }
  }
  EXPECT_TRUE(reducer.gradient_segments(2).empty());
  reducer.prepare(2);
  EXPECT_TRUE(reducer.gradient_segments(0).empty());
  reducer.abandon();
  EXPECT_TRUE(reducer.gradient_segments(0).empty());
}

// sum = false: every bucket is marked as the backward completes it, none is summed (each rank keeps
// its own gradients), and the buckets are still given to an optimizer that updates beside the
// backward: bench_train's step without communication.
TEST(Reducer, WithoutSumsTheBucketsAreMarkedButNotSummed) {
  const auto own = own_gradients(2);
  Ranks ranks = make_ranks(2);
  HostGroup group(2);
  Reducer reducer(ranks.params, ranks.flat, group,
                  {.bucket_cap_bytes = 1024, .overlap = true, .sum = false});
  for (size_t r = 0; r < 2; ++r) reducer.attach(r, *ranks.models[r]);
  reduced_step(ranks, reducer, group, 2);
  EXPECT_EQ(group.during_backward, 0);
  for (const std::string& entry : group.log) {
    EXPECT_EQ(entry.rfind("reduce", 0), std::string::npos) << entry;
  }
  EXPECT_EQ(std::count(group.log.begin(), group.log.end(), "ready 1 0"), 1);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(ranks.flat[r].to_vector<float>(), own[r]) << "rank " << r;
    EXPECT_EQ(reducer.gradient_segments(r).size(), reducer.buckets().size());
  }
}

// Two ranks' optimizers updating bucket by bucket from the reducer's segments (one bucket per
// parameter, so every piece is its own update) against the same steps with one update each: the
// parameters, the state and the counts bit for bit, step after step (the first, which makes the
// state, takes one update). AdamW's per-parameter step
// counts and SGD's first momentum step advance piece by piece.
template <typename Optim, typename Options>
void expect_bucketwise_update_is_one_update(const Options& options) {
  Ranks pieces = make_ranks(2), whole = make_ranks(2);
  HostGroup pieces_group(2), whole_group(2);
  Reducer pieces_reducer(pieces.params, pieces.flat, pieces_group,
                         {.bucket_cap_bytes = 4, .overlap = true});
  Reducer whole_reducer(whole.params, whole.flat, whole_group,
                        {.bucket_cap_bytes = 4, .overlap = true});
  std::vector<std::unique_ptr<Optim>> pieces_opt, whole_opt;
  for (size_t r = 0; r < 2; ++r) {
    pieces_reducer.attach(r, *pieces.models[r]);
    whole_reducer.attach(r, *whole.models[r]);
    pieces_opt.push_back(std::make_unique<Optim>(pieces.params[r], options));
    whole_opt.push_back(std::make_unique<Optim>(whole.params[r], options));
    pieces_opt[r]->set_update_overlap(
        [&pieces_reducer, r] { return pieces_reducer.gradient_segments(r); });
  }
  ASSERT_EQ(pieces_reducer.buckets().size(), 6u);
  for (int t = 0; t < 4; ++t) {
    for (size_t r = 0; r < 2; ++r) {
      pieces_opt[r]->zero_grad();
      whole_opt[r]->zero_grad();
    }
    reduced_step(pieces, pieces_reducer, pieces_group, 2);
    reduced_step(whole, whole_reducer, whole_group, 2);
    for (size_t r = 0; r < 2; ++r) {
      pieces_opt[r]->step();
      whole_opt[r]->step();
      // The first step makes the state, on the current stream after the backward: one update.
      EXPECT_EQ(pieces_opt[r]->last_step_overlapped(), t > 0) << "step " << t;
      EXPECT_TRUE(pieces_opt[r]->last_step_was_flat());
      EXPECT_FALSE(whole_opt[r]->last_step_overlapped());
      EXPECT_EQ(bytes_of(pieces.models[r]->state_dict()), bytes_of(whole.models[r]->state_dict()))
          << "rank " << r << ", step " << t;
      EXPECT_EQ(bytes_of(pieces_opt[r]->state_dict()), bytes_of(whole_opt[r]->state_dict()))
          << "rank " << r << ", step " << t;
      EXPECT_EQ(pieces_opt[r]->steps(), t + 1);
    }
  }
  EXPECT_EQ(bytes_of(pieces.models[0]->state_dict()), bytes_of(pieces.models[1]->state_dict()));
}

TEST(UpdateOverlap, SgdBucketByBucketIsOneUpdateBitForBit) {
  expect_bucketwise_update_is_one_update<SGD>(
      SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
}

TEST(UpdateOverlap, AdamWBucketByBucketIsOneUpdateBitForBit) {
  expect_bucketwise_update_is_one_update<AdamW>(AdamWOptions{.lr = 1e-2});
}

// One rank with pieces given by hand: the step that makes the state, a gated step, a gradient left
// pending by a deferred zero_grad, and a step with no pieces take the one update (and say so), with
// the same results as an optimizer without the overlap; clip_grad_norm refuses the parameters while
// the overlap is on and clips them once it is off; pieces that do not tile the buffer are refused
// by name.
TEST(UpdateOverlap, WhatCannotOverlapTakesOneUpdateAndClippingIsRefused) {
  auto model = small_mlp(), twin = small_mlp();
  const Tensor flat = model->flatten_parameters().second;
  twin->flatten_parameters();
  SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  SGD plain(twin->parameters(), {.lr = 0.1, .momentum = 0.9});
  std::vector<int64_t> starts;  // each parameter's offset in the flat buffer
  for (Parameter* p : model->parameters()) {
    starts.push_back(p->grad.data<float>() - flat.data<float>());
  }
  std::vector<GradientSegment> given = {{flat.data<float>(), starts[3], flat.numel(), nullptr},
                                        {flat.data<float>(), 0, starts[3], nullptr}};
  int asked = 0;  // the source is asked at every step, and once when set
  opt.set_update_overlap([&given, &asked] {
    ++asked;
    return given;
  });
  EXPECT_TRUE(opt.update_overlap());
  EXPECT_EQ(asked, 1);
  const auto same_grads = [&](int t) {
    for (Module* m : {model.get(), twin.get()}) {
      int k = 0;
      for (Parameter* p : m->parameters()) {
        p->grad.copy_from(
            Tensor::from_vector(random_vector(p->grad.numel(), 100 * t + k++), p->grad.shape()));
      }
    }
  };
  const auto expect_same = [&](const char* what) {
    EXPECT_EQ(bytes_of(model->state_dict()), bytes_of(twin->state_dict())) << what;
    EXPECT_EQ(bytes_of(opt.state_dict()), bytes_of(plain.state_dict())) << what;
  };
  same_grads(0);
  opt.step();
  plain.step();
  EXPECT_FALSE(opt.last_step_overlapped()) << "the step that makes the momentum buffers";
  expect_same("first");
  same_grads(1);
  opt.step();
  plain.step();
  EXPECT_TRUE(opt.last_step_overlapped());
  expect_same("pieces");

  same_grads(1);
  opt.step(Tensor::from_vector<int32_t>({0}, {1}));
  plain.step();
  EXPECT_FALSE(opt.last_step_overlapped()) << "a gated step waits for the whole backward";
  expect_same("gated");

  same_grads(2);
  opt.zero_grad(ZeroGrad::deferred);  // the Linears' gradients now count as zero, unwritten
  plain.zero_grad(ZeroGrad::deferred);
  opt.step();
  plain.step();
  EXPECT_FALSE(opt.last_step_overlapped()) << "pending gradients are zeroed after the backward";
  expect_same("pending");

  given.clear();
  same_grads(3);
  opt.step();
  plain.step();
  EXPECT_FALSE(opt.last_step_overlapped());
  expect_same("no pieces");
  // Every step used its backward's buckets up, overlapped or not.
  EXPECT_EQ(asked, 1 + 5);

  const auto expect_error = [&](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      FAIL() << "no error; expected one with '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.message()).find(needle), std::string::npos) << e.message();
    }
  };
  expect_error([&] { clip_grad_norm(model->parameters(), 1.0); }, "turn that overlap off");
  grad_norm(model->parameters());  // reads only: allowed

  const Tensor other = Tensor::zeros({flat.numel()});
  given = {{other.data<float>(), 0, flat.numel(), nullptr}};
  expect_error([&] { opt.step(); }, "another buffer");
  given = {{flat.data<float>(), starts[3], flat.numel(), nullptr},
           {flat.data<float>(), 0, starts[2], nullptr}};
  expect_error([&] { opt.step(); }, "leave a gap");
  given = {{flat.data<float>(), 1, flat.numel(), nullptr}};
  expect_error([&] { opt.step(); }, "does not start where a parameter starts");

  opt.set_update_overlap({});
  EXPECT_FALSE(opt.update_overlap());
  clip_grad_norm(model->parameters(), 1.0);
}

}  // namespace
}  // namespace cudp
