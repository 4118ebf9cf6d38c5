// cudp-vgg as several processes, launched as a user launches it: `mpirun -np 2 cudp-vgg --gpus none
// ...` (host tests, built only with MPI; tests/CMakeLists.txt). Each rank trains on the CPU with
// DistributedDataParallel over MPI (mpi_host_group), so no GPU is needed; the sampler, the loss
// weighting, rank 0's outputs, the metric sums and the checkpoints are the ones a GPU run uses
// (only the all-reduce differs: NCCL there).
//
// The test program itself is not started by mpirun: it runs mpirun, as a user's shell does.
//   - 2 ranks with --batch-size 4 each against the truth, one process with --batch-size 8 (the same
//     global batches: rank r's shard of an epoch is positions r, r + 2, ... of the order one
//     process follows): the checkpoints agree within mpi_ddp_test's tolerance, whose derivation
//     holds here (see kAbsolute); BatchNorm and Dropout are off, as each rank's BatchNorm
//     normalises its own shard and each rank's Dropout draws its own rows' masks (neither is one
//     process's batch). The tolerance can fail: one process on another batch (4 images per step) is
//     far outside it.
//   - Rank 0 alone prints, and writes the JSON log, the run folder and the checkpoint: each line
//     and record appears once; an error names its rank.
//   - An exact resume on 2 ranks: 2 epochs straight equal 1 epoch, stop, and --resume for the
//     second, bit for bit (the checksum of every state_dict entry), with BatchNorm, Dropout and the
//     onecycle schedule on; the checkpoint records the number of ranks, and resuming it in one
//     process is refused, naming both numbers.
//   - --sync-bn on 2 ranks (BatchNorm on) against one process with plain BatchNorm on the global
//     batch: within the same tolerance (SyncBatchNormOnTwoRanks says why it holds); 2 ranks with
//     plain BatchNorm (each normalising its own shard) are far outside it.
//   - --accumulate 2 on 2 ranks: without BatchNorm, the same training as without --accumulate;
//     with --sync-bn, one process with --accumulate 2 (the ranks' micro-batches together are the
//     one process's micro-batches), which 2 ranks with --sync-bn and no accumulation are not.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples/run_binary.h"
#include "layers/checkpoint.h"
#include "layers/safetensors.h"

namespace {

using namespace cudp::testing;

// cudp-vgg `args` as `ranks` processes under mpirun.
// `env`: "NAME=value " assignments for mpirun, whose ranks inherit them.
RunResult run_ranks(const TempDir& dir, int ranks, const std::string& args,
                    const std::string& env = "") {
  return run_vgg(dir, args, mpirun_prefix(ranks, env));
}

RunResult run_one(const TempDir& dir, const std::string& args) {
  return run_vgg(dir, args);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

size_t count_of(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// A real VGG small enough for the CPU references (a few images per second): 16 training images,
// 2 steps per epoch of 8 images. --gpus none: the CPU, on GPU machines too.
const std::string kSmall =
    "--gpus none --data synthetic --arch vgg11 --workers 1 --limit-train 16 --limit-test 8 "
    "--print-checksum ";

// The tolerance of tests/parallel/mpi_ddp_test.cpp, whose derivation applies unchanged: both runs
// compute every image's gradient with the same CPU kernels on the same values and differ only in
// how the W = 2 shards' gradients of an element are added (the one process's kernels sum the whole
// batch in double and round once; each rank rounds its shard's sum and MPI adds the two floats), a
// few ulps of the gradient, carried by lr and momentum over the steps. Here 2 steps (mpi_ddp_test
// takes 4) of a model without BatchNorm, at lr 0.05 (its 0.1).
constexpr double kAbsolute = 1e-5, kRelative = 1e-5;

// The largest |a - b| over every f32 tensor of two checkpoints, and whether every element is within
// kAbsolute + kRelative |b|; names the first element outside.
struct Comparison {
  double largest = 0;
  std::string first_outside;
};
Comparison compare_checkpoints(const std::string& a_path, const std::string& b_path) {
  const cudp::SafetensorsFile a = cudp::load_safetensors(a_path),
                              b = cudp::load_safetensors(b_path);
  Comparison c;
  EXPECT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, ta] : a.tensors) {
    const auto it = b.tensors.find(name);
    if (it == b.tensors.end()) {
      ADD_FAILURE() << name << " is in " << a_path << " but not in " << b_path;
      continue;
    }
    if (ta.dtype() != cudp::DType::f32) continue;
    const std::vector<float> x = ta.to_vector<float>(), y = it->second.to_vector<float>();
    EXPECT_EQ(x.size(), y.size()) << name;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      const double d = std::abs(double(x[i]) - double(y[i]));
      c.largest = std::max(c.largest, d);
      if (c.first_outside.empty() && !(d <= kAbsolute + kRelative * std::abs(double(y[i])))) {
        c.first_outside = name + " element " + std::to_string(i) + ": " + std::to_string(x[i]) +
                          " vs " + std::to_string(y[i]);
      }
    }
  }
  return c;
}

