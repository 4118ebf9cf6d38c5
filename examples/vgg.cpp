// cudp-vgg: trains a VGG on Fashion-MNIST (the default), MNIST, CIFAR-10 or a synthetic set, on every
// visible GPU (or the ones given), with the data-parallel engine. The program most users run first.
//
//   cudp-vgg                                       # VGG-16-BN, Fashion-MNIST, all GPUs, 10 epochs
//   cudp-vgg --gpus 0 --epochs 2 --checkpoint run.safetensors
//   cudp-vgg --resume run.safetensors --epochs 4   # continues exactly where the checkpoint stopped
//   cudp-vgg --data synthetic --epochs 1           # no files needed (CPU too, slowly)
//
// The loop, per step: the loader's next pinned batch is copied to the first GPU on a copy stream
// (overlapping the previous step), DataParallel scatters it to the replicas, runs forward, gathers
// the logits on the first GPU, the loss and its gradient are computed there, backward runs on the
// replicas with an NCCL all-reduce of the gradients, and SGD updates every replica. The host reads the
// loss only when it prints progress, so it stays ahead of the GPUs.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/cifar.h"
#include "data/idx.h"
#include "data/loader.h"
#include "data/prefetcher.h"
#include "data/synthetic.h"
#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "engine/parallel/data_parallel.h"
#include "layers/checkpoint.h"
#include "layers/dropout.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/schedule.h"
#include "layers/vgg.h"

using namespace cudp;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string data = "fashion-mnist";
  std::string data_dir;
  std::string arch = "vgg16";
  bool bn = true;
  std::vector<int> gpus;  // empty: all visible
  int64_t batch_size = 256;
  int epochs = 10;
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 5e-4;
  std::string schedule = "onecycle";
  std::string precision = "fp32";
  uint64_t seed = 0;
  bool augment = false;
  std::string checkpoint, resume, json;
  bool eval_only = false;
  int workers = 4;
};

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The data sets and how to feed them to a 32x32 VGG.
struct Data {
  data::Dataset train, test;
  int pad = 0;
  std::string description;
};

Data load_data(const Options& o) {
  Data d;
  const auto synthetic = [&](const std::string& why) {
    data::SyntheticOptions s;
    s.seed = o.seed;
    d.train = data::make_synthetic(s, true);
    d.test = data::make_synthetic(s, false);
    d.pad = 2;
    d.description = "synthetic (28x28x1, 10 classes)" + why;
  };
  if (o.data == "synthetic") {
    synthetic("");
  } else if (o.data == "cifar10") {
    const std::string dir = o.data_dir.empty() ? "cifar-10-batches-bin" : o.data_dir;
    d.train = data::load_cifar10(dir, true);
    d.test = data::load_cifar10(dir, false);
    d.description = "CIFAR-10 from " + dir;
  } else {
    const std::string dir = !o.data_dir.empty()       ? o.data_dir
                            : o.data == "fashion-mnist" ? "/usr/share/datasets/fashion-mnist"
                                                        : "/usr/share/datasets/mnist";
    if (o.data_dir.empty() && !std::filesystem::exists(dir)) {
      synthetic(": " + dir + " is absent; for the real data install the Debian/Ubuntu package "
                "dataset-" + o.data + " or pass --data-dir");
    } else {
      d.train = data::load_mnist_like(dir, true, o.data);
      d.test = data::load_mnist_like(dir, false, o.data);
      d.pad = 2;
      d.description = o.data + " from " + dir;
    }
  }
  return d;
}

std::shared_ptr<Vgg> build_model(const Options& o, const Data& d) {
  VggOptions v;
  v.in_channels = static_cast<int>(d.train.channels);
  v.num_classes = d.train.num_classes;
  v.batch_norm = o.bn;
  v.head = VggHead::Compact;  // 32x32 inputs
  v.seed = o.seed;
  const std::string a = o.arch;
  const char config = a == "vgg11" ? 'A' : a == "vgg13" ? 'B' : a == "vgg16" ? 'D' : 'E';
  return vgg(config, v);
}

std::unique_ptr<LRScheduler> make_schedule(const Options& o, Optimizer& opt, int64_t total_steps) {
  if (o.schedule == "onecycle") {
    OneCycleOptions c;
    c.max_lr = o.lr;
    c.total_steps = std::max<int64_t>(total_steps, 1);
    return std::make_unique<OneCycleLR>(opt, c);
  }
  if (o.schedule == "cosine") return std::make_unique<CosineAnnealingLR>(opt, std::max<int64_t>(total_steps, 1));
  if (o.schedule == "step") return std::make_unique<StepLR>(opt, std::max<int64_t>(total_steps / 3, 1), 0.1);
  return nullptr;  // constant
}

