// bench_train: VGG training throughput of cudp's engine: img/s on 1..N GPUs at 224^2 (batch 64 per
// GPU, torchvision head, 1000 classes) and 32^2 (batch 256 per GPU, compact head, 10 classes), with
// the products in fp32, tf32 or bf16 (--precision; layers/precision.h: the model's
// set_precision), SGD with momentum, the data already on the first GPU (the input pipeline is
// measured by cudp-vgg). --bn puts a BatchNorm2d after every convolution (VGG-16-BN, the model
// cudp-vgg trains by default; per-device statistics, no SyncBatchNorm): "bn" in the JSON, "-bn"
// after the model's name in the table.
//
// Per configuration: build the model from a fixed seed, wrap it in DataParallel over the first g
// GPUs, run `--warmup` steps, then `--repeats` windows (5) of `--steps` timed steps (10), each
// between a device synchronisation and the next (host clock): img/s = global batch * steps /
// seconds of the median window ("window_images_per_s" in the JSON lists every window's, in order,
// so their spread is on record). Also reported: peak memory per GPU and
// the time of the gradient all-reduce alone (NCCL on the flat gradient buffer, timed separately).
// One JSON object per configuration with --json, each with "processes" (1 here).
//
// Several processes, one GPU each (DistributedDataParallel): started by a launcher with N > 1
// processes (`mpirun -np N bench_train ...`, srun), bench_train runs as one rank of N and measures
// that configuration only. MPI starts the ranks; each drives the GPU of its local rank (as cudp-vgg
// does; --gpus N is refused), builds the model from the same seed, wraps it in
// DistributedDataParallel over NCCL (ProcessGroup::from_mpi, nccl_group) and trains on its own
// batch of --batch-per-gpu images, its loss weighted by its share of the global batch, 1/N. The
// timed steps start after a barrier and end with each rank's device synchronised; the seconds are
// the slowest rank's (gathered over MPI): img/s = batch per GPU * N * steps / seconds. Rank 0
// prints and writes the JSON ("processes": N, "gpus": N); the other ranks print nothing. With
// --graphs on every rank replays a CUDA graph of its step, the collectives inside it, each launch
// watched by the collective watchdog (Communicator::watch_graph_launch). --processes N only checks
// that the launch is the one meant: without a launcher it is a usage error naming the mpirun
// command. scripts/bench-report.sh runs `mpirun -np <GPUs> bench_train` after the one-process
// runs, and bench/report.py sets its rows against one process on as many GPUs with the same
// graphs setting.
//
// --gpus none: the CPU, for tests on machines without a GPU: one process (the model as it is, no
// wrapper), or N processes under a launcher with MPI moving the gradients (mpi_host_group); graphs
// off, no peak memory; "gpus": 0 in the JSON. --batch-per-gpu sets the batch of each GPU (of each
// process on the CPU), 256 at 32^2 and 64 at 224^2 by default. The CPU runs every precision: the
// layers emulate there bf16's operand rounding and TF32's truncation (layers/precision.h).
//
// Exposed communication (--exposed-comm on, the default): each multi-GPU configuration is timed a
// second time with the gradient all-reduce switched off (set_gradient_sync(false) of DataParallel
// or DistributedDataParallel: the same forward, backward and optimizer kernels, no all-reduce; with
// --overlap-update on, the reducer marking its buckets without summing them, so that the update
// still runs beside the backward), and
// the difference of the two step times, as a fraction of the step with communication, is the
// communication the step leaves exposed (what the bucketed all-reduce did not hide behind the
// backward). JSON fields "step_ms_no_comm" and "cudp_exposed_comm_share" on multi-GPU rows.
//
// --graphs on off: each configuration with its steps replayed from a CUDA graph (GraphedStep,
// layers/train.h: two eager warm-up steps, the capture, then replays; at least 3 untimed steps) and
// launched kernel by kernel; JSON field "cudp_graphs".
//
// --zero-grad deferred (the default, as train_step and cudp-vgg) or fill: how each step's
// zero_grad leaves the gradients (Optimizer::zero_grad); JSON field "cudp_zero_grad".
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/cli.h"
#include "common/timing.h"
#include "engine/core/launch.h"
#include "engine/core/memory.h"
#include "engine/core/nvtx.h"
#include "engine/core/stream.h"
#include "engine/parallel/data_parallel.h"
#include "engine/parallel/ddp.h"
#include "engine/parallel/mpi_bootstrap.h"
#include "kernels/batchnorm.h"
#include "kernels/bias.h"
#include "kernels/conv2d.h"
#include "kernels/conv2d_dense.h"
#include "kernels/matmul.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/train.h"
#include "layers/vgg.h"

namespace {

using namespace cudp;
using bench::kExitUsage;
using bench::UsageError;
using Clock = std::chrono::steady_clock;

constexpr int kExitFailure = 1;

// This process's place in a multi-process launch (mpirun -np N bench_train ...): rank 0 of 1
// without one.
struct Ranks {
  int rank = 0, world = 1, local_rank = 0;
  std::unique_ptr<parallel::mpi::Session> session;        // MPI, for every multi-process run
  std::shared_ptr<parallel::ProcessGroup> process_group;  // NCCL, when the ranks drive GPUs