TEST(VggMpi, TwoRanksAreOneProcessOnTheGlobalBatch) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string model = kSmall + "--no-bn --dropout 0 --schedule constant --epochs 1 ";
  const std::string out = dir / "run", json = dir / "log.json";
  const RunResult ddp =
      run_ranks(dir, 2, model + "--batch-size 4 --output '" + out + "' --json '" + json + "'");
  ASSERT_EQ(ddp.code, 0) << ddp.output;
  EXPECT_TRUE(contains(ddp.output, "processes: 2")) << ddp.output;
  EXPECT_TRUE(contains(ddp.output,
                       "8 of the 16 train images per epoch, batches of 4 (global "
                       "batch 8)"))
      << ddp.output;
  // Rank 0 alone prints: every line once.
  EXPECT_EQ(count_of(ddp.output, " visible GPU(s)"), 1u) << ddp.output;
  EXPECT_EQ(count_of(ddp.output, "epoch 1/1: train loss"), 1u) << ddp.output;
  EXPECT_EQ(count_of(ddp.output, "checksum "), 1u) << ddp.output;
  EXPECT_FALSE(contains(ddp.output, "rank 1")) << ddp.output;
  // ... and alone writes: one epoch record in the log and in metrics.csv, which two writers
  // appending to the same files would double.
  EXPECT_EQ(count_of(read_text(json), "\"event\":\"epoch\""), 1u) << read_text(json);
  EXPECT_EQ(count_of(read_text(out + "/metrics.csv"), "\n"), 2u) << read_text(out + "/metrics.csv");
  const cudp::Metadata meta = cudp::load_checkpoint_metadata(out + "/last.safetensors");
  EXPECT_EQ(meta.at("world_size"), "2");
  EXPECT_EQ(meta.at("sampler_epoch"), "1");

  // --on-nan skip-step makes its skip flag from the ranks' summed loss (a collective of its own
  // each step, so that every rank skips the same steps): with nothing to skip, the same weights.
  const std::string with_skips = model + "--batch-size 4 --on-nan skip-step";
  const RunResult skipping = run_ranks(dir, 2, with_skips);
  ASSERT_EQ(skipping.code, 0) << skipping.output;
  EXPECT_EQ(checksum_of(skipping), checksum_of(ddp)) << skipping.output;
  // A NaN loss on one rank alone (the trainer's test hook CUDP_TEST_NAN_LOSS, at the epoch's last
  // step; the gradients stay finite, so the global gradient norm cannot tell): every rank skips
  // that step, so rank 0's weights (the checksum it prints) are the same whichever rank's loss it
  // was, and not those of the run that skipped nothing.
  const RunResult nan_on_0 = run_ranks(dir, 2, with_skips, "CUDP_TEST_NAN_LOSS=0:2 ");
  const RunResult nan_on_1 = run_ranks(dir, 2, with_skips, "CUDP_TEST_NAN_LOSS=1:2 ");
  ASSERT_EQ(nan_on_0.code, 0) << nan_on_0.output;
  ASSERT_EQ(nan_on_1.code, 0) << nan_on_1.output;
  EXPECT_TRUE(contains(nan_on_0.output, "the loss is NaN; update skipped")) << nan_on_0.output;
  EXPECT_TRUE(contains(nan_on_1.output,
                       "another rank's loss is not finite (the ranks' sum is NaN); "
                       "update skipped"))
      << nan_on_1.output;
  EXPECT_NE(checksum_of(nan_on_0), checksum_of(skipping)) << "the step was not skipped";
  EXPECT_EQ(checksum_of(nan_on_1), checksum_of(nan_on_0))
      << "rank 0 did not skip the step of rank 1's NaN loss:\n"
      << nan_on_1.output;

  const std::string one = dir / "one.safetensors";
  const RunResult single = run_one(dir, model + "--batch-size 8 --checkpoint '" + one + "'");
  ASSERT_EQ(single.code, 0) << single.output;
  const Comparison c = compare_checkpoints(out + "/last.safetensors", one);
  EXPECT_EQ(c.first_outside, "") << "2 ranks differ from one process on the same global batch";
  std::printf("largest |2 ranks - 1 process| after 2 steps: %.3g\n", c.largest);

  // The comparison can fail: one process on batches of 4 (another training) is far outside it.
  const std::string other = dir / "other.safetensors";
  const RunResult half = run_one(dir, model + "--batch-size 4 --checkpoint '" + other + "'");
  ASSERT_EQ(half.code, 0) << half.output;
  const Comparison h = compare_checkpoints(out + "/last.safetensors", other);
  EXPECT_NE(h.first_outside, "") << "another batch size passed for the same training";
  EXPECT_GT(h.largest, 1e-3);
}