// Dropout offsets are part of an exact resume but not of the state dict (torchvision's Dropout has
// no state): they travel in the checkpoint's metadata.
void save_dropout_offsets(Module& model, Metadata& meta) {
  for (auto& [name, m] : model.named_modules()) {
    if (auto* d = dynamic_cast<Dropout*>(m)) meta["dropout_offset." + name] = std::to_string(d->offset());
  }
}
void load_dropout_offsets(Module& model, const Metadata& meta) {
  for (auto& [name, m] : model.named_modules()) {
    auto* d = dynamic_cast<Dropout*>(m);
    const auto it = meta.find("dropout_offset." + name);
    if (d && it != meta.end()) d->set_seed(d->seed(), std::stoull(it->second));
  }
}

class JsonLog {
 public:
  explicit JsonLog(const std::string& path) {
    if (!path.empty()) out_.open(path, std::ios::app);
  }
  void write(const nlohmann::json& j) {
    if (out_) out_ << j.dump() << '\n' << std::flush;
  }

 private:
  std::ofstream out_;
};

void progress(bool tty, int epoch, int epochs, int64_t step, int64_t steps, double images_per_s,
              float loss, double eta) {
  if (tty) {
    const int width = 30;
    const int filled = static_cast<int>(width * step / std::max<int64_t>(steps, 1));
    std::printf("\repoch %d/%d [%-*s] %lld/%lld  %8.0f img/s  loss %.4f  ETA %5.1f s ", epoch + 1,
                epochs, width, std::string(filled, '=').c_str(), static_cast<long long>(step),
                static_cast<long long>(steps), images_per_s, loss, eta);
  } else {
    std::printf("epoch %d/%d step %lld/%lld  %.0f img/s  loss %.4f\n", epoch + 1, epochs,
                static_cast<long long>(step), static_cast<long long>(steps), images_per_s, loss);
  }
  std::fflush(stdout);
}

