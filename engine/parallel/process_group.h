// ProcessGroup: the ranks that train together, and the NCCL communicator between them.
//
// Two shapes, one interface, so that code above (a trainer, a reducer) asks a group for its rank,
// world size and communicator and does not care how the ranks were started:
//   - local(device_ids): one process drives every device (DataParallel's case,
//     docs/architecture.md §2.8): ranks 0..N-1 are the devices, all in this process; the
//     communicator is a new one over device_ids, the group's own.
//   - from_mpi(session) / create(info, device, broadcast): one rank per process, started by mpirun
//     or srun (docs/distributed.md). The launch says which rank this is; the local rank (the rank
//     among the processes of this machine) picks the device; rank 0 asks NCCL for a unique id and
//     sends it to the others (MPI_Bcast, or any `broadcast` the caller has); every rank then calls
//     ncclCommInitRank. MPI carries those 128 bytes and nothing else: NCCL moves all data.
//
// Where the numbers come from (launch_info_from_env, in this order; the first complete set wins):
//   Open MPI's mpirun   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
//   MPICH's mpiexec     PMI_RANK, PMI_SIZE, MPI_LOCALRANKID
//   Slurm's srun        SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
// Open MPI comes first because mpirun inside a Slurm allocation inherits the allocation's SLURM_*
// variables (rank 0 for everyone). Under MPI, from_mpi uses MPI's own answers instead
// (MPI_Comm_rank, MPI_Comm_size, and the rank within MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)),
// which need no environment at all; the environment is for choosing a device before MPI starts
// and for launchers without MPI. Slurm's variables describe a rank only inside `srun`: a batch
// script's own shell sees SLURM_NTASKS but is one process.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/parallel/comm.h"
#include "engine/parallel/watchdog.h"

namespace cudp::parallel {

struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;             // among the ranks of this machine
  std::string source = "single";  // where the numbers came from: "single" (no launcher found),
                                  // "OMPI_COMM_WORLD_*", "PMI_*", "SLURM_*" or "MPI"
};

// The environment's answer (see the header comment); a single process when no launcher's
// variables are set. Throws ValueError naming the variable when one is set but malformed, or a
// set is incomplete or inconsistent. `getenv` is injectable for tests.
using GetEnv = std::function<const char*(const char*)>;
LaunchInfo launch_info_from_env(const GetEnv& getenv = [](const char* name) {
  return std::getenv(name);
});

// The CUDA device of local rank `local_rank` among `visible` devices: the local rank itself, so
// with 8 processes on an 8-GPU machine process i drives GPU i; or device 0 when the process sees a
// single device, which is how launchers that bind one GPU to each task leave it (Slurm's
// --gpus-per-task=1, a CUDA_VISIBLE_DEVICES per rank; two ranks on one GPU are NCCL's error). Throws
// when there are more local ranks than devices, saying how many processes per machine fit.
int device_for_local_rank(int local_rank, int visible);

struct ProcessGroupOptions {
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;  // of every collective
};

namespace mpi {
class Session;
}

class ProcessGroup {
 public:
  // Sends `bytes` bytes at `data` from rank `root` to every other rank (collective: every rank
  // calls it with the same size and root).
  using Broadcast = std::function<void(void* data, size_t bytes, int root)>;

  // One process, ranks 0..N-1 on device_ids (DataParallel's communicator).
  static std::shared_ptr<ProcessGroup> local(const std::vector<int>& device_ids,
                                             ProcessGroupOptions options = {});
  // One rank per process, as MPI numbers them; the device is local rank's
  // (device_for_local_rank) unless `device` >= 0.
  static std::shared_ptr<ProcessGroup> from_mpi(const mpi::Session& session,
                                                ProcessGroupOptions options = {}, int device = -1);
  // One rank per process, numbered by `info`, driving `device`; `broadcast` carries rank 0's NCCL
  // id. from_mpi is this with MPI's numbers and MPI_Bcast.
  static std::shared_ptr<ProcessGroup> create(const LaunchInfo& info, int device,
                                              const Broadcast& broadcast,
                                              ProcessGroupOptions options = {});

  int rank() const { return info_.rank; }  // of this process's first device
  int world_size() const { return info_.world_size; }
  int local_rank() const { return info_.local_rank; }
  bool multi_process() const { return comm_->size() < comm_->world_size(); }
  const LaunchInfo& launch() const { return info_; }
  const std::vector<int>& devices() const { return comm_->devices(); }
  Communicator& comm() const { return *comm_; }
  const std::shared_ptr<Communicator>& shared_comm() const { return comm_; }

  ProcessGroup(LaunchInfo info, std::shared_ptr<Communicator> comm);

 private:
  LaunchInfo info_;
  std::shared_ptr<Communicator> comm_;
};

}  // namespace cudp::parallel
