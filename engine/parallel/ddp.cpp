#include "engine/parallel/ddp.h"

#include <vector>

#include "engine/core/nvtx.h"
#include "engine/parallel/mpi_bootstrap.h"
#include "engine/parallel/stats_group.h"

namespace cudp::parallel {
namespace {

// ---- NCCL: one device per process ---------------------------------------------------------------

class NcclGroup final : public DistributedGroup {
 public:
  explicit NcclGroup(std::shared_ptr<ProcessGroup> group)
      : group_(std::move(group)), reduce_(group_->comm()) {
    CUDP_CHECK(group_->devices().size() == 1, "nccl_group: the process group drives ",
               group_->devices().size(),
               " devices in this process; DistributedDataParallel takes one device per process "
               "(ProcessGroup::from_mpi, or local({device})); for several devices in one process "
               "use DataParallel");
  }
  int rank() const override { return group_->rank(); }
  int world_size() const override { return group_->world_size(); }
  ReduceGroup& reduce_group() override { return reduce_; }
  void broadcast(const TensorList& tensors, int root) override {
    if (tensors.empty() || world_size() == 1) return;
    for (const Tensor& t : tensors) {
      CUDP_CHECK(t.is_cuda() && t.device().index == group_->devices()[0],
                 "DistributedDataParallel: a tensor to broadcast is on ", t.device().str(),
                 ", not on this rank's cuda:", group_->devices()[0],
                 "; move the module to the group's device before wrapping it");
    }
    group_->comm().broadcast_many({tensors}, root);
  }
  int64_t sum(int64_t value) override {
    if (world_size() == 1) return value;
    // A count as f32 (exact below 2^24) through NCCL, then to the host.
    CUDP_CHECK(value >= 0 && value < (int64_t{1} << 24), "nccl_group: the count ", value,
               " is outside [0, 2^24), where an f32 all-reduce is exact");
    Tensor t = Tensor::from_vector(std::vector<float>{static_cast<float>(value)}, {1})
                   .to(Device::cuda(group_->devices()[0]));
    group_->comm().all_reduce({t});
    // The host waits for the sum anyway; through synchronize() a collective the watchdog ended
    // throws its error here, instead of t.cpu() reading this rank's own count.
    group_->comm().synchronize();
    return static_cast<int64_t>(t.cpu().to_vector<float>()[0]);
  }
  // On the caller's stream, as CommStatsGroup does for DataParallel's replicas (comm.h's NOTE
  // [Comm stream ordering and memory lifetime]): the comm stream waits for an event recorded on
  // `stream` when `data` is complete, and `stream` waits for the collective's done event, so the
  // host does not wait and `data` is freed only after NCCL is done with it. This process drives
  // one rank from one thread, so there is no rendezvous to make: the call is the collective.
  void all_reduce_sum(Tensor& data, cudaStream_t stream) override {
    const int device = group_->devices()[0];
    CUDP_CHECK(data.device() == Device::cuda(device) && data.dtype() == DType::f32,
               "nccl_group: the tensor to sum must be f32 on this rank's cuda:", device, ", got ",
               data.str());
    if (world_size() == 1) return;
    if (after_.get() == nullptr) {
      after_ = cuda::Event::create(device);
      done_ = cuda::Event::create(device);
    }
    after_.record(stream);
    group_->comm().all_reduce_after({data}, {after_.get()}, {done_.get()}, {stream}, ReduceOp::Sum);
    CUDP_CUDA_CHECK(cudaStreamWaitEvent(stream, done_.get(), 0));
  }

 private:
  std::shared_ptr<ProcessGroup> group_;
  CommunicatorGroup reduce_;
  cuda::Event after_, done_;  // all_reduce_sum's, made at its first call
};

// ---- MPI on the host ----------------------------------------------------------------------------

void check_host(const Tensor& t, const char* what) {
  CUDP_CHECK(t.is_cpu(), "mpi_host_group: ", what, " is on ", t.device().str(),
             "; the MPI host group moves host tensors only (use nccl_group for a model on a GPU)");
}

// The Reducer's calls on host tensors: the backward ran on this thread and is complete when a
// bucket is marked, so marks are nothing and the all-reduce is MPI's, in place.
class MpiHostReduceGroup final : public ReduceGroup {
 public:
  explicit MpiHostReduceGroup(const mpi::Session& session) : session_(session) {}
  size_t local_ranks() const override { return 1; }
  void begin(size_t) override {}
  void mark_ready(size_t, size_t) override {}
  void all_reduce(size_t, const TensorList& views) override {
    const Tensor& view = views.at(0);
    check_host(view, "a gradient bucket");
    CUDP_CHECK(view.dtype() == DType::f32, "mpi_host_group: a gradient bucket is not f32");
    session_.all_reduce_sum(static_cast<float*>(view.data_ptr()),
                            static_cast<size_t>(view.numel()));
  }
  void finish() override {}

