// bench_train as several processes, launched as a user launches it: `mpirun -np 2 bench_train
// --gpus none ...` (host tests, built only with MPI; tests/CMakeLists.txt). Each rank trains VGG-11
// on the CPU under DistributedDataParallel with MPI moving the gradients (mpi_host_group): the
// launch, the timing's collectives, rank 0's row and JSON are the ones of a GPU run (where NCCL
// moves them), without a GPU. The test program itself is not started by mpirun: it runs mpirun.
//   - 2 ranks: exit 0; one JSON row, "processes": 2, "gpus": 0, whose img/s and step ms imply the
//     global batch of both ranks (2 x 4 images: a rank counting only its own is outside the
//     tolerance); the table's header and row appear once (rank 1 prints nothing).
//   - --gpus N with several processes, a rank without a GPU, and --processes unlike the launch:
//     usage errors that name the rank and what to do.
#include "bench/run_bench_train.h"

#include <regex>

namespace {

using namespace cudp::testing;

// bench_train `args` as `ranks` processes under mpirun, after `env` (variable assignments).
RunResult run_ranks(const TempDir& dir, int ranks, const std::string& args,
                    const std::string& env = "") {
  return run_program(dir, kBenchTrain, args, mpirun_prefix(ranks, env));
}

TEST(MpiBenchTrain, TwoProcessesOnTheCpu) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r =
      run_ranks(dir, 2, kTinyCpu + "--graphs off --json '" + (dir / "t.json") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto rows = json_lines(dir / "t.json");
  ASSERT_EQ(rows.size(), 1u) << r.output;
  const auto& row = rows[0];
  EXPECT_EQ(row.at("processes"), 2);
  EXPECT_EQ(row.at("gpus"), 0);
  EXPECT_EQ(row.at("batch_per_gpu"), 4);
  EXPECT_EQ(row.at("cudp_graphs"), "off");
  expect_global_batch(row, 2 * 4);
  EXPECT_GT(row.at("allreduce_ms").get<double>(), 0);     // MPI's all-reduce of the gradients alone
  EXPECT_GT(row.at("step_ms_no_comm").get<double>(), 0);  // --exposed-comm on, the default
  EXPECT_FALSE(row.contains("scaling"));  // no one-process row in the launch to scale against
  // Rank 1's standard output goes nowhere: every line appears once.
  EXPECT_EQ(count_of(r.output, "| model | precision |"), 1u) << r.output;
  EXPECT_EQ(count_of(r.output, "| vgg11 | fp32 | off | 32 | 4 | 2 | 0 (CPU) |"), 1u) << r.output;
  EXPECT_EQ(count_of(r.output, "bench_train: 2 processes, each on the CPU"), 1u) << r.output;
}

TEST(MpiBenchTrain, GpusWithSeveralProcessesIsAUsageError) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_ranks(dir, 2, "--gpus 2 --size 32 --steps 1");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("bench_train: rank [01] of 2: --gpus with several processes: each "
                           "process drives one GPU")))
      << r.output;
}

TEST(MpiBenchTrain, ARankWithoutAGpuSaysGpusNone) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_ranks(dir, 2, "--size 32 --steps 1", "CUDA_VISIBLE_DEVICES= ");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("bench_train: rank [01] of 2: this rank sees no CUDA device; .* give "
                           "--gpus none")))
      << r.output;
}

TEST(MpiBenchTrain, ProcessesUnlikeTheLaunchIsAUsageError) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_ranks(dir, 2, kTinyCpu + "--processes 3");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(
      std::regex_search(r.output, std::regex("rank [01] of 2: --processes 3, but the launcher "
                                             "started 2 processes: launch `mpirun -np 3")))
      << r.output;
}

}  // namespace