  bool distributed() const { return world > 1; }
  void barrier() const {
    if (distributed()) session->barrier();
  }
  // The largest `value` over the ranks (collective: every rank calls it at the same point).
  double max(double value) const {
    if (!distributed()) return value;
    std::vector<double> all(static_cast<size_t>(world));
    session->all_gather(&value, sizeof value, all.data());
    return *std::max_element(all.begin(), all.end());
  }
  // NCCL, then MPI (MPI_Finalize), in that order.
  void finish() {
    process_group.reset();
    session.reset();
  }
};
Ranks g_ranks;
// --zero-grad: how each step's zero_grad leaves the gradients (Optimizer::zero_grad).
ZeroGrad g_zero_grad = ZeroGrad::deferred;
// --overlap-update: each bucket's SGD update beside the rest of the backward
// (Replicated::set_update_overlap).
bool g_overlap_update = false;
// --splitk: where a tensor-core product split along k adds its splits up; JSON field "cudp_splitk".
std::string g_splitk = "kernel4";
// --bias-final: the bias gradients' last launches queued through a backward and run as one, or
// one each; JSON field "cudp_bias_final".
std::string g_bias_final = "batched";

struct Options {
  std::vector<std::string> archs = {"vgg16"};
  std::vector<std::string> precisions = {"fp32"};
  bool bn = false;  // a BatchNorm2d after every convolution
  std::vector<std::string> graph_modes = {"on", "off"};
  bool graphs_given = false;  // --graphs on the command line (not the default)
  std::vector<int> sizes = {224, 32};
  std::string gpus;           // "": all visible; "none": the CPU; else the largest GPU count
  int64_t batch_per_gpu = 0;  // 0: 256 at 32^2, 64 at 224^2
  int processes = 0;          // 0: whatever the launch is
  int warmup = 3, steps = 10;
  int repeats = 5;  // timed windows of `steps` steps; the figures are the median window's
  std::string json, exposed_comm = "on";
};

struct Config {
  std::string arch;
  int size;
  int64_t batch_per_gpu;  // of each GPU, or of each process on the CPU
  Precision precision;
  bool graphs;
  bool bn;
  bool comm = true;  // false: gradient all-reduce switched off (exposed-communication timing)
};

struct Result {
  double images_per_s = 0, step_ms = 0, allreduce_ms = 0;  // the median window's img/s and step
  std::vector<double> window_images_per_s;                 // every timed window's, in order
  double peak_gib = -1;         // the largest over the GPUs (and ranks); -1 on the CPU
  double step_ms_no_comm = -1;  // the same step with the all-reduce off (multi-GPU rows)
  int64_t parameters = 0;       // the model's (BatchNorm's weight and bias included)
};

// VGG's configuration letter of an --arch name; a name it does not know is refused, never measured
// as another model.
char arch_config(const std::string& arch) {
  if (arch == "vgg11") return 'A';
  if (arch == "vgg13") return 'B';
  if (arch == "vgg16") return 'D';
  if (arch == "vgg19") return 'E';
  throw UsageError("--arch " + arch + ": give vgg11, vgg13, vgg16 or vgg19");
}

// One configuration on `ids`, the GPUs of this process (empty: the CPU): DataParallel over them,
// or, under a launcher, DistributedDataParallel over the ranks (one GPU or the CPU each).
Result run(const Config& c, const std::vector<int>& ids, int warmup, int steps, int repeats) {
  const bool ranks = g_ranks.distributed();
  const Device device = ids.empty() ? Device::cpu() : Device::cuda(ids[0]);
  const auto synchronize = [&ids] {
    for (int g : ids) cuda::synchronize(g);
  };
  for (int g : ids) {
    cuda::synchronize(g);
    cuda::reset_peak_memory_stats(g);
  }
  VggOptions o;
  o.in_channels = 3;
  o.batch_norm = c.bn;
  o.head = c.size == 32 ? VggHead::Compact : VggHead::Torchvision;
  o.num_classes = c.size == 32 ? 10 : 1000;
  o.seed = 1;  // the same model on every rank (DistributedDataParallel broadcasts rank 0's anyway)
  auto net = vgg(arch_config(c.arch), o);
  net->set_precision(c.precision);
  net->to(device);
  Result r;
  r.parameters = net->num_parameters();
  std::unique_ptr<parallel::DataParallel> dp;
  std::unique_ptr<DistributedDataParallel> ddp;
  if (ranks) {
    net->set_input_grad(false);
    // With --overlap-update on the step without communication keeps its buckets going, unsummed,
    // so that its update still runs beside the backward: the step with communication differs
    // from it by the all-reduce alone.
    const bool quiet = g_overlap_update && !c.comm;
    parallel::DistributedDataParallelOptions options;
    options.reducer.sum = !quiet;
    ddp = std::make_unique<DistributedDataParallel>(
        net,
        g_ranks.process_group ? parallel::nccl_group(g_ranks.process_group)
                              : parallel::mpi_host_group(*g_ranks.session),
        options);
    ddp->set_gradient_sync(c.comm || quiet);
  } else if (!ids.empty()) {
    dp = std::make_unique<parallel::DataParallel>(net, ids);
    if (g_overlap_update && !c.comm) {  // as above
      parallel::ReducerOptions quiet = dp->reducer_options();
      quiet.sum = false;
      dp->set_reducer_options(quiet);
    } else {
      dp->set_gradient_sync(c.comm);  // before any step: a captured graph keeps it
    }
  }
  // On the CPU in one process: the module as it is (DataParallel given no device list would take
  // every visible GPU).
  Module& model = dp ? static_cast<Module&>(*dp) : ddp ? static_cast<Module&>(*ddp) : *net;
  model.set_input_grad(false);  // as the trainer: the images need no gradient
  parallel::Replicated<SGD> opt(model, {.lr = 0.01, .momentum = 0.9, .weight_decay = 5e-4});
  if (g_overlap_update) {
    CUDP_CHECK(!ids.empty(),
               "--overlap-update on needs GPUs: on the CPU the buckets' updates would run one "
               "after another once the backward is done, with nothing to overlap");
    if (dp) {
      opt.set_update_overlap(*dp, true);
    } else {
      opt.set_update_overlap(*ddp, true);
    }
  }
  CrossEntropyLoss criterion;
  const int64_t batch = c.batch_per_gpu * std::max<int64_t>(1, static_cast<int64_t>(ids.size()));
  Tensor images = Tensor::empty({batch, c.size, c.size, 3}, DType::f32, device);
  images.normal_(0.f, 1.f, 7 + static_cast<uint64_t>(g_ranks.rank));  // each rank its own images
  std::vector<int32_t> host_labels(batch);
  for (int64_t i = 0; i < batch; ++i) host_labels[i] = static_cast<int32_t>(i % o.num_classes);
  const Tensor labels = Tensor::from_vector(host_labels, {batch}, device);
  // Under DistributedDataParallel this rank's mean loss is weighted by its share of the global
  // batch, 1/N (every rank has the same batch; engine/parallel/ddp.h), so that the summed
  // gradients are the global batch's.
  const double loss_weight = ranks ? 1.0 / static_cast<double>(g_ranks.world) : 1.0;
  const auto body = [&](const Tensor& x, const Tensor& y) {
    const Tensor out = model.forward(x);
    const Tensor loss = criterion.forward(out, y, loss_weight);
    opt.zero_grad(g_zero_grad);
    model.backward(criterion.backward());
    opt.step();
    return TensorList{loss};
  };
  // Under DistributedDataParallel on GPUs the graph holds the step's collectives: each launch is
  // watched as an eager collective is (Communicator::watch_graph_launch).
  GraphedStep graphed(body, device,
                      {.warmup_steps = GraphedStepOptions{}.warmup_steps,
                       .enabled = c.graphs,
                       .before_replay = [&opt] { opt.follow_primary(); },
                       .after_launch = ranks && g_ranks.process_group
                                           ? g_ranks.process_group->comm().launch_watcher(
                                                 "a replayed training step")
                                           : std::function<void()>{}},
                      ids);
  auto step = [&] {
    const nvtx::Range range("training step");
    graphed.run(images, labels);
  };
  // With graphs: the warm-up steps, the capture (and its first replay) stay untimed.
  const int untimed = c.graphs ? std::max(warmup, GraphedStepOptions{}.warmup_steps + 1) : warmup;
  for (int i = 0; i < untimed; ++i) step();
  synchronize();
  // `repeats` timed windows of `steps` steps, each between device synchronisations; the figures
  // are the median window's (the mean of the two middle ones for an even count), so that one
  // window disturbed by something else on the machine does not move them.
  const double window_images = static_cast<double>(batch) * g_ranks.world * steps;
  std::vector<double> windows;
  for (int w = 0; w < repeats; ++w) {
    g_ranks.barrier();  // the ranks start each window together
    const auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i) step();
    synchronize();
    // The slowest rank's time (a collective: it also ends the window on every rank).
    windows.push_back(g_ranks.max(std::chrono::duration<double>(Clock::now() - t0).count()));
    r.window_images_per_s.push_back(window_images / windows.back());
  }
  // What was timed is what was asked for: the update beside the backward did run (the
  // exposed-communication timing's too: its buckets go on unsummed).
  CUDP_CHECK(!g_overlap_update || opt.last_step_overlapped(),
             "--overlap-update on: the timed steps updated the parameters after the backward; "
             "the model's gradients do not go through one reducer");
  const double seconds = cudp::bench::median(windows);
  r.step_ms = 1e3 * seconds / steps;
  r.images_per_s = window_images / seconds;
  criterion.check_labels();
  if (!ids.empty()) {
    double peak = 0;
    for (int g : ids) peak = std::max(peak, cuda::max_memory_allocated(g) / double(1 << 30));
    r.peak_gib = g_ranks.max(peak);
  }

