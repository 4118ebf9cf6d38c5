// Reducer: sums the replicas' gradients in buckets while the backward still runs
// (docs/architecture.md §12).
//
// Every rank's parameters are views into one flat gradient buffer (Module::flatten_parameters), at
// the same offsets on every rank. The Reducer cuts that buffer into buckets of about
// `bucket_cap_bytes` (25 MiB by default, as PyTorch DDP's bucket_cap_mb), filled in reverse
// parameter order: the last parameters' gradients are the first a backward completes, so bucket 0
// holds them. Each module whose parameters are in a bucket signals, at the end of its backward,
// that their gradients are complete (Module::set_backward_hook); when a bucket is complete on a
// rank, that rank marks the point of its compute stream (ReduceGroup::mark_ready), and when it is
// complete on every rank its all-reduce is issued on the communication streams, ordered after
// those marks alone, so it runs beside the rest of the backward. The optimizer waits only on the
// last bucket (finish()).
//
// Same sums, same order. Buckets are issued strictly in bucket order (a bucket complete before
// the one before it waits for it), so every rank issues the same collectives in the same order
// (which NCCL requires) and a run issues the same calls whether it overlaps or not: overlap on and
// off are the same bits. The buckets cover the flat buffer exactly, padding included, so the sum
// of each element is the same one the whole-buffer all-reduce computes; with two ranks that is one
// addition, a + b, whatever the collective's size, so bucketed and unbucketed agree bit for bit
// (with more ranks NCCL's summation order of an element may depend on the call's size, so that
// comparison is made with two).
//
// Threads. Rank r's hooks run on the thread that runs rank r's backward (a DataParallel's worker
// for device r). Counters of one rank are touched by that rank's thread only; the count of ranks
// still missing from a bucket is atomic; issuing is serialised by a mutex, and the thread that
// completes a bucket issues it (with every consecutive one after it that is complete). A module
// whose backward does not run in a step (an unused branch) leaves its buckets to finish(), which
// marks them and issues them after every backward has returned.
//
// CUDA graphs: nothing here waits on the host, events are created once and recorded anew each
// step, and the collectives go to streams that join the capture through those events, so a
// captured step holds the bucketed all-reduce as an eager step issues it.
//
// The Reducer knows no DataParallel: it takes parameter lists, flat buffers and a ReduceGroup, the
// interface to the ranks it sums over. CommunicatorGroup is that interface for a Communicator
// (the local ranks of a DataParallel, or one rank of a ProcessGroup under DistributedDataParallel,
// engine/parallel/ddp.h, which also has an MPI host group); tests use a host one.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/parallel/comm.h"
#include "layers/module.h"
#include "layers/optim.h"

namespace cudp::parallel {

struct ReducerOptions {
  int64_t bucket_cap_bytes = int64_t{25} << 20;  // PyTorch DDP's bucket_cap_mb = 25
  // Start a bucket's all-reduce as soon as the backward completes it; false: every bucket after
  // the whole backward (the same calls, later: what overlap is measured against).
  bool overlap = true;
  // false: the buckets are marked complete as the backward goes, but nothing is summed: a step
  // with the reducer's events and no communication, what bench_train times against the real one
  // to see the communication a step exposes when the update runs beside the backward
  // (gradient_segments then gives the ready events). The wrappers still treat the gradients as
  // summed (replicas 1.., and ranks other than 0, zero theirs before the next backward, as after a
  // real all-reduce): for timing, not for training.
  bool sum = true;
};

// PyTorch DDP's no_sync() for any owner of a reducer (DataParallel, DistributedDataParallel):
// gradient sync off while the guard lives, then as it was.
template <typename Owner>
class GradientSyncOff {
 public:
  explicit GradientSyncOff(Owner& owner) : owner_(&owner), was_(owner.gradient_sync()) {
    owner.set_gradient_sync(false);
  }
  ~GradientSyncOff() { owner_->set_gradient_sync(was_); }
  GradientSyncOff(const GradientSyncOff&) = delete;
  GradientSyncOff& operator=(const GradientSyncOff&) = delete;
  GradientSyncOff(GradientSyncOff&&) = delete;
  GradientSyncOff& operator=(GradientSyncOff&&) = delete;

