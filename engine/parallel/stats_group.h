// CommStatsGroup: the StatsGroup (layers/sync_batchnorm.h) of DataParallel's replicas, over the
// NCCL communicator of their devices in this process. Participant i is local rank i (replica i,
// on devices()[i]); each replica's worker thread calls all_reduce_sum with its own tensor and
// compute stream.
//
// Issuing: one thread per rank issuing its own NCCL call is the pattern comm.h warns against (a
// collective launched for one rank and not yet for another, and an implicitly synchronising CUDA
// call on the other's thread in between, deadlock). So the participants meet at a host rendezvous
// (layers/sync_batchnorm.h's Rendezvous, with the communicator's timeout), and the last to arrive
// issues the all-reduce for every rank in one NCCL group (Communicator::all_reduce_after), after
// an event each participant recorded on its compute stream; each participant's compute stream
// then waits for its rank's done event (comm.h's NOTE [Comm stream ordering and memory lifetime]),
// so the host does not wait for the GPU and the tensor is freed only after NCCL is done with it.
// The sum is NCCL's (the same bits on every rank).
//
// DistributedStatsGroup: the StatsGroup of DistributedDataParallel's ranks, one process each.
// Participant r is rank r, and a process takes part as its own rank only; a sum is one
// DistributedGroup::all_reduce_sum (engine/parallel/ddp.h), the collective itself, made by the
// thread that runs the layer's forward or backward. No rendezvous is needed: this process drives
// one rank from one thread, so comm.h's rule has nothing to interleave. The sum is the group's:
// NCCL's on the caller's stream (nccl_group), or MPI's gathered copies added in rank order on the
// host (mpi_host_group).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/core/stream.h"
#include "engine/parallel/comm.h"
#include "layers/sync_batchnorm.h"

namespace cudp::parallel {

class CommStatsGroup : public StatsGroup {
 public:
  // `comm` drives every participant (its size() local ranks, one process, world_size == size()).
  explicit CommStatsGroup(std::shared_ptr<Communicator> comm);
  size_t size() const override { return rendezvous_.size(); }
  // `data`: f32 on devices()[participant]; `stream`: that device's compute stream.
  void all_reduce_sum(size_t participant, Tensor& data, cudaStream_t stream) override;
  void abort(const std::string& reason) override { rendezvous_.abort(reason); }
  void reset() override { rendezvous_.reset(); }

 private:
  std::shared_ptr<Communicator> comm_;
  Rendezvous rendezvous_;
  std::vector<cuda::Event> after_, done_;  // per participant
};

class DistributedGroup;

class DistributedStatsGroup : public StatsGroup {
 public:
  explicit DistributedStatsGroup(std::shared_ptr<DistributedGroup> group);
  size_t size() const override { return size_; }  // the world size
  // `participant` must be this process's rank; `data`: f32 on its device (the host for the MPI
  // group), `stream`: the stream the caller computes on.
  void all_reduce_sum(size_t participant, Tensor& data, cudaStream_t stream) override;
  // A process cannot release its peers from a collective they wait in (the collective timeout,
  // or the launcher ending the job when this process exits, does that): abort makes this rank's
  // own later calls throw with `reason` until reset().
  void abort(const std::string& reason) override;
  void reset() override;

 private:
  std::shared_ptr<DistributedGroup> group_;
  size_t size_ = 0, rank_ = 0;
  std::mutex mutex_;
  std::string aborted_;  // non-empty: abort()'s first reason, until reset()
};

}  // namespace cudp::parallel