  // The gradient all-reduce alone, on the same communicator: DataParallel's flat gradient buffer;
  // under DistributedDataParallel (whose buffer is its own) one of the same size, through NCCL or,
  // on the CPU, MPI as its reducer calls them.
  const int reps = 10;
  if (dp && ids.size() > 1 && c.comm) {
    const auto t1 = Clock::now();
    for (int i = 0; i < reps; ++i) dp->replicas()->all_reduce_gradients();
    synchronize();
    r.allreduce_ms = 1e3 * std::chrono::duration<double>(Clock::now() - t1).count() / reps;
  } else if (ddp && c.comm) {
    const int64_t n = net->num_parameters();
    Tensor grads = Tensor::zeros({n}, DType::f32, device);
    synchronize();
    g_ranks.barrier();
    const auto t1 = Clock::now();
    for (int i = 0; i < reps; ++i) {
      if (g_ranks.process_group) {
        g_ranks.process_group->comm().all_reduce({grads});
      } else {
        g_ranks.session->all_reduce_sum(grads.data<float>(), static_cast<size_t>(n));
      }
    }
    synchronize();
    r.allreduce_ms =
        1e3 * g_ranks.max(std::chrono::duration<double>(Clock::now() - t1).count()) / reps;
  }
  return r;
}

// What one row says: the configuration, the number of processes and GPUs (0: the CPU), and the
// figures; `scaling` and `exposed` below 0 when not measured.
struct Row {
  std::string arch;
  bool bn;
  std::string precision, graphs;
  int size;
  int64_t per_gpu;
  int processes, gpus;
  Result r;
  double scaling = -1, exposed = -1;
};

