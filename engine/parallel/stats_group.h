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
// Multi-process runs (one rank per process, DistributedDataParallel) need a group over that
// process's single rank, which calls the collective directly; this one serves the one-process
// engine only.
#pragma once

#include <memory>
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

}  // namespace cudp::parallel
