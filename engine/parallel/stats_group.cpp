#include "engine/parallel/stats_group.h"

#include "engine/parallel/ddp.h"

namespace cudp::parallel {

namespace {

struct Call {
  Tensor* data;
  cudaStream_t stream;
};

const std::shared_ptr<Communicator>& checked(const std::shared_ptr<Communicator>& comm) {
  CUDP_CHECK(comm != nullptr, "CommStatsGroup: the communicator is null");
  CUDP_CHECK(comm->world_size() == comm->size(), "CommStatsGroup: the communicator has ",
             comm->size(), " local ranks of ", comm->world_size(),
             "; this group serves one process driving every rank (DataParallel). Across "
             "processes each rank needs a group that calls its own collective");
  return comm;
}

}  // namespace

CommStatsGroup::CommStatsGroup(std::shared_ptr<Communicator> comm)
    : comm_(checked(comm)), rendezvous_(size_t(comm_->size()), comm_->timeout()) {
  for (int d : comm_->devices()) {
    after_.push_back(cuda::Event::create(d));
    done_.push_back(cuda::Event::create(d));
  }
}

void CommStatsGroup::all_reduce_sum(size_t participant, Tensor& data, cudaStream_t stream) {
  CUDP_CHECK(participant < size(), "CommStatsGroup: participant ", participant,
             " is outside the group of ", size());
  const int device = comm_->devices()[participant];
  CUDP_CHECK(data.device() == Device::cuda(device) && data.dtype() == DType::f32,
             "CommStatsGroup: participant ", participant,
             " must give an f32 tensor on cuda:", device, ", got ", data.str());
  after_[participant].record(stream);
  Call call{&data, stream};
  rendezvous_.arrive(participant, &call, "CommStatsGroup::all_reduce_sum",
                     [&](const std::vector<void*>& slots) {
                       TensorList tensors;
                       std::vector<cudaEvent_t> after, done;
                       std::vector<cudaStream_t> compute;
                       for (size_t i = 0; i < slots.size(); ++i) {
                         const Call& c = *static_cast<const Call*>(slots[i]);
                         tensors.push_back(*c.data);
                         after.push_back(after_[i].get());
                         done.push_back(done_[i].get());
                         compute.push_back(c.stream);
                       }
                       comm_->all_reduce_after(tensors, after, done, compute, ReduceOp::Sum);
                     });
  // Step 2 of comm.h's NOTE: compute reads (and frees) the sum only after the collective.
  CUDP_CUDA_CHECK(cudaStreamWaitEvent(stream, done_[participant].get(), 0));
}

// ---- DistributedStatsGroup ----------------------------------------------------------------------

DistributedStatsGroup::DistributedStatsGroup(std::shared_ptr<DistributedGroup> group)
    : group_(std::move(group)) {
  CUDP_CHECK(group_ != nullptr, "DistributedStatsGroup: the group is null");
  size_ = static_cast<size_t>(group_->world_size());
  rank_ = static_cast<size_t>(group_->rank());
}

void DistributedStatsGroup::all_reduce_sum(size_t participant, Tensor& data, cudaStream_t stream) {
  CUDP_CHECK(participant == rank_, "DistributedStatsGroup: participant ", participant,
             " called on rank ", rank_, " of ", size_,
             "; a process takes part as its own rank only (attach_stats_group with rank())");
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    CUDP_CHECK(aborted_.empty(), "DistributedStatsGroup::all_reduce_sum on rank ", rank_,
               ": aborted: ", aborted_);
  }
  group_->all_reduce_sum(data, stream);
}

void DistributedStatsGroup::abort(const std::string& reason) {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_.empty()) aborted_ = reason.empty() ? std::string("aborted") : reason;
}

void DistributedStatsGroup::reset() {
  const std::lock_guard<std::mutex> lock(mutex_);
  aborted_.clear();
}

}  // namespace cudp::parallel
