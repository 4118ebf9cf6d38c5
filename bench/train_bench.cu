// bench_train: VGG training throughput of cudp's engine: img/s on 1..N GPUs at 224^2 (batch 64 per
// GPU, torchvision head, 1000 classes) and 32^2 (batch 256 per GPU, compact head, 10 classes), with
// the products in fp32 or bf16 (--precision; layers/precision.h), SGD with momentum, the data
// already on the first GPU (the input pipeline is measured by cudp-vgg).
//
// Per configuration: build the model from a fixed seed, wrap it in DataParallel over the first g
// GPUs, run `--warmup` steps, then `--steps` timed steps between a device synchronisation and the
// next (host clock): img/s = global batch * steps / seconds. Also reported: peak memory per GPU and
// the time of the gradient all-reduce alone (NCCL on the flat gradient buffer, timed separately).
// One JSON object per configuration with --json.
//
// Exposed communication (--exposed-comm on, the default): each multi-GPU configuration is timed a
// second time with the gradient all-reduce switched off (DataParallel::set_gradient_sync(false):
// the same forward, backward and optimizer kernels, no NCCL call), and the difference of the two
// step times, as a fraction of the step with communication, is the communication the step leaves
// exposed (what the bucketed all-reduce did not hide behind the backward). JSON fields
// "step_ms_no_comm" and "cudp_exposed_comm_share" on multi-GPU rows.
//
// --graphs on off: each configuration with its steps replayed from a CUDA graph (GraphedStep,
// layers/train.h: two eager warm-up steps, the capture, then replays; at least 3 untimed steps) and
// launched kernel by kernel; JSON field "cudp_graphs".
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/memory.h"
#include "engine/core/nvtx.h"
#include "engine/core/stream.h"
#include "engine/parallel/data_parallel.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/train.h"
#include "layers/vgg.h"