TEST(VggMpi, ResumeOnTwoRanksIsExact) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string common = kSmall + "--batch-size 4 --schedule onecycle --epochs 2 ";
  const std::string a = dir / "a.safetensors", b = dir / "b.safetensors";
  const RunResult straight = run_ranks(dir, 2, common + "--checkpoint '" + a + "'");
  ASSERT_EQ(straight.code, 0) << straight.output;
  const std::string sum = checksum_of(straight);
  ASSERT_NE(sum, "") << straight.output;

  const RunResult first = run_ranks(dir, 2, common + "--stop-after 1 --checkpoint '" + b + "'");
  ASSERT_EQ(first.code, 0) << first.output;
  EXPECT_NE(checksum_of(first), sum) << "one epoch left the weights as two did";
  EXPECT_EQ(cudp::load_checkpoint_metadata(b).at("world_size"), "2");

  // Another number of processes is refused, naming both.
  const RunResult alone = run_one(dir, common + "--resume '" + b + "'");
  EXPECT_EQ(alone.code, 2) << alone.output;
  EXPECT_TRUE(contains(alone.output, "written by a run of 2 process(es), this run has 1"))
      << alone.output;
  EXPECT_TRUE(contains(alone.output, "mpirun -np 2")) << alone.output;

  const RunResult second = run_ranks(dir, 2, common + "--resume '" + b + "'");
  ASSERT_EQ(second.code, 0) << second.output;
  EXPECT_TRUE(contains(second.output, "resumed from")) << second.output;
  EXPECT_FALSE(contains(second.output, "epoch 1/2:")) << second.output;
  EXPECT_TRUE(contains(second.output, "epoch 2/2:")) << second.output;
  EXPECT_EQ(checksum_of(second), sum) << "the resumed 2-rank run differs from the straight one:\n"
                                      << second.output;
}

