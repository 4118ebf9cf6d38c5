// Launch discovery on the host: the rank, world size and local rank each launcher's environment
// gives (Open MPI, MPICH, Slurm), which one wins when several are set, malformed values, and the
// device a local rank gets. The environment is a map given to launch_info_from_env, not the
// process's. (MPI's own answers are checked under mpirun by mpi_bootstrap_test.)
#include "engine/parallel/process_group.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "engine/parallel/mpi_bootstrap.h"

namespace cudp::parallel {
namespace {

LaunchInfo from(const std::map<std::string, std::string>& env) {
  return launch_info_from_env([&env](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(LaunchInfo, NoLauncherIsOneProcess) {
  const LaunchInfo info = from({{"RANK", "3"}, {"WORLD_SIZE", "8"}});  // torchrun's: not ours
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.source, "single");
}

TEST(LaunchInfo, EachLaunchersVariables) {
  LaunchInfo i = from({{"OMPI_COMM_WORLD_RANK", "5"},
                       {"OMPI_COMM_WORLD_SIZE", "16"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  EXPECT_EQ(i.rank, 5);
  EXPECT_EQ(i.world_size, 16);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.source, "OMPI_COMM_WORLD_*");
  i = from({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "0"}});
  EXPECT_EQ(i.rank, 2);
  EXPECT_EQ(i.world_size, 3);
  EXPECT_EQ(i.local_rank, 0);
  EXPECT_EQ(i.source, "PMI_*");
  i = from({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "12"}, {"SLURM_LOCALID", "1"}});
  EXPECT_EQ(i.rank, 9);
  EXPECT_EQ(i.world_size, 12);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.source, "SLURM_*");
}

TEST(LaunchInfo, OpenMpiWinsOverTheSlurmAllocationItRunsIn) {
  const LaunchInfo i = from({{"SLURM_PROCID", "0"},
                             {"SLURM_NTASKS", "4"},
                             {"SLURM_LOCALID", "0"},
                             {"OMPI_COMM_WORLD_RANK", "3"},
                             {"OMPI_COMM_WORLD_SIZE", "4"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}});
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.local_rank, 3);
  EXPECT_EQ(i.source, "OMPI_COMM_WORLD_*");
}

TEST(LaunchInfo, MalformedOrIncompleteVariablesAreErrors) {
  std::string e = error_of([] {
    from({{"SLURM_PROCID", "1x"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}});
  });
  EXPECT_NE(e.find("SLURM_PROCID=\"1x\""), std::string::npos) << e;
  e = error_of([] { from({{"OMPI_COMM_WORLD_RANK", "-1"}}); });
  EXPECT_NE(e.find("OMPI_COMM_WORLD_RANK=\"-1\""), std::string::npos) << e;
  e = error_of([] { from({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}); });
  EXPECT_NE(e.find("OMPI_COMM_WORLD_LOCAL_RANK unset"), std::string::npos) << e;
  e = error_of([] { from({{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}}); });
  EXPECT_NE(e.find("rank PMI_RANK=4 of PMI_SIZE=4"), std::string::npos) << e;
  e = error_of([] {
    from({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "2"}});
  });
  EXPECT_NE(e.find("SLURM_LOCALID=2 above the global rank SLURM_PROCID=1"), std::string::npos) << e;
}

TEST(LaunchInfo, TheLocalRankPicksTheDevice) {
  EXPECT_EQ(device_for_local_rank(0, 8), 0);
  EXPECT_EQ(device_for_local_rank(7, 8), 7);
  EXPECT_EQ(device_for_local_rank(3, 1), 0) << "one GPU bound to each task by the launcher";
  std::string e = error_of([] { device_for_local_rank(2, 2); });
  EXPECT_NE(e.find("local rank 2 has no GPU"), std::string::npos) << e;
  EXPECT_NE(e.find("at most 2 processes per machine"), std::string::npos) << e;
  e = error_of([] { device_for_local_rank(0, 0); });
  EXPECT_NE(e.find("shows 0 CUDA devices"), std::string::npos) << e;
}

TEST(LaunchInfo, WithoutMpiTheBootstrapSaysHowToGetIt) {
  if (mpi::available()) GTEST_SKIP() << "built with MPI: mpi_bootstrap_test runs it under mpirun";
  const std::string e = error_of([] { mpi::Session session; });
  EXPECT_NE(e.find("built without MPI"), std::string::npos) << e;
  EXPECT_NE(e.find("-DCUDP_WITH_MPI=ON"), std::string::npos) << e;
}

}  // namespace
}  // namespace cudp::parallel