 private:
  Owner* owner_;
  bool was_;
};

// What a Reducer needs from the ranks it sums over. Calls come in this order per step: begin, then
// mark_ready for every (rank, bucket) and all_reduce for every bucket (in bucket order, each after
// every rank's mark_ready of it; none with ReducerOptions::sum false), then finish.
class ReduceGroup {
 public:
  virtual ~ReduceGroup() = default;
  virtual size_t local_ranks() const = 0;
  // A step with `buckets` buckets begins; called on the thread that drives the step, before any
  // backward runs.
  virtual void begin(size_t buckets) = 0;
  // Rank `rank`'s part of `bucket` is complete in its compute stream's order from this point.
  // Called by the thread that ran that rank's backward, or by the driving thread.
  virtual void mark_ready(size_t rank, size_t bucket) = 0;
  // Sums views[r] (rank r's part of the bucket) over every rank, in place, after each rank's
  // mark_ready of this bucket. Called from one thread at a time.
  virtual void all_reduce(size_t bucket, const TensorList& views) = 0;
  // From here, what each rank's compute stream does sees every bucket summed.
  virtual void finish() = 0;
  // The event after which `bucket` is summed on rank `rank`'s device (recorded there in this step,
  // once its all_reduce was issued), for an optimizer that updates it beside the backward
  // (Reducer::gradient_segments); null where the group has none.
  virtual cudaEvent_t final_event(size_t rank, size_t bucket) const { return nullptr; }
  // The event mark_ready recorded for (rank, bucket) in this step; null where the group has none.
  virtual cudaEvent_t ready_event(size_t rank, size_t bucket) const { return nullptr; }
};

// A Communicator's local ranks: events on each rank's compute stream (the current streams of the
// thread that calls begin()) and Communicator::all_reduce_after on its communication streams.
class CommunicatorGroup final : public ReduceGroup {
 public:
  explicit CommunicatorGroup(Communicator& comm) : comm_(comm) {}
  size_t local_ranks() const override { return comm_.devices().size(); }
  void begin(size_t buckets) override;
  void mark_ready(size_t rank, size_t bucket) override;
  void all_reduce(size_t bucket, const TensorList& views) override;
  void finish() override;
  cudaEvent_t final_event(size_t rank, size_t bucket) const override {
    return done_.at(bucket).at(rank);
  }
  cudaEvent_t ready_event(size_t rank, size_t bucket) const override {
    return ready_.at(bucket).at(rank);
  }

 private:
  Communicator& comm_;
  std::vector<cudaStream_t> compute_;
  // Per bucket, one event per rank: ready (recorded on compute) and done (recorded on comm).
  std::vector<std::vector<cuda::Event>> ready_events_, done_events_;
  std::vector<std::vector<cudaEvent_t>> ready_, done_;
  int64_t last_ = -1;  // the last bucket issued this step
};

// One rank on one GPU, with nothing to sum (a DataParallel on one device): the events that mark
// each bucket complete on the compute stream (the current stream of the thread that calls
// begin()), for an optimizer that updates the buckets beside the backward.
class LocalGroup final : public ReduceGroup {
 public:
  explicit LocalGroup(int device) : device_(device) {}
  size_t local_ranks() const override { return 1; }
  void begin(size_t buckets) override;
  void mark_ready(size_t rank, size_t bucket) override;
  void all_reduce(size_t, const TensorList&) override {}
  void finish() override {}
  cudaEvent_t final_event(size_t rank, size_t bucket) const override {
    return rank == 0 && bucket < ready_.size() ? ready_[bucket].get() : nullptr;
  }
  cudaEvent_t ready_event(size_t rank, size_t bucket) const override {
    return final_event(rank, bucket);
  }