namespace {

using namespace cudp;
using Clock = std::chrono::steady_clock;

struct Config {
  std::string arch;
  int size;
  int64_t batch_per_gpu;
  int gpus;
  Precision precision;
  bool graphs;
  bool comm = true;  // false: gradient all-reduce switched off (exposed-communication timing)
};

struct Result {
  double images_per_s = 0, step_ms = 0, allreduce_ms = 0, peak_gib = 0;
  double step_ms_no_comm = -1;  // the same step with the all-reduce off (multi-GPU rows)
};

char arch_config(const std::string& arch) {
  return arch == "vgg11" ? 'A' : arch == "vgg13" ? 'B' : arch == "vgg16" ? 'D' : 'E';
}

Result run(const Config& c, int warmup, int steps) {
  std::vector<int> ids;
  for (int i = 0; i < c.gpus; ++i) ids.push_back(i);
  for (int g : ids) {
    cuda::synchronize(g);
    cuda::reset_peak_memory_stats(g);
  }
  VggOptions o;
  o.in_channels = 3;
  o.batch_norm = false;
  o.head = c.size == 32 ? VggHead::Compact : VggHead::Torchvision;
  o.num_classes = c.size == 32 ? 10 : 1000;
  o.seed = 1;
  auto net = vgg(arch_config(c.arch), o);
  net->set_precision(c.precision);
  net->cuda(0);
  Result r;
  {
    parallel::DataParallel model(net, ids);
    model.set_input_grad(false);  // as the trainer: the images need no gradient
    model.set_gradient_sync(c.comm);  // before any step: a captured graph keeps it
    parallel::Replicated<SGD> opt(model, {.lr = 0.01, .momentum = 0.9, .weight_decay = 5e-4});
    CrossEntropyLoss criterion;
    const int64_t batch = c.batch_per_gpu * c.gpus;
    Tensor images = Tensor::empty({batch, c.size, c.size, 3}, DType::f32, Device::cuda(0));
    images.normal_(0.f, 1.f, 7);
    std::vector<int32_t> host_labels(batch);
    for (int64_t i = 0; i < batch; ++i) host_labels[i] = static_cast<int32_t>(i % o.num_classes);
    const Tensor labels = Tensor::from_vector(host_labels, {batch}, Device::cuda(0));
    const auto body = [&](const Tensor& x, const Tensor& y) {
      const Tensor out = model.forward(x);
      const Tensor loss = criterion.forward(out, y);
      opt.zero_grad();
      model.backward(criterion.backward());
      opt.step();
      return TensorList{loss};
    };
    GraphedStep graphed(body, Device::cuda(0),
                        {.warmup_steps = GraphedStepOptions{}.warmup_steps,
                         .enabled = c.graphs,
                         .before_replay = [&opt] { opt.follow_primary(); }},
                        ids);
    auto step = [&] {
      const nvtx::Range range("training step");
      graphed.run(images, labels);
    };
    // With graphs: the warm-up steps, the capture (and its first replay) stay untimed.
    const int untimed = c.graphs ? std::max(warmup, GraphedStepOptions{}.warmup_steps + 1) : warmup;
    for (int i = 0; i < untimed; ++i) step();
    for (int g : ids) cuda::synchronize(g);
    const auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i) step();
    for (int g : ids) cuda::synchronize(g);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    r.step_ms = 1e3 * seconds / steps;
    r.images_per_s = static_cast<double>(batch) * steps / seconds;
    criterion.check_labels();

    // The gradient all-reduce alone, on the same communicator and buffers.
    if (c.gpus > 1 && c.comm) {
      const auto t1 = Clock::now();
      const int reps = 10;
      for (int i = 0; i < reps; ++i) model.replicas()->all_reduce_gradients();
      for (int g : ids) cuda::synchronize(g);
      r.allreduce_ms = 1e3 * std::chrono::duration<double>(Clock::now() - t1).count() / reps;
    }
  }
  for (int g : ids) r.peak_gib = std::max(r.peak_gib, cuda::max_memory_allocated(g) / double(1 << 30));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_train: VGG training throughput on 1..N GPUs"};
  std::vector<std::string> archs = {"vgg16"};
  std::vector<std::string> precisions = {"fp32"};
  std::vector<std::string> graph_modes = {"on", "off"};
  std::vector<int> sizes = {224, 32};
  int max_gpus = 0, warmup = 3, steps = 10;
  std::string json, exposed_comm = "on";
  app.add_option("--arch", archs, "vgg11 vgg13 vgg16 vgg19")->capture_default_str();
  app.add_option("--size", sizes, "image sizes: 224 (batch 64/GPU) and/or 32 (batch 256/GPU)")->capture_default_str();
  app.add_option("--precision", precisions,
                 "fp32 and/or bf16 (bf16 operands on tensor cores, sm_90; tf32 trains no "
                 "convolution yet)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--graphs", graph_modes,
                 "on and/or off: steps replayed from a CUDA graph, or launched kernel by kernel")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app.add_option("--gpus", max_gpus, "largest GPU count (default: all visible)");
  app.add_option("--warmup", warmup, "untimed steps")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--json", json, "write one JSON object per configuration here");
  app.add_option("--exposed-comm", exposed_comm,
                 "on: time each multi-GPU configuration again with the gradient all-reduce off; "
                 "the difference is the communication the step exposes (cudp_exposed_comm_share)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const int visible = cuda::device_count();
    if (visible == 0) {
      std::fprintf(stderr, "bench_train: no CUDA device is visible\n");
      return 1;
    }
    if (max_gpus <= 0 || max_gpus > visible) max_gpus = visible;
    FILE* out = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
    std::printf(
        "| model | precision | graphs | image | batch/GPU | GPUs | img/s | step ms | scaling | "
        "all-reduce ms | step ms, no comm | exposed comm | peak GiB |\n"
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    std::vector<std::pair<std::string, std::string>> runs;  // (precision, arch)
    for (const auto& name : precisions) {
      for (const auto& arch : archs) runs.emplace_back(name, arch);
    }
    for (const auto& [name, arch] : runs) {
      const Precision precision = parse_precision(name);
      for (int size : sizes) {
        for (const auto& mode : graph_modes) {
          const bool graphs = mode == "on";
          const int64_t per_gpu = size == 32 ? 256 : 64;
          double one = 0;
          for (int g = 1; g <= max_gpus; ++g) {
            Result r = run({arch, size, per_gpu, g, precision, graphs}, warmup, steps);
            // Exposed communication: the same configuration without the all-reduce. The share is
            // clamped at 0 (a step without communication can time a little slower by noise).
            double exposed = -1;
            if (g > 1 && exposed_comm == "on") {
              Config quiet{arch, size, per_gpu, g, precision, graphs};
              quiet.comm = false;
              r.step_ms_no_comm = run(quiet, warmup, steps).step_ms;
              exposed = std::max(0.0, (r.step_ms - r.step_ms_no_comm) / r.step_ms);
            }
            if (g == 1) one = r.images_per_s;
            const double scaling = r.images_per_s / (one * g);
            const std::string no_comm =
                exposed < 0 ? "-" : detail::str(std::llround(r.step_ms_no_comm * 10) / 10.0);
            const std::string share =
                exposed < 0 ? "-" : detail::str(std::llround(exposed * 1000) / 10.0, "%");
            std::printf(
                "| %s | %s | %s | %d | %lld | %d | %.0f | %.1f | %.2f | %.2f | %s | %s | %.2f |\n",
                arch.c_str(), name.c_str(), mode.c_str(), size, static_cast<long long>(per_gpu), g,
                r.images_per_s, r.step_ms, scaling, r.allreduce_ms, no_comm.c_str(), share.c_str(),
                r.peak_gib);
            std::fflush(stdout);
            if (out) {
              const std::string extra =
                  exposed < 0 ? std::string()
                              : detail::str(", \"step_ms_no_comm\": ", r.step_ms_no_comm,
                                            ", \"cudp_exposed_comm_share\": ", exposed);
              std::fprintf(
                  out,
                  "{\"framework\": \"cudp\", \"model\": \"%s\", \"cudp_precision\": \"%s\", "
                  "\"cudp_graphs\": \"%s\", \"size\": %d, \"batch_per_gpu\": %lld, "
                  "\"gpus\": %d, \"images_per_s\": %.1f, \"step_ms\": %.3f, \"scaling\": %.3f, "
                  "\"allreduce_ms\": %.3f, \"peak_gib\": %.3f%s}\n",
                  arch.c_str(), name.c_str(), mode.c_str(), size, static_cast<long long>(per_gpu),
                  g, r.images_per_s, r.step_ms, scaling, r.allreduce_ms, r.peak_gib, extra.c_str());
            }
          }
        }
      }
    }
    if (out) std::fclose(out);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_train: %s\n", e.what());
    return 1;
  }
}