// The runs the --sync-bn and --accumulate tests compare, each made once per test program (the
// same configuration serves several comparisons), in a folder named after the first test that asks.
class SharedRuns {
 public:
  struct Run {
    RunResult result;
    std::string checkpoint;
  };
  // cudp-vgg `args` as `ranks` processes (1: without mpirun), writing a checkpoint.
  const Run& get(int ranks, const std::string& args) {
    const std::string key = std::to_string(ranks) + " " + args;
    auto it = runs_.find(key);
    if (it != runs_.end()) return it->second;
    Run run;
    run.checkpoint = dir_ / ("run" + std::to_string(runs_.size()) + ".safetensors");
    const std::string all = args + " --checkpoint '" + run.checkpoint + "'";
    run.result = ranks == 1 ? run_one(dir_, all) : run_ranks(dir_, ranks, all);
    return runs_.emplace(key, std::move(run)).first->second;
  }

 private:
  TempDir dir_;
  std::map<std::string, Run> runs_;
};

SharedRuns& shared_runs() {
  static SharedRuns runs;
  return runs;
}

// BatchNorm on, Dropout off (each rank draws its own rows' masks), 2 steps of 8 images.
const std::string kBn = kSmall + "--dropout 0 --schedule constant --epochs 1 ";
const std::string kNoBn = kSmall + "--no-bn --dropout 0 --schedule constant --epochs 1 ";

// --sync-bn on 2 ranks against one process with plain BatchNorm on the same global batches: the
// same images (rank r holds positions r, r + 2, ... of the one process's order), normalised with
// the whole batch's statistics on both sides. Why the tolerance holds:
// tests/parallel/mpi_sync_batchnorm_test.cpp pins SyncBatchNorm2d across processes to its
// participants in one process bit for bit, and bounds what separates them from one BatchNorm2d:
// each layer's summaries rounded once to f32 and merged, its backward sums rounded once per rank,
// roundings of a few u = 2^-24 of the normalised values that carry through the layers and the
// steps as rounding errors do (that test's kNetAbsolute derivation; the gradients' order is
// mpi_ddp_test.cpp's, as in TwoRanksAreOneProcessOnTheGlobalBatch). The same holds for VGG-11's
// 8 normalisations over 2 steps at lr 0.05: the largest difference seen is 1.2e-7 (0.6% of the
// bound), in a running variance of 1.0. Plain BatchNorm on each rank normalises a shard by its own
// 4 images' statistics, another function: its checkpoint is off by 0.09.
TEST(VggMpi, SyncBatchNormOnTwoRanksIsBatchNormOnTheGlobalBatch) {
  CUDP_REQUIRE_VGG();
  SharedRuns& runs = shared_runs();
  const auto& sync = runs.get(2, kBn + "--sync-bn --batch-size 4");
  ASSERT_EQ(sync.result.code, 0) << sync.result.output;
  EXPECT_TRUE(contains(sync.result.output,
                       "SyncBatchNorm: training normalises with the statistics "
                       "of the whole batch over all 2 processes"))
      << sync.result.output;
  const auto& one = runs.get(1, kBn + "--batch-size 8");
  ASSERT_EQ(one.result.code, 0) << one.result.output;
  const Comparison c = compare_checkpoints(sync.checkpoint, one.checkpoint);
  EXPECT_EQ(c.first_outside, "") << "2 ranks with --sync-bn differ from one process";
  std::printf("largest |2 ranks --sync-bn - 1 process| after 2 steps: %.3g\n", c.largest);

  // The comparison can fail: BatchNorm per rank (no --sync-bn) is far outside it.
  const auto& plain = runs.get(2, kBn + "--batch-size 4");
  ASSERT_EQ(plain.result.code, 0) << plain.result.output;
  const Comparison p = compare_checkpoints(plain.checkpoint, one.checkpoint);
  EXPECT_NE(p.first_outside, "") << "per-rank BatchNorm passed for SyncBatchNorm";
  EXPECT_GT(p.largest, 1e-3);
  std::printf("largest |2 ranks, BatchNorm per rank - 1 process|: %.3g\n", p.largest);
}