 private:
  int device_;
  cudaStream_t compute_ = nullptr;
  std::vector<cuda::Event> ready_;  // per bucket, made once and recorded anew each step
};

// Throws ValueError when a module of `model` already signals its backward to a gradient reducer:
// another DataParallel, DistributedDataParallel or data_parallel()'s cached replicas own it. The
// wrappers call it before they change anything (flattening the parameters again would break the
// first owner's buckets); `who` names the caller in the message.
void check_not_reduced(Module& model, const std::string& who);

class Reducer {
 public:
  struct Bucket {
    int64_t begin = 0, end = 0;  // elements [begin, end) of the flat buffer
    std::vector<size_t> params;  // indices k of its parameters, in the order they were added
  };

  // params[r][k]: rank r's k-th parameter (the same model on every rank, Module::parameters()
  // order); flat_grads[r]: the buffer all of rank r's gradients view. Throws ValueError when the
  // gradients are not laid out as flatten_parameters lays them.
  Reducer(std::vector<std::vector<Parameter*>> params, TensorList flat_grads, ReduceGroup& group,
          ReducerOptions options = {});
  ~Reducer();  // removes its hooks
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;
  Reducer(Reducer&&) = delete;
  Reducer& operator=(Reducer&&) = delete;

  // Hooks rank `rank`'s modules (`model` and its descendants): each module owning parameters
  // signals its backward's end. The model must be the one whose parameters() gave params[rank].
  void attach(size_t rank, Module& model);

  const std::vector<Bucket>& buckets() const { return buckets_; }
  const ReducerOptions& options() const { return options_; }
  // Whether every gradient still views its flat buffer where the buckets were planned (someone
  // may re-flatten a model); when not, the caller reduces another way.
  bool layout_intact() const;

  // Before a step's backward, on the driving thread, after anything that writes the gradients
  // ahead of the backward (zeroing) is enqueued. Ranks >= active_ranks run no backward this step:
  // their gradients are ready now.
  void prepare(size_t active_ranks);
  // After every rank's backward has returned, on the driving thread: marks and issues the buckets
  // still waiting (modules that did not run backward), then ReduceGroup::finish.
  void finish();
  // A backward that failed: forgets the step (what was issued stays issued).
  void abandon();
  // Buckets issued before finish() in the last step (the overlap a test can see).
  size_t issued_before_finish() const { return issued_early_; }
  // Rank `rank`'s buckets of the last step, each with the event after which it is summed there
  // (ReduceGroup::final_event; with options().sum false, complete: ReduceGroup::ready_event), in
  // bucket order: what Optimizer::set_update_overlap waits on.
  // Empty before the first finish(), between prepare() and finish(), after abandon(), and where
  // the group has no events for a GPU.
  std::vector<GradientSegment> gradient_segments(size_t rank) const;

 private:
  void on_backward(size_t rank, const std::vector<size_t>& params);
  void issue_ready();  // with mutex_ held

  std::vector<std::vector<Parameter*>> params_;
  TensorList flat_;
  ReduceGroup& group_;
  ReducerOptions options_;
  std::vector<int64_t> offsets_;  // of each parameter in the flat buffers
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // parameter k -> its bucket
  std::vector<TensorList> views_;  // views_[b][r]: rank r's slice of bucket b
  std::vector<Module*> hooked_;
  // The step's counts: per bucket and rank, its parameters not yet complete; per bucket, ranks
  // not yet complete.
  std::vector<std::vector<int>> left_;
  std::unique_ptr<std::atomic<int>[]> ranks_left_;
  std::mutex mutex_;
  size_t next_ = 0;  // the next bucket to issue
  std::atomic<bool> armed_ = false;
  size_t issued_early_ = 0;
  bool complete_ = false;  // every bucket of the last prepared step was issued
};

}  // namespace cudp::parallel
