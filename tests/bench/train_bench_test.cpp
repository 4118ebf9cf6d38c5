// bench_train as one process on the CPU (--gpus none), with and without --bn, and the usage
// errors a command line without a GPU or a launcher meets (--precision tf32 among them). The
// figures are checked against what they must be whatever the speed: the global batch they imply
// (run_bench_train.h), one row per configuration, "processes": 1, BatchNorm's parameter count.
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
  EXPECT_EQ(row.at("bn"), false);          // --bn is off by default
  EXPECT_FALSE(row.contains("peak_gib"));  // GPU memory only
  expect_global_batch(row, 4);
  EXPECT_EQ(count_of(r.output, "| vgg11 | fp32 | off | 32 | 4 | 1 | 0 (CPU) |"), 1u) << r.output;
}

// --bn: VGG with a BatchNorm2d after every convolution, in each precision the CPU runs (the bf16
// row takes BatchNorm's bf16 path). The model must have exactly BatchNorm's parameters more than
// the plain VGG-11: a weight and a bias per channel of its 8 convolutions' outputs.
TEST(BenchTrain, BatchNormOnTheCpu) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult plain =
      run_program(dir, kBenchTrain, kTinyCpu + "--json '" + (dir / "plain.json") + "'");
  ASSERT_EQ(plain.code, 0) << plain.output;
  const RunResult r = run_program(
      dir, kBenchTrain, kTinyCpu + "--precision bf16 --bn --json '" + (dir / "bn.json") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto base = json_lines(dir / "plain.json");
  const auto rows = json_lines(dir / "bn.json");
  ASSERT_EQ(base.size(), 1u) << plain.output;
  ASSERT_EQ(rows.size(), 2u) << r.output;  // fp32 (kTinyCpu's), then bf16
  const int64_t bn_parameters = 2 * (64 + 128 + 256 + 256 + 512 + 512 + 512 + 512);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    EXPECT_EQ(row.at("model"), "vgg11") << row.dump();
    EXPECT_EQ(row.at("bn"), true) << row.dump();
    EXPECT_EQ(row.at("cudp_precision"), i == 0 ? "fp32" : "bf16") << row.dump();
    EXPECT_EQ(row.at("parameters").get<int64_t>() - base[0].at("parameters").get<int64_t>(),
              bn_parameters)
        << row.dump();
    expect_global_batch(row, 4);
  }
  EXPECT_EQ(count_of(r.output, "| vgg11-bn | fp32 | off | 32 | 4 | 1 | 0 (CPU) |"), 1u) << r.output;
  EXPECT_EQ(count_of(r.output, "| vgg11-bn | bf16 | off | 32 | 4 | 1 | 0 (CPU) |"), 1u) << r.output;
  EXPECT_EQ(count_of(plain.output, "| vgg11-bn |"), 0u) << plain.output;
}

// tf32 is a precision bench_train takes (CLI11 refuses a value outside --precision's list with
// exit 105), but not on the CPU, which does not emulate TF32's rounding: a usage error (exit 2)
// before any configuration runs, also when fp32 is asked for beside it.
TEST(BenchTrain, Tf32OnTheCpuIsAUsageError) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  for (const std::string precision : {"tf32", "fp32 tf32"}) {
    const RunResult r = run_program(dir, kBenchTrain,
                                    "--gpus none --arch vgg11 --size 32 --batch-per-gpu 4 "
                                    "--steps 1 --warmup 0 --precision " +
                                        precision + " --json '" + (dir / "t.json") + "'");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "--precision tf32 with --gpus none")) << r.output;
    EXPECT_TRUE(contains(r.output, "measure tf32 on a GPU")) << r.output;
    EXPECT_EQ(count_of(r.output, "| vgg11 |"), 0u) << r.output;  // nothing measured
  }
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