 private:
  const mpi::Session& session_;
};

class MpiHostGroup final : public DistributedGroup {
 public:
  explicit MpiHostGroup(const mpi::Session& session)
      : session_(session), info_(session.info()), reduce_(session) {}
  int rank() const override { return info_.rank; }
  int world_size() const override { return info_.world_size; }
  ReduceGroup& reduce_group() override { return reduce_; }
  void broadcast(const TensorList& tensors, int root) override {
    for (const Tensor& t : tensors) {
      check_host(t, "a tensor to broadcast");
      session_.broadcast(t.data_ptr(), t.nbytes(), root);
    }
  }
  int64_t sum(int64_t value) override { return session_.all_reduce_sum(value); }
  // Every rank's copy gathered, then summed in rank order, ((d_0 + d_1) + d_2) + ..., in f32 on
  // every rank: the same bits everywhere whatever algorithm MPI would pick for an MPI_Allreduce
  // (the standard promises no order, nor that every rank gets the same bits), and the bits of
  // HostStatsGroup's participants on threads. world_size() copies: for small tensors.
  void all_reduce_sum(Tensor& data, cudaStream_t) override {
    check_host(data, "a tensor to sum");
    CUDP_CHECK(data.dtype() == DType::f32, "mpi_host_group: the tensor to sum must be f32, got ",
               data.str());
    if (info_.world_size == 1) return;
    const auto n = static_cast<size_t>(data.numel());
    std::vector<float> all(n * static_cast<size_t>(info_.world_size));
    session_.all_gather(data.data_ptr(), n * sizeof(float), all.data());
    float* out = data.data<float>();
    for (size_t i = 0; i < n; ++i) {
      float sum = all[i];
      for (size_t r = 1; r < static_cast<size_t>(info_.world_size); ++r) sum += all[r * n + i];
      out[i] = sum;
    }
  }