// --accumulate 2 on 2 ranks: each rank runs its 4 images as 2 micro-batches of 2, the first under
// no_sync, each weighted by its n_j / n_r times the rank's loss_weight n_r / B.
//   - Without BatchNorm that is the gradient of the same global batch: the same training as 2 ranks
//     without --accumulate, within TwoRanksAreOneProcessOnTheGlobalBatch's tolerance (the runs
//     differ only in how an element's 4 shard gradients are added: each rank adds its 2 micro-
//     batches' in the kernels, then MPI the 2 ranks', against one kernel sum per rank; the same
//     few ulps). A micro-batch weighted by n_j / n_r alone would double the gradient: far outside.
//   - With --sync-bn, micro-batch j of every rank together is micro-batch j of one process with
//     --accumulate 2 (rank r's 2 rows of it are positions r and r + 2 of the one process's 4), so
//     the two normalise the same rows: within SyncBatchNormOnTwoRanks's tolerance. It can fail: 2
//     ranks that did not split their batch (no --accumulate) normalise all 8 images at once, far
//     outside it.
TEST(VggMpi, AccumulateOnTwoRanksSplitsAsOneProcessDoes) {
  CUDP_REQUIRE_VGG();
  SharedRuns& runs = shared_runs();
  const auto& accumulated = runs.get(2, kNoBn + "--batch-size 4 --accumulate 2");
  ASSERT_EQ(accumulated.result.code, 0) << accumulated.result.output;
  EXPECT_EQ(count_of(accumulated.result.output,
                     "gradient accumulation: each batch as 2 "
                     "micro-batches"),
            1u)
      << accumulated.result.output;
  const auto& whole = runs.get(2, kNoBn + "--batch-size 4");
  ASSERT_EQ(whole.result.code, 0) << whole.result.output;
  const Comparison a = compare_checkpoints(accumulated.checkpoint, whole.checkpoint);
  EXPECT_EQ(a.first_outside, "") << "--accumulate 2 on 2 ranks changed the training";
  std::printf("largest |2 ranks --accumulate 2 - 2 ranks| (no BatchNorm): %.3g\n", a.largest);

  const auto& sync_accumulated = runs.get(2, kBn + "--sync-bn --batch-size 4 --accumulate 2");
  ASSERT_EQ(sync_accumulated.result.code, 0) << sync_accumulated.result.output;
  const auto& one_accumulated = runs.get(1, kBn + "--batch-size 8 --accumulate 2");
  ASSERT_EQ(one_accumulated.result.code, 0) << one_accumulated.result.output;
  const Comparison b = compare_checkpoints(sync_accumulated.checkpoint, one_accumulated.checkpoint);
  EXPECT_EQ(b.first_outside, "") << "2 ranks with --sync-bn --accumulate 2 differ from one process "
                                    "with --accumulate 2";
  std::printf("largest |2 ranks --sync-bn --accumulate 2 - 1 process --accumulate 2|: %.3g\n",
              b.largest);

  const auto& sync_whole = runs.get(2, kBn + "--sync-bn --batch-size 4");
  ASSERT_EQ(sync_whole.result.code, 0) << sync_whole.result.output;
  const Comparison w = compare_checkpoints(sync_whole.checkpoint, one_accumulated.checkpoint);
  EXPECT_NE(w.first_outside, "") << "batch norm over the whole batch passed for micro-batches";
  EXPECT_GT(w.largest, 1e-3);
  std::printf("largest |2 ranks --sync-bn, no accumulation - 1 process --accumulate 2|: %.3g\n",
              w.largest);
}

// A rank's error names the rank, every rank's exit ends the job, and mpirun passes the exit code
// on: --gpus with a list is refused (each rank drives the GPU of its local rank).
TEST(VggMpi, ErrorsNameTheRank) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const RunResult r = run_ranks(dir, 2, "--gpus 0 --data synthetic");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "cudp-vgg: rank 0 of 2: --gpus with several processes"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "cudp-vgg: rank 1 of 2: --gpus with several processes"))
      << r.output;
}

}  // namespace
