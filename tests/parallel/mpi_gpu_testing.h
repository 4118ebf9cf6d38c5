// The start every MPI test on GPUs shares (tests/parallel/mpi_*_gpu_test.cpp, run by ctest as
// `mpirun -np 2`): a GPU per rank, skipped where there are fewer GPUs than ranks (every rank sees
// the same count, so all skip together); the ranks' process group (ProcessGroup::from_mpi: the
// local rank picks the GPU) with a 2-minute collective timeout; that GPU current.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>

#include "common/gpu.h"
#include "common/mpi_environment.h"
#include "engine/parallel/mpi_bootstrap.h"
#include "engine/parallel/process_group.h"

namespace cudp::testing {

class MpiRankOnGpu : public ::testing::Test {
 protected:
  static constexpr std::chrono::seconds kTimeout{120};

  void SetUp() override {
    CUDP_REQUIRE_GPU();
    ASSERT_NE(mpi_session(), nullptr);
    info = mpi_session()->info();
    if (cuda::device_count() < info.world_size) {
      GTEST_SKIP() << info.world_size << " ranks need as many GPUs, " << cuda::device_count()
                   << " visible";
    }
    parallel::ProcessGroupOptions options;
    options.timeout = kTimeout;
    group = parallel::ProcessGroup::from_mpi(*mpi_session(), options);
    gpu = Device::cuda(group->devices()[0]);
    cuda::set_device(gpu.index);
  }

  parallel::LaunchInfo info;
  std::shared_ptr<parallel::ProcessGroup> group;
  Device gpu = Device::cpu();
};

}  // namespace cudp::testing