int run(const Options& o) {
  if (o.precision != "fp32") {
    throw ValueError(detail::str("--precision ", o.precision,
                                 " is not implemented yet: the tensor-core kernels are a later "
                                 "version; use --precision fp32"),
                     __FILE__, __LINE__);
  }
  const int visible = cuda::device_count();
  std::vector<int> gpus = o.gpus;
  if (gpus.empty()) {
    for (int i = 0; i < visible; ++i) gpus.push_back(i);
  }
  for (int g : gpus) cuda::check_device(g);
  const cuda::VisibleDevices vis = cuda::visible_devices();
  std::printf("cudp-vgg: %d visible GPU(s)%s\n", visible,
              vis.set ? (" (CUDA_VISIBLE_DEVICES=\"" + vis.raw + "\")").c_str() : "");

  const Data d = load_data(o);
  std::printf("data: %s: %lld train, %lld test images\n", d.description.c_str(),
              static_cast<long long>(d.train.size()), static_cast<long long>(d.test.size()));

  data::LoaderOptions lo;
  lo.batch_size = o.batch_size;
  lo.seed = o.seed;
  lo.normalization = data::compute_normalization(d.train);
  lo.pad = d.pad;
  lo.workers = o.workers;
  if (o.augment) {
    lo.random_crop = 4;
    lo.horizontal_flip = o.data == "cifar10";
  }
  data::Loader train_loader(d.train, lo);
  data::LoaderOptions to = lo;
  to.shuffle = false;
  to.random_crop = 0;
  to.horizontal_flip = false;
  data::Loader test_loader(d.test, to);

  auto net = build_model(o, d);
  const Device main_device = gpus.empty() ? Device::cpu() : Device::cuda(gpus[0]);
  std::printf("model: %s%s, %lld parameters, on %s\n", o.arch.c_str(), o.bn ? "-bn" : "",
              static_cast<long long>(net->num_parameters()),
              gpus.empty() ? "the CPU (no GPU visible)" : ("GPUs " + [&] {
                std::string s;
                for (int g : gpus) s += (s.empty() ? "" : ",") + std::to_string(g);
                return s;
              }()).c_str());

  int start_epoch = 0;
  int64_t global_step = 0;
  Metadata resumed;
  if (!o.resume.empty()) {
    resumed = load_checkpoint(o.resume, *net, nullptr);
    start_epoch = std::stoi(resumed.at("epoch"));
    global_step = std::stoll(resumed.at("step"));
    load_dropout_offsets(*net, resumed);
    std::printf("resumed from %s at epoch %d (step %lld)\n", o.resume.c_str(), start_epoch,
                static_cast<long long>(global_step));
  }
  net->to(main_device);

  // Without a GPU, DataParallel runs the module as it is (PyTorch's behaviour).
  auto wrapped = gpus.empty() ? std::make_unique<parallel::DataParallel>(net)
                              : std::make_unique<parallel::DataParallel>(net, gpus);
  parallel::DataParallel& model = *wrapped;
  if (!gpus.empty()) {
    std::printf("batch %lld split over %zu GPU(s):", static_cast<long long>(o.batch_size), gpus.size());
    const int64_t chunk = (o.batch_size + gpus.size() - 1) / gpus.size();
    for (size_t i = 0; i < gpus.size(); ++i) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(chunk, o.batch_size - chunk * i));
      std::printf(" %lld on cuda:%d", static_cast<long long>(n), gpus[i]);
    }
    std::printf("\n");
  }
  parallel::Replicated<SGD> opt(model.parameters(), {.lr = o.lr, .momentum = o.momentum,
                                                     .weight_decay = o.weight_decay});
  if (!o.resume.empty()) {
    for (size_t r = 0; r < opt.size(); ++r) load_checkpoint(o.resume, *net, &opt.replica(r));
    model.broadcast_parameters();
  }
  const int64_t steps_per_epoch = train_loader.batches_per_epoch();
  auto schedule = make_schedule(o, opt.primary(), steps_per_epoch * o.epochs);
  if (schedule) schedule->set_step(global_step);

  CrossEntropyLoss criterion;
  JsonLog json(o.json);
  const bool tty = isatty(fileno(stdout));
  const std::vector<int> feed = gpus.empty() ? std::vector<int>{} : std::vector<int>{gpus[0]};

  auto evaluate = [&]() {
    model.eval();
    double loss_sum = 0;
    int64_t correct = 0, count = 0;
    test_loader.start_epoch(0);
    data::Batch b;
    while (test_loader.next(b)) {
      const Tensor images = main_device.is_cuda() ? b.images.to(main_device) : b.images;
      const Tensor labels = main_device.is_cuda() ? b.labels.to(main_device) : b.labels;
      const Tensor out = model.forward(images);
      const Tensor loss = criterion.forward(out, labels);
      loss_sum += static_cast<double>(criterion.item()) * labels.numel();
      correct += num_correct(out, labels);
      count += labels.numel();
    }
    model.train();
    return std::pair{loss_sum / std::max<int64_t>(count, 1), static_cast<double>(correct) / std::max<int64_t>(count, 1)};
  };

  if (o.eval_only) {
    const auto [loss, acc] = evaluate();
    std::printf("test loss %.4f, test accuracy %.2f%%\n", loss, 100 * acc);
    json.write({{"event", "eval"}, {"test_loss", loss}, {"test_accuracy", acc}});
    return 0;
  }

  for (int g : gpus) cuda::reset_peak_memory_stats(g);
  const auto run_start = Clock::now();
  double train_seconds = 0, best_acc = 0;
  for (int epoch = start_epoch; epoch < o.epochs; ++epoch) {
    const auto epoch_start = Clock::now();
    std::unique_ptr<data::DevicePrefetcher> prefetch;
    if (!feed.empty()) {
      prefetch = std::make_unique<data::DevicePrefetcher>(train_loader, feed);
      prefetch->start_epoch(epoch);
    } else {
      train_loader.start_epoch(epoch);
    }
    int64_t step = 0, images_seen = 0;
    std::vector<Tensor> corrects;
    float last_loss = 0;
    const int64_t print_every = tty ? 10 : std::max<int64_t>(steps_per_epoch / 5, 1);
    for (;;) {
      Tensor images, labels;
      if (prefetch) {
        data::DeviceBatch db;
        if (!prefetch->next(db)) break;
        images = db.images[0];
        labels = db.labels[0];
      } else {
        data::Batch b;
        if (!train_loader.next(b)) break;
        images = b.images;
        labels = b.labels;
      }
      const Tensor out = model.forward(images);
      criterion.forward(out, labels);
      opt.zero_grad();
      model.backward(criterion.backward());
      opt.step();
      if (schedule) schedule->step();
      ++global_step;
      ++step;
      images_seen += labels.numel();
      // Counted on the device; the host reads the counts once, at the end of the epoch.
      corrects.push_back(count_correct(argmax(out, 1), labels));
      if (step % print_every == 0 || step == steps_per_epoch) {
        last_loss = criterion.item();
        const double t = seconds_since(epoch_start);
        progress(tty, epoch, o.epochs, step, steps_per_epoch, images_seen / t, last_loss,
                 t / step * (steps_per_epoch - step));
        json.write({{"event", "step"}, {"epoch", epoch}, {"step", global_step}, {"loss", last_loss},
                    {"lr", opt.primary().lr()}, {"images_per_s", images_seen / t}});
      }
    }
    if (main_device.is_cuda()) cuda::synchronize(main_device.index);
    const double epoch_seconds = seconds_since(epoch_start);
    train_seconds += epoch_seconds;
    int64_t train_correct = 0;
    for (const Tensor& c : corrects) train_correct += c.to_vector<int32_t>()[0];
    const auto [test_loss, test_acc] = evaluate();
    best_acc = std::max(best_acc, test_acc);
    if (tty) std::printf("\n");
    std::printf("epoch %d/%d: train loss %.4f, train accuracy %.2f%%, test loss %.4f, test accuracy %.2f%%, %.1f s "
                "(%.0f img/s, input wait %.2f s), %.1f s so far\n",
                epoch + 1, o.epochs, last_loss, 100.0 * train_correct / std::max<int64_t>(images_seen, 1), test_loss, 100 * test_acc, epoch_seconds,
                images_seen / epoch_seconds, train_loader.wait_seconds(), seconds_since(run_start));
    json.write({{"event", "epoch"}, {"epoch", epoch}, {"train_loss", last_loss},
                {"test_loss", test_loss}, {"test_accuracy", test_acc}, {"seconds", epoch_seconds},
                {"elapsed", seconds_since(run_start)}, {"input_wait", train_loader.wait_seconds()}});
    if (!o.checkpoint.empty()) {
      Metadata meta = {{"epoch", std::to_string(epoch + 1)}, {"step", std::to_string(global_step)},
                       {"arch", o.arch}, {"seed", std::to_string(o.seed)}};
      save_dropout_offsets(*net, meta);
      save_checkpoint(o.checkpoint, *net, &opt.primary(), meta);
    }
  }
  std::printf("done: best test accuracy %.2f%%, training time %.1f s, total %.1f s\n", 100 * best_acc,
              train_seconds, seconds_since(run_start));
  for (int g : gpus) {
    std::printf("  cuda:%d peak memory %.2f GiB\n", g,
                static_cast<double>(cuda::max_memory_allocated(g)) / (1 << 30));
  }
  json.write({{"event", "done"}, {"best_test_accuracy", best_acc}, {"train_seconds", train_seconds},
              {"total_seconds", seconds_since(run_start)}});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cudp-vgg: train a VGG on Fashion-MNIST, MNIST, CIFAR-10 or synthetic data with "
               "data parallelism over the visible GPUs"};
  Options o;
  std::string gpus;
  app.add_option("--data", o.data, "data set")
      ->check(CLI::IsMember({"fashion-mnist", "mnist", "cifar10", "synthetic"}))
      ->capture_default_str();
  app.add_option("--data-dir", o.data_dir, "folder of the data set's files");
  app.add_option("--arch", o.arch, "network")
      ->check(CLI::IsMember({"vgg11", "vgg13", "vgg16", "vgg19"}))
      ->capture_default_str();
  app.add_flag("--bn,!--no-bn", o.bn, "BatchNorm after every convolution (default on)");
  app.add_option("--gpus", gpus, "comma-separated device ids (default: all visible)");
  app.add_option("--batch-size", o.batch_size, "global batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--epochs", o.epochs, "epochs")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--lr", o.lr, "learning rate (peak rate for onecycle)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--momentum", o.momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--schedule", o.schedule, "learning-rate schedule")
      ->check(CLI::IsMember({"onecycle", "cosine", "step", "constant"}))
      ->capture_default_str();
  app.add_option("--precision", o.precision, "compute precision")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16"}))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of weights, data order, dropout")->capture_default_str();
  app.add_flag("--augment", o.augment, "random crop (and flip for CIFAR-10)");
  app.add_option("--checkpoint", o.checkpoint, "write a checkpoint here after every epoch");
  app.add_option("--resume", o.resume, "continue from this checkpoint");
  app.add_flag("--eval-only", o.eval_only, "evaluate the --resume checkpoint and stop");
  app.add_option("--json", o.json, "append one JSON object per progress line and epoch to this file");
  app.add_option("--workers", o.workers, "host threads preparing batches")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    std::stringstream ss(gpus);
    for (std::string id; std::getline(ss, id, ',');) {
      try {
        o.gpus.push_back(std::stoi(id));
      } catch (const std::exception&) {
        std::fprintf(stderr, "cudp-vgg: --gpus: \"%s\" is not a device id\n", id.c_str());
        return 2;
      }
    }
    if (o.eval_only && o.resume.empty()) {
      std::fprintf(stderr, "cudp-vgg: --eval-only needs --resume CHECKPOINT\n");
      return 2;
    }
    return run(o);
  } catch (const ValueError& e) {
    std::fprintf(stderr, "cudp-vgg: %s\n", e.message().c_str());
    return 2;
  } catch (const Error& e) {
    std::fprintf(stderr, "cudp-vgg: %s\n", e.what());
    return 1;
  }
}
