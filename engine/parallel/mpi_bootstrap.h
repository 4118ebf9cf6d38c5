// The MPI side of a multi-process launch: starting MPI, this process's rank, and a broadcast of a
// few bytes (rank 0's NCCL unique id). Nothing else of cudp uses MPI; NCCL moves the data.
//
// This header does not include mpi.h, so it is the same whether or not cudp was built with MPI
// (CUDP_WITH_MPI and an MPI found at configure time). Without MPI, available() is false and
// constructing a Session throws an error saying how to build with it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/parallel/process_group.h"

namespace cudp::parallel::mpi {

// Whether this build of cudp has the MPI bootstrap.
bool available();

// MPI for the lifetime of the object: MPI_Init_thread (MPI_THREAD_SERIALIZED: MPI is called from
// one thread at a time, any thread) unless the program initialised MPI itself, and MPI_Finalize at
// the end only if it was this object that initialised it. MPI errors become cudp::LibraryError
// (MPI_ERRORS_RETURN on MPI_COMM_WORLD) instead of ending the process.
class Session {
 public:
  Session();
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // rank and world_size from MPI_COMM_WORLD, local_rank within this machine's ranks
  // (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)); source "MPI".
  LaunchInfo info() const;
  // MPI_Bcast of `bytes` bytes from `root` on MPI_COMM_WORLD.
  void broadcast(void* data, size_t bytes, int root) const;
  void barrier() const;
  // Host collectives on MPI_COMM_WORLD, for host tensors (DistributedDataParallel's MPI host
  // group, engine/parallel/ddp.h, which makes it testable without GPUs): in-place MPI_Allreduce
  // (MPI_SUM) of `count` floats, and the sum of one integer over every rank.
  void all_reduce_sum(float* data, size_t count) const;
  int64_t all_reduce_sum(int64_t value) const;
  // MPI_Allgather of `bytes` bytes from every rank: `out` (world_size * bytes) receives rank r's
  // at offset r * bytes. What a sum in a fixed order is made of (the MPI host group's
  // all_reduce_sum, engine/parallel/ddp.h), since MPI_Allreduce promises no order.
  void all_gather(const void* data, size_t bytes, void* out) const;
  // Ends every rank of the job (MPI_Abort on MPI_COMM_WORLD) with `code`: for a rank that fails,
  // so that ranks waiting for it in an MPI call (which no collective timeout covers) end too,
  // whatever the launcher (srun without --kill-on-bad-exit would leave them waiting).
  [[noreturn]] void abort(int code) const;

 private:
  bool owns_ = false;  // MPI_Init was ours
};

}  // namespace cudp::parallel::mpi
