// The MPI bootstrap on the host, run by ctest as `mpirun -np 2` (tests/CMakeLists.txt; built only
// with MPI). No GPU is used: what is checked is what happens before NCCL starts.
//   - rank, world size and local rank from MPI agree with the ones mpirun put in the environment
//     (two independent sources: MPI computes its own, the launcher sets the variables), and each
//     rank is who it says it is (each in turn broadcasts its rank);
//   - a blob broadcast from rank 0, standing in for the NCCL unique id, arrives intact everywhere.
// Run directly (no mpirun) it is a world of one, and the same checks hold.
#include "engine/parallel/mpi_bootstrap.h"

#include <gtest/gtest.h>

#include <array>
#include <memory>

#include "common/mpi_environment.h"

namespace cudp::parallel {
namespace {

using testing::mpi_session;

uint8_t pattern(size_t i) {
  return static_cast<uint8_t>((i * 131 + 7) ^ (i >> 8));
}

TEST(MpiBootstrap, IsBuilt) {
  EXPECT_TRUE(mpi::available());
}

TEST(MpiBootstrap, RankSizeAndLocalRankAgreeWithTheLauncher) {
  ASSERT_NE(mpi_session(), nullptr);
  const LaunchInfo mpi = mpi_session()->info();
  const LaunchInfo env = launch_info_from_env();
  EXPECT_EQ(mpi.source, "MPI");
  EXPECT_EQ(mpi.world_size, env.world_size) << "the launcher's " << env.source;
  EXPECT_EQ(mpi.rank, env.rank) << "the launcher's " << env.source;
  EXPECT_EQ(mpi.local_rank, env.local_rank) << "one machine: local rank = rank";
  EXPECT_EQ(mpi.local_rank, mpi.rank) << "every rank of this test is on this machine";
  if (env.source != "single") {
    EXPECT_EQ(mpi.world_size, 2) << "ctest runs this test as mpirun -np 2";
  }
  for (int root = 0; root < mpi.world_size; ++root) {
    int value = mpi.rank == root ? mpi.rank : -1;
    mpi_session()->broadcast(&value, sizeof value, root);
    EXPECT_EQ(value, root) << "rank " << root << " says it is rank " << value;
  }
  mpi_session()->barrier();
}

TEST(MpiBootstrap, ABlobFromRankZeroArrivesIntact) {
  ASSERT_NE(mpi_session(), nullptr);
  const int rank = mpi_session()->info().rank;
  // The size of ProcessGroup's message (an NCCL unique id and a flag), then a larger one.
  for (const size_t bytes : {size_t{129}, size_t{1} << 20}) {
    std::vector<uint8_t> blob(bytes, 0xEE);  // poisoned where it is to be received
    if (rank == 0) {
      for (size_t i = 0; i < bytes; ++i) blob[i] = pattern(i);
    }
    mpi_session()->broadcast(blob.data(), blob.size(), 0);
    size_t wrong = 0, first_wrong = bytes;
    for (size_t i = 0; i < bytes; ++i) {
      if (blob[i] != pattern(i)) {
        if (wrong++ == 0) first_wrong = i;
      }
    }
    EXPECT_EQ(wrong, 0u) << "rank " << rank << ": " << wrong << " of " << bytes
                         << " bytes differ, the first at " << first_wrong;
  }
}

}  // namespace
}  // namespace cudp::parallel