void print_header() {
  std::printf(
      "| model | precision | graphs | image | batch/GPU | processes | GPUs | img/s | step ms | "
      "scaling | all-reduce ms | step ms, no comm | exposed comm | peak GiB |\n"
      "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
}

// `value` with `digits` decimals, and `suffix`; "-" when not `known`.
std::string fixed(bool known, double value, int digits, const char* suffix = "") {
  if (!known) return "-";
  char text[64];
  std::snprintf(text, sizeof text, "%.*f%s", digits, value, suffix);
  return text;
}

void print_row(const Row& w, FILE* json) {
  const Result& r = w.r;
  const std::string gpus = w.gpus > 0 ? std::to_string(w.gpus) : "0 (CPU)";
  const std::string scaling = fixed(w.scaling >= 0, w.scaling, 2);
  const std::string no_comm = fixed(w.exposed >= 0, r.step_ms_no_comm, 1);
  const std::string share = fixed(w.exposed >= 0, 100 * w.exposed, 1, "%");
  const std::string peak = fixed(r.peak_gib >= 0, r.peak_gib, 2);
  const std::string model = w.arch + (w.bn ? "-bn" : "");
  std::printf("| %s | %s | %s | %d | %lld | %d | %s | %.0f | %.1f | %s | %.2f | %s | %s | %s |\n",
              model.c_str(), w.precision.c_str(), w.graphs.c_str(), w.size,
              static_cast<long long>(w.per_gpu), w.processes, gpus.c_str(), r.images_per_s,
              r.step_ms, scaling.c_str(), r.allreduce_ms, no_comm.c_str(), share.c_str(),
              peak.c_str());
  std::fflush(stdout);
  if (!json) return;
  std::string extra;
  if (w.scaling >= 0) extra += ", \"scaling\": " + fixed(true, w.scaling, 3);
  extra += ", \"repeats\": " + std::to_string(r.window_images_per_s.size()) +
           ", \"window_images_per_s\": [";
  for (size_t i = 0; i < r.window_images_per_s.size(); ++i) {
    extra += (i ? ", " : "") + fixed(true, r.window_images_per_s[i], 1);
  }
  extra += "]";
  if (r.peak_gib >= 0) extra += ", \"peak_gib\": " + fixed(true, r.peak_gib, 3);
  if (w.exposed >= 0) {
    extra += detail::str(", \"step_ms_no_comm\": ", r.step_ms_no_comm,
                         ", \"cudp_exposed_comm_share\": ", w.exposed);
  }
  std::fprintf(
      json,
      "{\"framework\": \"cudp\", \"model\": \"%s\", \"bn\": %s, \"cudp_precision\": \"%s\", "
      "\"cudp_graphs\": \"%s\", \"size\": %d, \"batch_per_gpu\": %lld, "
      "\"processes\": %d, \"gpus\": %d, \"parameters\": %lld, \"images_per_s\": %.1f, "
      "\"step_ms\": %.3f, \"allreduce_ms\": %.3f, \"cudp_zero_grad\": \"%s\", "
      "\"cudp_overlap_update\": \"%s\", \"cudp_splitk\": \"%s\", \"cudp_bias_final\": \"%s\", "
      "\"cudp_dense_2x2\": \"%s\", \"cudp_dense_2x2_view\": \"%s\", "
      "\"cudp_dense_2x2_splits\": %d, \"cudp_dense_2x2_tile\": %d%s}\n",
      w.arch.c_str(), w.bn ? "true" : "false", w.precision.c_str(), w.graphs.c_str(), w.size,
      static_cast<long long>(w.per_gpu), w.processes, w.gpus, static_cast<long long>(r.parameters),
      r.images_per_s, r.step_ms, r.allreduce_ms,
      g_zero_grad == ZeroGrad::fill ? "fill" : "deferred", g_overlap_update ? "on" : "off",
      g_splitk.c_str(), g_bias_final.c_str(), kernels::detail::conv_dense_2x2() ? "on" : "off",
      kernels::detail::conv_dense_2x2_view() ? "on" : "off",
      kernels::detail::conv_dense_2x2_splits(), kernels::detail::conv_dense_2x2_tile(),
      extra.c_str());
  std::fflush(json);
}

// Under a launcher that started more than one process (mpirun, srun): MPI, this process's rank,
// and its standard output sent to /dev/null unless it is rank 0. --processes is checked against
// the launch.
void join_ranks(const Options& o) {
  const parallel::LaunchInfo env = parallel::launch_info_from_env();
  if (env.world_size <= 1) {
    if (o.processes > 1) {
      const std::string n = std::to_string(o.processes);
      throw UsageError("--processes " + n +
                       ": several processes are the ranks a launcher starts, one GPU each: run "
                       "`mpirun -np " +
                       n + " bench_train ...` (--processes may then be left out)");
    }
    return;
  }
  if (!parallel::mpi::available()) {
    throw UsageError(detail::str(
        "this process is rank ", env.rank, " of ", env.world_size, " (", env.source,
        "), but this bench_train was built without MPI: rebuild with MPI (Debian: libopenmpi-dev, "
        "cmake -DCUDP_WITH_MPI=ON) to measure several processes, or run it as one process"));
  }
  g_ranks.session = std::make_unique<parallel::mpi::Session>();
  const parallel::LaunchInfo info = g_ranks.session->info();
  g_ranks.rank = info.rank;
  g_ranks.world = info.world_size;
  g_ranks.local_rank = info.local_rank;
  if (g_ranks.rank != 0 && !std::freopen("/dev/null", "w", stdout)) {
    CUDP_THROW(IoError, "rank ", g_ranks.rank, ": cannot send its standard output to /dev/null");
  }
  if (o.processes > 0 && o.processes != g_ranks.world) {
    throw UsageError(detail::str("--processes ", o.processes, ", but the launcher started ",
                                 g_ranks.world, " processes: launch `mpirun -np ", o.processes,
                                 " bench_train ...`, or leave --processes out"));
  }
}

int measure(Options o) {
  join_ranks(o);
  const bool ranks = g_ranks.distributed();
  const bool cpu = o.gpus == "none";
  int max_gpus = 0;
  if (!cpu && !o.gpus.empty()) {
    char* end = nullptr;
    const long n = std::strtol(o.gpus.c_str(), &end, 10);
    if (*end != '\0' || n < 1 || n > 1024) {
      throw UsageError("--gpus " + o.gpus + ": give a GPU count (1, 2, ...) or none (the CPU)");
    }
    max_gpus = static_cast<int>(n);
  }
  const int visible = cuda::device_count();
  std::vector<int> rank_gpu;  // under a launcher: this rank's GPU (none on the CPU)
  if (ranks && !cpu) {
    if (max_gpus > 0) {
      throw UsageError(
          "--gpus with several processes: each process drives one GPU, picked by its local rank; "
          "leave --gpus out (restrict them with CUDA_VISIBLE_DEVICES), or give --gpus none to "
          "measure on the CPU");
    }
    if (visible == 0) {
      throw UsageError(
          "this rank sees no CUDA device; make one GPU visible to each process, or give "
          "--gpus none to measure on the CPU with MPI moving the gradients");
    }
    rank_gpu.push_back(parallel::device_for_local_rank(g_ranks.local_rank, visible));
    g_ranks.process_group =
        parallel::ProcessGroup::from_mpi(*g_ranks.session, {}, rank_gpu.front());
  }
  if (!ranks && !cpu) {
    if (visible == 0) {
      throw UsageError(
          detail::str("no CUDA device is visible; give --gpus none to measure on the CPU (CUDA "
                      "says: ",
                      bench::cuda_device_problem(), ")"));
    }
    if (max_gpus == 0 || max_gpus > visible) max_gpus = visible;
  }
  // CUDA graphs need a GPU.
  if (cpu) {
    const bool asked = o.graphs_given && std::find(o.graph_modes.begin(), o.graph_modes.end(),
                                                   "on") != o.graph_modes.end();
    if (asked) {
      throw UsageError("--graphs on: CUDA graphs need a GPU; give --graphs off with --gpus none");
    }
    o.graph_modes = {"off"};
  }
  if (ranks) {
    std::printf(
        "bench_train: %d processes, each on %s (DistributedDataParallel, %s all-reduces "
        "the gradients)\n",
        g_ranks.world, cpu ? "the CPU" : "one GPU", cpu ? "MPI" : "NCCL");
  } else if (cpu) {
    std::printf("bench_train: one process on the CPU (--gpus none)\n");
  }
  FILE* out = nullptr;
  if (!o.json.empty() && g_ranks.rank == 0) {
    out = bench::open_json(o.json);
  }
  print_header();
  std::vector<std::pair<std::string, std::string>> runs;  // (precision, arch)
  for (const auto& name : o.precisions) {
    for (const auto& arch : o.archs) runs.emplace_back(name, arch);
  }
  for (const auto& [name, arch] : runs) {
    const Precision precision = parse_precision(name);
    for (int size : o.sizes) {
      for (const auto& mode : o.graph_modes) {
        const bool graphs = mode == "on";
        const int64_t per_gpu = o.batch_per_gpu > 0 ? o.batch_per_gpu : size == 32 ? 256 : 64;
        const Config config{arch, size, per_gpu, precision, graphs, o.bn};
        // Exposed communication: the same configuration without the all-reduce. The share is
        // clamped at 0 (a step without communication can time a little slower by noise).
        const auto with_exposed = [&](Row& w, const std::vector<int>& ids) {
          if (o.exposed_comm != "on") return;
          Config quiet = config;
          quiet.comm = false;
          w.r.step_ms_no_comm = run(quiet, ids, o.warmup, o.steps, o.repeats).step_ms;
          w.exposed = std::max(0.0, (w.r.step_ms - w.r.step_ms_no_comm) / w.r.step_ms);
        };
        if (ranks) {
          // N processes of one GPU each (or the CPU): no one-process baseline in this launch.
          Row w{arch,
                o.bn,
                name,
                mode,
                size,
                per_gpu,
                g_ranks.world,
                cpu ? 0 : g_ranks.world,
                run(config, rank_gpu, o.warmup, o.steps, o.repeats)};
          with_exposed(w, rank_gpu);
          print_row(w, out);
        } else if (cpu) {
          const Result r = run(config, {}, o.warmup, o.steps, o.repeats);
          Row w{arch, o.bn, name, mode, size, per_gpu, 1, 0, r};
          w.scaling = 1;
          print_row(w, out);
        } else {
          double one = 0;
          for (int g = 1; g <= max_gpus; ++g) {
            std::vector<int> ids;
            for (int i = 0; i < g; ++i) ids.push_back(i);
            const Result r = run(config, ids, o.warmup, o.steps, o.repeats);
            Row w{arch, o.bn, name, mode, size, per_gpu, 1, g, r};
            if (g > 1) with_exposed(w, ids);
            if (g == 1) one = w.r.images_per_s;
            w.scaling = w.r.images_per_s / (one * g);
            print_row(w, out);
          }
        }
      }
    }
  }
  if (out) std::fclose(out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_train: VGG training throughput on 1..N GPUs, or N processes of one GPU"};
  Options o;
  app.add_option("--arch", o.archs, "vgg11 vgg13 vgg16 vgg19")
      ->check(CLI::IsMember({"vgg11", "vgg13", "vgg16", "vgg19"}))
      ->capture_default_str();
  app.add_option("--size", o.sizes, "image sizes: 224 (batch 64/GPU) and/or 32 (batch 256/GPU)")
      ->check(CLI::IsMember({224, 32}))
      ->capture_default_str();
  app.add_option("--precision", o.precisions,
                 "fp32, tf32 and/or bf16 (tf32 and bf16: products on tensor cores, sm_90; on the "
                 "CPU their operand rounding is emulated)")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16"}))
      ->capture_default_str();
  app.add_flag("--bn", o.bn, "VGG with BatchNorm2d after every convolution (VGG-16-BN)");
  auto* graphs = app.add_option("--graphs", o.graph_modes,
                                "on and/or off: steps replayed from a CUDA graph, or launched "
                                "kernel by kernel (off only with several processes or the CPU)")
                     ->check(CLI::IsMember({"on", "off"}))
                     ->capture_default_str();
  app.add_option("--gpus", o.gpus,
                 "largest GPU count of one process (default: all visible), or none: the CPU "
                 "(under mpirun each process drives one GPU: leave it out)");
  app.add_option("--batch-per-gpu", o.batch_per_gpu,
                 "images per GPU (per process on the CPU); default 256 at 32, 64 at 224")
      ->check(bench::whole_number(1));
  app.add_option("--processes", o.processes,
                 "the number of processes, one GPU each, that the launcher started: measure "
                 "N processes with `mpirun -np N bench_train` (a check; default: the launch's)")
      ->check(bench::whole_number(1));
  app.add_option("--warmup", o.warmup, "untimed steps")
      ->check(bench::whole_number(0))
      ->capture_default_str();
  app.add_option("--steps", o.steps, "timed steps of each window")
      ->check(bench::whole_number(1))
      ->capture_default_str();
  app.add_option("--repeats", o.repeats,
                 "timed windows of --steps steps; img/s and step ms are the median window's (each "
                 "window's img/s in the JSON's window_images_per_s)")
      ->check(bench::whole_number(1))
      ->capture_default_str();
  app.add_option("--json", o.json, "write one JSON object per configuration here (rank 0)");
  app.add_option("--exposed-comm", o.exposed_comm,
                 "on: time each multi-GPU configuration again with the gradient all-reduce off; "
                 "the difference is the communication the step exposes (cudp_exposed_comm_share)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  std::string bias_handoff = "on";
  app.add_option("--bias-handoff", bias_handoff,
                 "on: the layer whose backward writes a convolution's output gradient (a max "
                 "pooling or convolution after its fused ReLU, a BatchNorm after it) adds up that "
                 "convolution's bias gradient on the way; off: the convolution takes it in a pass "
                 "of its own (to compare)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  std::string param_store = "on";
  app.add_option("--param-store", param_store,
                 "on: under bf16 the model keeps one flat bf16 copy of its weights, written by the "
                 "optimizer in the launch that updates them; off: each Conv2d and Linear converts "
                 "its weights at every forward (to compare)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  std::string bn_mask_handoff = "on";
  app.add_option(
         "--bn-mask-handoff", bn_mask_handoff,
         "on: with --bn, the layer after a BatchNorm's fused ReLU (pooling, convolution) "
         "masks the gradient, and BatchNorm neither keeps nor reads its output in backward; "
         "off: BatchNorm masks in its own backward (to compare)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  std::string bn_cluster = "off";
  app.add_option("--bn-cluster", bn_cluster,
                 "on: with --bn, each BatchNorm of at most 2^23 values (rows x channels) runs its "
                 "training forward and its backward in one launch each, a thread-block cluster "
                 "per channel group; off: three kernels each at every size (the default: the "
                 "one-launch path measured slower)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  std::string splitk = kernels::detail::splitk_in_kernel_enabled()   ? "in-kernel"
                       : kernels::detail::splitk_reduce_vectorized() ? "kernel4"
                                                                     : "kernel";
  app.add_option("--splitk", splitk,
                 "in-kernel: a tensor-core product split along k adds its splits up in its own "
                 "kernel (the last split of each tile's rows; measured slower); kernel: in a "
                 "reduction kernel after it, an element a thread; kernel4: that kernel four "
                 "columns a thread where the shapes allow, else an element a thread (the "
                 "default: measured 0.6-1.4% faster at 32²); the same bits in all three")
      ->check(CLI::IsMember({"in-kernel", "kernel", "kernel4"}))
      ->capture_default_str();
  std::string bias_final = kernels::detail::deferred_bias_grads() ? "batched" : "each";
  app.add_option("--bias-final", bias_final,
                 "batched: the last launch of each bias gradient taken as partial column sums "
                 "(pooling's and backward-data's hand-off, BatchNorm's dx pass, backward-weight's "
                 "fused sums) is queued through the backward and the queue runs as one launch at "
                 "its end or before a backward hook (the default); each: one launch each, as soon "
                 "as its partial sums are written; the same bits")
      ->check(CLI::IsMember({"batched", "each"}))
      ->capture_default_str();
  std::string zero_grad = "deferred";
  app.add_option("--zero-grad", zero_grad,
                 "deferred: zero_grad leaves the convolutions' and linear layers' weight "
                 "gradients to their backward, which writes them (no memset, no read-back); "
                 "fill: every gradient zeroed, then added to (to compare)")
      ->check(CLI::IsMember({"deferred", "fill"}))
      ->capture_default_str();
  std::string overlap_update = "off";
  app.add_option("--overlap-update", overlap_update,
                 "on: the SGD update of each gradient bucket runs on a stream of its own as soon "
                 "as the backward has completed (and, on several GPUs, all-reduced) that bucket, "
                 "beside the rest of the backward (the same bits); off: one update after the "
                 "whole backward")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  std::string pdl = "on";
  app.add_option("--pdl", pdl,
                 "on: kernels launch programmatically (each one's launch and set-up overlap the "
                 "previous kernel's tail; Hopper); off: ordinary launches (to compare)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  const int64_t wgrad_default = detail::concurrent_weight_grad_rows();
  std::string wgrad_stream = wgrad_default < 0 ? "on" : std::to_string(wgrad_default);
  app.add_option("--wgrad-stream", wgrad_stream,
                 "on: every convolution's and linear layer's backward-weight runs on a second "
                 "stream beside its backward-data (the two products share the GPU); N: layers of "
                 "at most N output rows (batch x height x width) only; off: one after the other "
                 "on the layer's stream (to compare; the same bits)")
      ->check([](const std::string& v) -> std::string {
        if (v == "on" || v == "off") return "";
        // A count std::stoll below can hold (a longer one would throw out of main).
        return bench::whole_number(0, LLONG_MAX)(v).empty()
                   ? ""
                   : "expected on, off or a number of rows";
      })
      ->capture_default_str();
  std::string swap = "on";
  app.add_option("--swap", swap,
                 "on: bf16 convolutions with 64 output channels run with the filters as wgmma's A "
                 "and 128 pixels as its N; off: pixels as A and the filters as a 64-wide B (to "
                 "compare)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  std::string dense_2x2 = kernels::detail::conv_dense_2x2() ? "on" : "off";
  app.add_option("--dense-2x2", dense_2x2,
                 "on: bf16 3 x 3 layers on a 2 x 2 image (VGG's last block at 32²) run as dense "
                 "maps of 4C to 4K features per image, three plain products without the "
                 "im2col's padding; off: as the other layers (to compare)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  std::string dense_2x2_view = kernels::detail::conv_dense_2x2_view() ? "on" : "off";
  app.add_option("--dense-2x2-view", dense_2x2_view,
                 "on: that form's forward and backward-data read W_eff as a view of the bf16 "
                 "filters (K a multiple of 256, C of 64: VGG's 512 channels); off: W_eff "
                 "gathered at each forward (to compare)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  int dense_2x2_splits = kernels::detail::conv_dense_2x2_splits();
  app.add_option("--dense-2x2-splits", dense_2x2_splits,
                 "the split-K count of the dense 2 x 2 form's forward and backward-data products "
                 "(the batch is their m: one or two rows of tiles); 0: the planner's")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  int dense_2x2_tile = kernels::detail::conv_dense_2x2_tile();
  app.add_option("--dense-2x2-tile", dense_2x2_tile,
                 "the tile width (n) of those products: 64, 128 or 256; 0: the planner's (with "
                 "another width, --dense-2x2-splits 0 means one split)")
      ->check(CLI::IsMember({0, 64, 128, 256}))
      ->capture_default_str();
  std::string halo = "on";
  app.add_option("--halo", halo,
                 "on: 3 x 3 layers on halo tiles (each tile's input loaded once with its border, "
                 "the taps read as shifted views) where they apply, the wide layers at 56 x 56 on "
                 "8 x 8 patches over two images; exact: not those image pairs; covering: 8 x 16 "
                 "patches there, which overhang; swapped: on the swapped 64-channel layers only; "
                 "off: nine shifted boxes a tile (to compare)")
      ->check(CLI::IsMember({"on", "exact", "covering", "swapped", "off"}))
      ->capture_default_str();
  if (const auto status = bench::parse_command_line(app, "bench_train", argc, argv)) return *status;
  o.graphs_given = graphs->count() > 0;
  detail::set_bias_handoff(bias_handoff == "on");
  detail::set_parameter_store(param_store == "on");
  detail::set_batchnorm_mask_handoff(bn_mask_handoff == "on");
  kernels::detail::set_batchnorm_cluster(bn_cluster == "on");
  kernels::detail::set_splitk_in_kernel(splitk == "in-kernel");
  kernels::detail::set_splitk_reduce_vectorized(splitk == "kernel4");
  g_splitk = splitk;
  kernels::detail::set_deferred_bias_grads(bias_final == "batched");
  g_bias_final = bias_final;
  detail::set_programmatic_launch(pdl == "on");
  detail::set_concurrent_weight_grad(wgrad_stream == "on"    ? -1
                                     : wgrad_stream == "off" ? 0
                                                             : std::stoll(wgrad_stream));
  g_zero_grad = zero_grad == "fill" ? ZeroGrad::fill : ZeroGrad::deferred;
  g_overlap_update = overlap_update == "on";
  kernels::detail::set_conv_swapped(swap == "on");
  kernels::detail::set_conv_halo(halo != "off");
  kernels::detail::set_conv_dense_2x2(dense_2x2 == "on");
  kernels::detail::set_conv_dense_2x2_splits(dense_2x2_splits);
  kernels::detail::set_conv_dense_2x2_tile(dense_2x2_tile);
  kernels::detail::set_conv_dense_2x2_view(dense_2x2_view == "on");
  kernels::detail::set_conv_halo_wide(halo == "on"         ? kernels::detail::HaloWide::pairs
                                      : halo == "exact"    ? kernels::detail::HaloWide::exact
                                      : halo == "covering" ? kernels::detail::HaloWide::covering
                                                           : kernels::detail::HaloWide::off);
  // Under mpirun an error names its rank, and the rank ends without MPI_Finalize (which would wait
  // for the other ranks, themselves waiting in a collective for this one): mpirun then ends the
  // job.
  const auto fail = [](int code, const std::string& message) {
    if (g_ranks.distributed()) {
      std::fprintf(stderr, "bench_train: rank %d of %d: %s\n", g_ranks.rank, g_ranks.world,
                   message.c_str());
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(code);
    }
    std::fprintf(stderr, "bench_train: %s\n", message.c_str());
    return code;
  };
  try {
    const int code = measure(o);
    std::fflush(stdout);
    g_ranks.finish();
    return code;
  } catch (const UsageError& e) {
    return fail(kExitUsage, e.what());
  } catch (const Error& e) {
    return fail(kExitFailure, e.message());
  } catch (const std::exception& e) {
    return fail(kExitFailure, e.what());
  }
}
