// DistributedDataParallel: PyTorch's nn.parallel.DistributedDataParallel, one rank per process
// (docs/distributed.md). Each process holds one replica of the model on its device and feeds it
// its own shard of the global batch (data::DistributedSampler).
//
//   construction  the module's parameters are flattened (Module::flatten_parameters) and, with its
//                 buffers, broadcast from rank 0, so every rank starts identical
//   forward       in training mode (broadcast_buffers, as PyTorch's default) rank 0's buffers
//                 (BatchNorm running statistics) to every rank, then the module's forward on this
//                 rank's shard; in evaluation mode no collective, so rank 0 may evaluate alone
//   backward      the module's backward; the Reducer (engine/parallel/reducer.h, one local rank)
//                 all-reduces the flat gradient buffer in buckets as the backward completes them,
//                 overlapped with the rest of it; compute waits for the last bucket at its end
//
// Gradients are summed over the ranks, not averaged, as DataParallel's (data_parallel.h): rank r's
// loss is the mean over its n_r samples weighted by n_r / B (B the global batch, the sum of every
// rank's n_r), so that the sum of the ranks' gradients is the gradient of the mean loss over the
// global batch, uneven shards included, and 1 process on the whole batch is N processes on its
// shards. loss_weight() gives n_r / B for the last forward (CrossEntropyLoss::forward's `weight`).
// PyTorch's DDP averages instead (it divides by the world size); with equal shards the two agree.
//
// The optimizer is a plain one on ddp.parameters() (the replica of this process), made after the
// DistributedDataParallel (flattening re-points the parameters). Every rank starts from the same
// values and steps with the same summed gradient, so replicas stay bit-identical.
//
// no_sync(): a scope in which backward leaves the gradients local (accumulation over
// micro-batches); the first backward with sync on again sums everything accumulated. A batch run
// as micro-batches weights its loss by loss_weight(rows) of the whole local batch (layers/train.h,
// forward_backward_micro_batches' batch_weight), not by loss_weight() of one micro-batch.
//
// CUDA graphs: a training step (forward, loss, backward, optimizer) may be captured and replayed
// (layers/train.h, GraphedStep): the buffers' broadcast, the buckets' all-reduces and
// SyncBatchNorm's sums are NCCL collectives ordered by events, with no host wait, so they are
// captured with the rest. Every rank must then launch its graph at the same steps (equal batch
// shapes on every rank, as DistributedSampler's equal shards give), and the host decides nothing
// from values in a captured step: loss_weight() waits for the host, so a captured step passes its
// weight as a number (1 / world_size() with equal shards). A collective inside a graph runs at
// its launches: watch each with Communicator::watch_graph_launch (GraphedStepOptions::
// after_launch) so that the collective watchdog covers it.
//
// Synchronised batch norm across processes: construction gives every SyncBatchNorm2d in the module
// (made by convert_sync_batchnorm before wrapping) one group over the ranks,
// DistributedStatsGroup (engine/parallel/stats_group.h), this rank as participant rank(), through
// attach_stats_group (the engine names no layer), as DataParallel does for its replicas; PyTorch's
// SyncBatchNorm uses the default process group the same way. A training forward then normalises
// with the statistics of every rank's rows, and the layers' sums are collectives issued in the
// forward and backward, in the same order on every rank: every rank must run every training
// forward and backward (the sampler's equal shards see to that). Evaluation makes none. With a
// world of one the layers are BatchNorm2d. The destructor detaches them.
//
// Not covered: BatchNorm2d's host copy of num_batches_tracked (num_batches_tracked()) is not
// re-read after a broadcast; the buffer itself, which the module counts from and saves, is rank
// 0's. The host copy differs only where ranks started with different counts.
//
// The ranks are reached through a DistributedGroup: nccl_group(process_group) for GPUs (NCCL, one
// device per process), or mpi_host_group(session) for a model on the host, with MPI moving the
// data (only in a build with MPI; what the tests run under mpirun without a GPU).
#pragma once

#include <cstdint>
#include <memory>

#include "engine/parallel/process_group.h"
#include "engine/parallel/reducer.h"

namespace cudp {
class StatsGroup;
}