 private:
  const mpi::Session& session_;
  LaunchInfo info_;
  MpiHostReduceGroup reduce_;
};

}  // namespace

std::shared_ptr<DistributedGroup> nccl_group(std::shared_ptr<ProcessGroup> group) {
  CUDP_CHECK(group != nullptr, "nccl_group: the process group is null");
  return std::make_shared<NcclGroup>(std::move(group));
}

std::shared_ptr<DistributedGroup> mpi_host_group(const mpi::Session& session) {
  return std::make_shared<MpiHostGroup>(session);
}

// ---- DistributedDataParallel --------------------------------------------------------------------

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<Module> module,
                                                 std::shared_ptr<DistributedGroup> group,
                                                 DistributedDataParallelOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  CUDP_CHECK(module_ != nullptr, "DistributedDataParallel: the module is null");
  CUDP_CHECK(group_ != nullptr, "DistributedDataParallel: the group is null");
  check_not_reduced(*module_, "DistributedDataParallel");  // before anything is flattened
  CUDP_CHECK(!module_->parameters().empty(),
             "DistributedDataParallel: the module has no parameters, so there is no gradient to "
             "synchronise; run it without the wrapper (PyTorch refuses it too)");
  register_module("module", module_);
  training_ = module_->is_training();
  device_ = module_->device();
  std::tie(flat_data_, flat_grad_) = module_->flatten_parameters();
  broadcast_parameters();
  reducer_ =
      std::make_unique<Reducer>(std::vector<std::vector<Parameter*>>{module_->parameters()},
                                TensorList{flat_grad_}, group_->reduce_group(), options_.reducer);
  reducer_->attach(0, *module_);
  if (world_size() > 1) {
    auto stats = std::make_shared<DistributedStatsGroup>(group_);
    if (attach_stats_group(*module_, stats, static_cast<size_t>(rank())) > 0) {
      stats_group_ = std::move(stats);
    }
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  // The module outlives its wrapper: its layers leave the ranks' group (they are BatchNorm2d
  // again until wrapped anew).
  if (!stats_group_) return;
  try {
    attach_stats_group(*module_, nullptr, 0);
  } catch (...) {
    // Out of host memory while walking the modules: the layers keep a group that outlives its
    // wrapper (shared ownership), which is better than ending the process from a destructor.
  }
}

TensorList DistributedDataParallel::buffer_tensors() {
  TensorList buffers;
  for (auto& [name, buffer] : module_->named_buffers()) {
    if (buffer->defined() && buffer->numel() > 0) buffers.push_back(*buffer);
  }
  return buffers;
}

void DistributedDataParallel::broadcast_parameters() {
  TensorList tensors{flat_data_};
  for (const Tensor& b : buffer_tensors()) tensors.push_back(b);
  group_->broadcast(tensors, 0);
  module_->refresh_compute_copies();  // bf16(data) of the weights rank 0 sent (layers/module.h)
}

void DistributedDataParallel::broadcast_buffers() {
  const TensorList buffers = buffer_tensors();
  if (!buffers.empty()) group_->broadcast(buffers, 0);
}

double DistributedDataParallel::loss_weight() {
  CUDP_CHECK(local_rows_ > 0, "DistributedDataParallel::loss_weight: no forward has run yet");
  if (global_rows_ < 0) global_rows_ = group_->sum(local_rows_);
  return static_cast<double>(local_rows_) / static_cast<double>(global_rows_);
}

double DistributedDataParallel::loss_weight(int64_t rows) {
  CUDP_CHECK(rows > 0, "DistributedDataParallel::loss_weight: a batch of ", rows,
             " rows; give the rows of this rank's whole batch (at least one)");
  return static_cast<double>(rows) / static_cast<double>(group_->sum(rows));
}

void DistributedDataParallel::check_not_broken() const {
  CUDP_CHECK(!broken_, "DistributedDataParallel: rank ", rank(), " of ", world_size(),
             ": an earlier backward failed part-way through its gradient all-reduce, so the "
             "ranks' collectives are out of step; end the job on every rank and restart it "
             "(from the last checkpoint)");
}

TensorList DistributedDataParallel::forward_impl(const TensorList& inputs) {
  check_not_broken();
  CUDP_CHECK(!inputs.empty() && inputs[0].dim() >= 1,
             "DistributedDataParallel: the first input must have a batch dimension");
  // Training forwards only: an evaluation on rank 0 alone (a validation pass) must not wait for
  // the other ranks.
  if (options_.broadcast_buffers && is_training() && world_size() > 1) broadcast_buffers();
  local_rows_ = inputs[0].size(0);
  global_rows_ = -1;
  segments_ready_ = false;  // a new step: the last backward's buckets are no one's to update
  return module_->forward_all(inputs);
}

std::vector<GradientSegment> DistributedDataParallel::take_gradient_segments(size_t replica) {
  CUDP_CHECK(replica == 0, "DistributedDataParallel: replica ", replica,
             " of one (this rank's module)");
  if (!segments_ready_) return {};
  segments_ready_ = false;
  return reducer_->gradient_segments(0);
}

TensorList DistributedDataParallel::backward_impl(const TensorList& grad_outputs) {
  // After a synced backward every rank holds the total. A rank other than 0 drops it before it adds
  // another backward's part, or the next all-reduce would count it once per rank; rank 0 keeps it,
  // so that gradients accumulate as in one model (DataParallel's replicas do the same). With a
  // zero_grad() in between this is a redundant memset of the flat gradient buffer, and the
  // gradients a deferred zero_grad left to the backward are not zeroed (NOTE [Deferred zeroing],
  // layers/module.h).
  check_not_broken();
  if (holds_total_ && rank() != 0) {
    if (reducer_->layout_intact()) {
      zero_grads_not_pending(module_->parameters(), flat_grad_.data<float>(), flat_grad_.numel());
    } else {
      flat_grad_.zero_();  // the layout's error comes below
    }
  }
  holds_total_ = false;
  segments_ready_ = false;
  if (!gradient_sync_) return module_->backward_all(grad_outputs);
  CUDP_CHECK(reducer_->layout_intact(),
             "DistributedDataParallel: the module's gradients no longer view the flat buffer made "
             "at construction (flatten_parameters() was called again, or the module was moved); "
             "wrap the module anew after changing it");
  const nvtx::Range range("DistributedDataParallel backward");
  reducer_->prepare(1);
  TensorList grads;
  try {
    grads = module_->backward_all(grad_outputs);
  } catch (...) {
    // This rank issued only some of the step's buckets while the others issue them all: from here
    // the ranks' collectives would pair up wrongly (or wait forever), so this wrapper refuses any
    // further step instead of letting a caught error lead to silently wrong sums.
    reducer_->abandon();
    broken_ = true;
    throw;
  }
  reducer_->finish();
  holds_total_ = true;
  segments_ready_ = true;
  return grads;
}

std::shared_ptr<Module> DistributedDataParallel::make_empty_copy() const {
  CUDP_THROW(ValueError,
             "DistributedDataParallel cannot be cloned: it holds a reducer bound to its group; "
             "clone the wrapped module() and wrap the copy in a new DistributedDataParallel");
}

}  // namespace cudp::parallel
