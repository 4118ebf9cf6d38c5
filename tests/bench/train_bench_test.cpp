// bench_train as one process on the CPU (--gpus none), and the usage errors a command line without
// a GPU or a launcher meets. The figures are checked against what they must be whatever the speed:
// the global batch they imply (run_bench_train.h), one row per configuration, "processes": 1.
#include "bench/run_bench_train.h"

namespace {

using namespace cudp::testing;

TEST(BenchTrain, OneProcessOnTheCpu) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain, kTinyCpu + "--json '" + (dir / "t.json") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto rows = json_lines(dir / "t.json");
  ASSERT_EQ(rows.size(), 1u) << r.output;  // graphs off only: the CPU has no CUDA graphs
  const auto& row = rows[0];
  EXPECT_EQ(row.at("processes"), 1);
  EXPECT_EQ(row.at("gpus"), 0);
  EXPECT_EQ(row.at("batch_per_gpu"), 4);
  EXPECT_EQ(row.at("cudp_graphs"), "off");
  EXPECT_FALSE(row.contains("peak_gib"));  // GPU memory only
  expect_global_batch(row, 4);
  EXPECT_EQ(count_of(r.output, "| vgg11 | fp32 | off | 32 | 4 | 1 | 0 (CPU) |"), 1u) << r.output;
}

TEST(BenchTrain, ProcessesWithoutALauncherSaysHowToLaunch) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain, kTinyCpu + "--processes 2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "mpirun -np 2 bench_train")) << r.output;
}

TEST(BenchTrain, GraphsOnTheCpuIsAUsageError) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain, kTinyCpu + "--graphs on");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "CUDA graphs need a GPU")) << r.output;
}

TEST(BenchTrain, NoGpuVisibleSaysGpusNone) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r =
      run_program(dir, kBenchTrain, "--size 32 --steps 1", "CUDA_VISIBLE_DEVICES= ");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "no CUDA device is visible; give --gpus none")) << r.output;
}

TEST(BenchTrain, GpusMustBeACountOrNone) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain, "--gpus two --size 32");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--gpus two: give a GPU count")) << r.output;
}

}  // namespace