namespace cudp::parallel {

namespace mpi {
class Session;
}

// What DistributedDataParallel needs from the ranks. Every call is collective: every rank makes it,
// in the same order.
class DistributedGroup {
 public:
  virtual ~DistributedGroup() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // The Reducer's interface to the ranks, with one local rank (this process).
  virtual ReduceGroup& reduce_group() = 0;
  // Rank `root`'s tensors to every rank, in place (same shapes and dtypes everywhere).
  virtual void broadcast(const TensorList& tensors, int root) = 0;
  // The sum of `value` over every rank, on the host.
  virtual int64_t sum(int64_t value) = 0;
  // The element-wise sum of `data` (f32, on this rank's device: the host for mpi_host_group) over
  // every rank, in place, with the same bits on every rank; every rank gives the same numel. On a
  // GPU the sum is ordered in `stream`, the stream the caller computes on (work enqueued there
  // after the call reads it, and the host does not wait); ignored for host tensors. For small
  // tensors: SyncBatchNorm2d's statistics across processes (DistributedStatsGroup,
  // engine/parallel/stats_group.h); the MPI host group gathers every rank's copy to sum them in
  // rank order.
  virtual void all_reduce_sum(Tensor& data, cudaStream_t stream) = 0;
};

// A ProcessGroup of one device per process (ProcessGroup::from_mpi / create, or local({device}) for
// a world of one): NCCL collectives on the group's communicator; tensors live on its device.
std::shared_ptr<DistributedGroup> nccl_group(std::shared_ptr<ProcessGroup> group);
// MPI_COMM_WORLD of `session`, on host (CPU) tensors: MPI_Allreduce and MPI_Bcast. The session
// must outlive the group. Throws in a build without MPI (mpi::available()).
std::shared_ptr<DistributedGroup> mpi_host_group(const mpi::Session& session);

struct DistributedDataParallelOptions {
  ReducerOptions reducer;         // bucket size and overlap of the gradient all-reduce
  bool broadcast_buffers = true;  // rank 0's buffers to every rank before each forward
};

class DistributedDataParallel : public Module {
 public:
  // `module` must already be on the group's device (the host for mpi_host_group). Collective: every
  // rank constructs it, with the same model structure.
  DistributedDataParallel(std::shared_ptr<Module> module, std::shared_ptr<DistributedGroup> group,
                          DistributedDataParallelOptions options = {});
  ~DistributedDataParallel() override;
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;
  DistributedDataParallel(DistributedDataParallel&&) = delete;
  DistributedDataParallel& operator=(DistributedDataParallel&&) = delete;

  std::string type_name() const override { return "DistributedDataParallel"; }

  const std::shared_ptr<Module>& module() const { return module_; }
  DistributedGroup& group() const { return *group_; }
  int rank() const { return group_->rank(); }
  int world_size() const { return group_->world_size(); }
  const Reducer& reducer() const { return *reducer_; }

  // n_r / B for the last forward: this rank's rows over the rows of every rank's last forward
  // (collective: every rank calls it after the same forward; one host all-reduce of a count, made
  // once per forward). The weight of this rank's mean loss.
  double loss_weight();
  // rows / (the sum of every rank's `rows`): the weight of this rank's mean loss over a batch of
  // `rows` rows that it runs as several forwards (gradient accumulation, layers/train.h), where the
  // last forward's loss_weight() is a micro-batch's. Collective: one host all-reduce of a count.
  double loss_weight(int64_t rows);
  int64_t local_batch() const { return local_rows_; }

  // Rank 0's parameters and buffers to every rank (after changing them outside the optimizer, e.g.
  // load_state_dict on rank 0 alone); rank 0's buffers only. Collective.
  void broadcast_parameters();
  void broadcast_buffers();

  // Whether backward sums the gradients over the ranks (true unless set); PyTorch's
  // require_backward_grad_sync.
  void set_gradient_sync(bool on) { gradient_sync_ = on; }
  bool gradient_sync() const { return gradient_sync_; }
  // PyTorch DDP's no_sync(): gradient sync off while the guard lives, then as it was.
  using NoSync = GradientSyncOff<DistributedDataParallel>;
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // The update beside the backward (Replicated::set_update_overlap, layers/optim.h): this rank's
  // buckets of the last synced backward with the events after which each is summed
  // (Reducer::gradient_segments), once per backward; none after a forward, a backward without
  // sync, or a failed one. One replica: this rank's module. reduce_on_one_device() is for the
  // interface DataParallel shares: there is a reducer always.
  std::vector<GradientSegment> take_gradient_segments(size_t replica);
  size_t num_replicas() const { return 1; }
  void reduce_on_one_device() {}

 protected:
  TensorList forward_impl(const TensorList& inputs) override;
  TensorList backward_impl(const TensorList& grad_outputs) override;
  // A DistributedDataParallel owns a reducer bound to its group: clone the wrapped module and wrap
  // the copy instead.
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  TensorList buffer_tensors();

  void check_not_broken() const;

  std::shared_ptr<Module> module_;
  std::shared_ptr<DistributedGroup> group_;
  DistributedDataParallelOptions options_;
  Tensor flat_data_, flat_grad_;
  bool holds_total_ = false;  // the last backward was synced: flat_grad_ holds the ranks' total
  bool broken_ = false;       // a backward failed mid-all-reduce: the ranks are out of step
  std::unique_ptr<Reducer> reducer_;
  // The SyncBatchNorm2d layers' group over the ranks (null: none, or a world of one).
  std::shared_ptr<StatsGroup> stats_group_;
  bool gradient_sync_ = true;
  bool segments_ready_ = false;  // the last backward was synced and its buckets not yet taken
  int64_t local_rows_ = 0;
  int64_t global_rows_ = -1;  // -1: not yet summed for the last forward
};

}  // namespace cudp::parallel

namespace cudp {
using parallel::DistributedDataParallel;
}  // namespace cudp
