// ProcessGroup::from_mpi on GPUs, one rank per process: ctest runs it as `mpirun -np 2`
// (tests/CMakeLists.txt; built only with MPI). Each process's local rank picks its GPU, rank 0's
// NCCL id reaches the other through MPI, and collectives across the processes give what host
// arithmetic on every rank's data gives (each rank regenerates the others' inputs from their
// seeds). Skips where there are fewer GPUs than ranks (every rank sees the same count, so all skip
// together). Run directly, it is a world of one.
#include <gtest/gtest.h>

#include <memory>

#include "common/compare.h"
#include "common/gpu.h"
#include "engine/parallel/mpi_bootstrap.h"
#include "parallel/mpi_gpu_testing.h"

namespace cudp::parallel {
namespace {

using cudp::testing::random_vector;

constexpr size_t kN = (1 << 20) + 37;

class MpiProcessGroupGpu : public testing::MpiRankOnGpu {};

TEST_F(MpiProcessGroupGpu, CollectivesAcrossProcessesMatchHostArithmetic) {
  EXPECT_EQ(group->rank(), info.rank);
  EXPECT_EQ(group->world_size(), info.world_size);
  EXPECT_EQ(group->local_rank(), info.local_rank);
  ASSERT_EQ(group->devices().size(), 1u);
  EXPECT_EQ(group->devices()[0], info.local_rank) << "the local rank picks the GPU";
  EXPECT_EQ(group->multi_process(), info.world_size > 1);
  EXPECT_EQ(group->comm().timeout(), kTimeout);

  std::vector<double> sum(kN, 0.0);
  for (int r = 0; r < info.world_size; ++r) {
    const std::vector<float> x = random_vector(kN, 1000 + static_cast<uint64_t>(r));
    for (size_t i = 0; i < kN; ++i) sum[i] += x[i];
  }
  Tensor t = Tensor::from_vector(random_vector(kN, 1000 + static_cast<uint64_t>(info.rank)),
                                 {static_cast<int64_t>(kN)}, gpu);
  group->comm().all_reduce({t});
  group->comm().synchronize();
  EXPECT_ALL_CLOSE(t.to_vector<float>(), sum, 1e-6, 1e-6);

  const int root = info.world_size - 1;
  const std::vector<float> root_data = random_vector(kN, 77);
  Tensor b = Tensor::from_vector(info.rank == root ? root_data : std::vector<float>(kN, -1.f),
                                 {static_cast<int64_t>(kN)}, gpu);
  group->comm().broadcast({b}, root);
  group->comm().synchronize();
  EXPECT_EQ(b.to_vector<float>(), root_data) << "rank " << info.rank;
}

}  // namespace
}  // namespace cudp::parallel
