// SyncBatchNorm2d: PyTorch's nn.SyncBatchNorm over NHWC activations. In training every participant
// (a data-parallel replica, or a rank) normalises its own rows with the mean and biased variance
// of all participants' rows together, and its backward gives the gradient of batch norm over that
// whole batch; evaluation is BatchNorm2d's (the running statistics). The running statistics get
// the global mean and the unbiased global variance (global count - 1), identically on every
// participant. dgamma and dbeta are each participant's share (its rows' sums): summed across
// participants, as the engine sums gradients, they are the whole batch's.
//
// The exchange (kernels/batchnorm.h, "Split passes"):
//   forward   each participant's summary (count, shift K = its row 0, mean of x - K, M2) goes into
//             its slot of a zeroed buffer of P slots; one all_reduce_sum of the buffer gives every
//             participant every slot exactly (x + 0 = x: an all-gather); each merges them in slot
//             order with Chan's formula relative to slot 0's shift, so all get the same bits.
//             This keeps the single-device pass's care (sums of deviations from a sample, never
//             sum x^2 - (sum x)^2 / n, which loses every digit for a channel with mean 1000 and
//             spread 1), at the cost of P * (3C + 1) floats instead of 2C + 1.
//   backward  each participant's [sum g | sum g * (x - mean) | rows] (2C + 1 floats, the mean
//             the global one) is summed across participants; dx uses the sums and the global count.
// A participant's slot is its index in the group, so with slots in batch order (DataParallel's
// chunks: replica i holds the i-th chunk) slot 0's shift is the whole batch's row 0, the shift
// of BatchNorm2d over the whole batch.
//
// Without a group, or with a group of one, the layer is BatchNorm2d bit for bit (PyTorch's
// SyncBatchNorm also falls back to batch_norm with one process). Every participant must run every
// training forward and backward (the sums are collectives): a replica without rows would leave
// the others waiting (DataParallel refuses a batch smaller than its devices then).
//
// The group is abstract (StatsGroup): HostStatsGroup runs participants on host threads (CPU
// modules; the tests); engine/parallel/stats_group.h's CommStatsGroup sums over DataParallel's
// NCCL communicator (the GPUs of one process), and its DistributedStatsGroup over
// DistributedDataParallel's ranks (one participant per process, NCCL or MPI).
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "layers/batchnorm.h"

namespace cudp {

// A sum of per-channel f32 vectors across participants 0 .. size() - 1.
class StatsGroup {
 public:
  virtual ~StatsGroup() = default;
  virtual size_t size() const = 0;
  // A collective: every participant calls it, in the same sequence of calls, each with a
  // contiguous f32 tensor of the same numel on its own device (`stream`: the device's stream the
  // caller computes on; ignored for CPU tensors). Afterwards `data` holds the element-wise sum over
  // participants, the same bits on every participant: for a CPU tensor when the call returns, for
  // a device tensor in `stream`'s order (work enqueued on it after the call reads the sum).
  virtual void all_reduce_sum(size_t participant, Tensor& data, cudaStream_t stream) = 0;
  // For the engine, when a participant fails before its call and the others would wait for it
  // until the timeout: participants waiting in all_reduce_sum, and every call until reset(), throw
  // a ValueError carrying `reason`. reset() makes the group usable again (with no participant
  // inside all_reduce_sum: before each pass of the replicas).
  virtual void abort(const std::string& reason) = 0;
  virtual void reset() = 0;
};

// Every participant of a round calls arrive(); the last to arrive runs `action` with all
// participants' slots (slot p: participant p's pointer) while the others wait, and every
// participant returns once it ran, rethrowing its exception. A participant missing for `timeout`
// makes the waiting ones throw a ValueError naming it, and the rendezvous is broken from then on
// (every later call throws): a hang becomes an error.
class Rendezvous {
 public:
  explicit Rendezvous(size_t participants,
                      std::chrono::milliseconds timeout = std::chrono::minutes(10));
  size_t size() const { return slots_.size(); }
  void arrive(size_t participant, void* slot, const char* what,
              const std::function<void(const std::vector<void*>&)>& action);
  // StatsGroup::abort and reset (reset also forgets a timeout's breakage).
  void abort(const std::string& reason);
  void reset();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<void*> slots_;
  std::vector<bool> arrived_;
  size_t count_ = 0;
  uint64_t generation_ = 0;
  std::exception_ptr error_;  // the last round's action's
  bool broken_ = false;
  std::string aborted_;  // non-empty: abort()'s reason, until reset()
  std::chrono::milliseconds timeout_;
};

// Participants on host threads, each with a CPU tensor: a barrier, then the sum in participant
// order (((d_0 + d_1) + d_2) + ...) in f32, written to every participant's tensor. Deterministic.
class HostStatsGroup : public StatsGroup {
 public:
  explicit HostStatsGroup(size_t participants,
                          std::chrono::milliseconds timeout = std::chrono::minutes(10))
      : rendezvous_(participants, timeout) {}
  size_t size() const override { return rendezvous_.size(); }
  void all_reduce_sum(size_t participant, Tensor& data, cudaStream_t stream) override;
  void abort(const std::string& reason) override { rendezvous_.abort(reason); }
  void reset() override { rendezvous_.reset(); }

 private:
  Rendezvous rendezvous_;
};

class SyncBatchNorm2d : public BatchNorm2d {
 public:
  explicit SyncBatchNorm2d(int num_features, float eps = 1e-5f, float momentum = 0.1f)
      : BatchNorm2d(num_features, eps, momentum) {}
  SyncBatchNorm2d(init::SkipInit, int num_features, float eps = 1e-5f, float momentum = 0.1f)
      : BatchNorm2d(init::skip_init, num_features, eps, momentum) {}

  std::string type_name() const override { return "SyncBatchNorm"; }

  // This layer becomes `participant` of `group` (null: none, BatchNorm2d's behaviour). Clones
  // and replicas do not copy it: the engine gives each replica its own (attach_stats_group).
  void set_stats_group(std::shared_ptr<StatsGroup> group, size_t participant);
  const std::shared_ptr<StatsGroup>& stats_group() const { return group_; }
  size_t participant() const { return participant_; }

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  void release_saved() override {
    BatchNorm2d::release_saved();
    synced_ = false;
  }
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  bool syncing() const { return training_ && group_ && group_->size() > 1; }
  template <typename T>
  void forward_synced(const Tensor& input, Tensor& y);
  template <typename T>
  void backward_synced(const Tensor& grad_output, Tensor& dx);

  std::shared_ptr<StatsGroup> group_;
  size_t participant_ = 0;
  bool synced_ = false;  // the saved forward went through the group
};

// PyTorch's SyncBatchNorm.convert_sync_batchnorm: every BatchNorm2d in `module`'s tree (the
// module itself included) replaced by a SyncBatchNorm2d with its configuration, parameters,
// buffers (num_batches_tracked too), device, training flag and settings. Returns the module, or
// the new layer when `module` is a BatchNorm2d. Convert before wrapping in DataParallel or
// DistributedDataParallel, which give the layers their group.
std::shared_ptr<Module> convert_sync_batchnorm(std::shared_ptr<Module> module);

// The engine's hook: every SyncBatchNorm2d in `module`'s tree becomes `participant` of `group`
// (null: detached). Returns how many there are. The engine calls it without naming the layer.
size_t attach_stats_group(Module& module, const std::shared_ptr<StatsGroup>& group,
                          size_t participant);

}  // namespace cudp
