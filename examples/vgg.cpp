// cudp-vgg: trains a VGG on Fashion-MNIST (the default), MNIST, CIFAR-10 or a synthetic set, on every
// visible GPU (or the ones given), with the data-parallel engine. The program most users run first.
//
//   cudp-vgg                                       # VGG-16-BN, Fashion-MNIST, all GPUs, 10 epochs
//   cudp-vgg --gpus 0 --epochs 2 --checkpoint run.safetensors
//   cudp-vgg --resume run.safetensors --epochs 4   # continues exactly where the checkpoint stopped
//   cudp-vgg --data synthetic --epochs 1           # no files needed (CPU too, slowly)
//   cudp-vgg --data synthetic --arch vgg11 --epochs 1 --limit-train 64 --limit-test 32
//            --batch-size 32                         # a CI smoke run on the CPU (~20 s: the CPU
//                                                    # references train a few images per second)
//
// Exact resume: a checkpoint written after epoch e holds the model (weights and BatchNorm buffers),
// the optimizer's momentum buffers, step count and rate, the global step (the schedule's position),
// the Dropout seeds and offsets (not part of a state dict) and the settings that shape the run
// (data, --limit-train, --batch-size, --seed, --arch, --bn, schedule, rates, --epochs). The data
// order is a pure function of (seed, epoch), so `--resume` replays epoch e + 1 onwards exactly:
// resuming with the same settings gives bit-identical weights to the run that was not stopped.
// On --resume, settings left off the command line are taken from the checkpoint; those that would
// make it another run (data, limits, batch size, seed, arch, bn) are refused when given with
// another value, and the others (rates, schedule, --epochs, --augment) are accepted with a note
// that the continuation then differs from the checkpointed run. The optimizer state goes into every
// replica's optimizer (Replicated::load_state_dict) and the replicas' Dropout seeds derive from
// replica 0's, restored before the replicas are made. Note that a onecycle/cosine/step schedule
// spans --epochs: `--epochs 2` then `--resume --epochs 4` is exact only with --schedule constant;
// `--epochs 4 --stop-after 2` then `--resume` (an interrupted run) is exact with any schedule.
// --print-checksum prints an FNV-1a hash of state_dict() (and checks that the replicas are
// bit-identical), so scripts and tests can compare runs.
//
// The loop, per step: the loader's next pinned batch is copied to the first GPU on a copy stream
// (overlapping the previous step), DataParallel scatters it to the replicas, runs forward, gathers
// the logits on the first GPU, the loss and its gradient are computed there, backward runs on the
// replicas with an NCCL all-reduce of the gradients, and SGD updates every replica. The host reads the
// loss only when it prints progress, so it stays ahead of the GPUs.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
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
  int64_t limit_train = 0, limit_test = 0;  // use only the first N images (0: all)
  int stop_after = 0;                       // stop after this epoch (0: run to --epochs)
  bool print_checksum = false;
  std::set<std::string> given;              // options given on the command line ("--seed", ...)
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
  // --limit-train / --limit-test: the first N images of each set (tests, CI, quick experiments).
  const auto limit = [](data::Dataset& set, int64_t n, const char* which) -> std::string {
    if (n <= 0 || n >= set.size()) return "";
    const std::string note = detail::str(", first ", n, " of ", set.size(), " ", which, " images");
    set.labels.resize(static_cast<size_t>(n));
    set.images.resize(static_cast<size_t>(n * set.image_bytes()));
    return note;
  };
  d.description += limit(d.train, o.limit_train, "train");
  d.description += limit(d.test, o.limit_test, "test");
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

// Dropout seeds and offsets are part of an exact resume but not of the state dict (torchvision's
// Dropout has no state): they travel in the checkpoint's metadata. Replica 0's are the ones saved
// and restored; the other replicas' seeds derive from them when DataParallel makes the replicas
// (engine/parallel/replicate.h), so they must be restored before that.
void save_dropout_state(Module& model, Metadata& meta) {
  for (auto& [name, m] : model.named_modules()) {
    if (auto* d = dynamic_cast<Dropout*>(m)) {
      meta["dropout_seed." + name] = std::to_string(d->seed());
      meta["dropout_offset." + name] = std::to_string(d->offset());
    }
  }
}
void load_dropout_state(Module& model, const Metadata& meta) {
  for (auto& [name, m] : model.named_modules()) {
    auto* d = dynamic_cast<Dropout*>(m);
    if (!d) continue;
    const auto seed = meta.find("dropout_seed." + name);
    const auto offset = meta.find("dropout_offset." + name);
    d->set_seed(seed != meta.end() ? std::stoull(seed->second) : d->seed(),
                offset != meta.end() ? std::stoull(offset->second) : 0);
  }
}

// --print-checksum: FNV-1a (64 bit) over every state_dict() entry in key order, name and bytes, so
// two runs compare with one line.
uint64_t model_checksum(Module& model) {
  uint64_t h = 14695981039346656037ull;
  const auto mix = [&h](const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  };
  for (const auto& [name, tensor] : model.state_dict()) {
    mix(name.data(), name.size());
    const Tensor host = tensor.cpu();
    mix(host.data_ptr(), host.nbytes());
  }
  return h;
}

// The settings that shape a run, as exact strings in the checkpoint's metadata.
std::string text(const std::string& v) { return v; }
std::string text(bool v) { return v ? "1" : "0"; }
std::string text(double v) {  // the shortest form that reads back exactly
  char buf[64];
  const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  return std::string(buf, end);
}
template <class T>
  requires std::is_integral_v<T>
std::string text(T v) {
  return std::to_string(v);
}

template <class T>
T parse(const std::string& s) {
  if constexpr (std::is_same_v<T, std::string>) {
    return s;
  } else if constexpr (std::is_same_v<T, bool>) {
    return s == "1";
  } else if constexpr (std::is_floating_point_v<T>) {
    return std::stod(s);
  } else if constexpr (std::is_unsigned_v<T>) {
    return static_cast<T>(std::stoull(s));
  } else {
    return static_cast<T>(std::stoll(s));
  }
}

// Calls fn(option, metadata key, value, strict) for every setting a checkpoint records. strict:
// another value makes it another run (different data, order, model), so a resume refuses it.
template <class Fn>
void for_each_setting(Options& o, Fn&& fn) {
  fn("--data", "data", o.data, true);
  fn("--limit-train", "limit_train", o.limit_train, true);
  fn("--batch-size", "batch_size", o.batch_size, true);
  fn("--seed", "seed", o.seed, true);
  fn("--arch", "arch", o.arch, true);
  fn("--bn", "bn", o.bn, true);
  fn("--augment", "augment", o.augment, false);
  fn("--schedule", "schedule", o.schedule, false);
  fn("--lr", "lr", o.lr, false);
  fn("--momentum", "momentum", o.momentum, false);
  fn("--weight-decay", "weight_decay", o.weight_decay, false);
  fn("--epochs", "epochs", o.epochs, false);
}

Metadata settings_metadata(Options o) {
  Metadata meta;
  for_each_setting(o, [&](const char*, const char* key, const auto& value, bool) {
    meta[key] = text(value);
  });
  return meta;
}

// On --resume: settings left off the command line take the checkpoint's values; strict ones given
// with another value are refused (ValueError: exit code 2); others are kept with a note.
void adopt_settings(Options& o, const Metadata& meta) {
  for_each_setting(o, [&](const char* option, const char* key, auto& value, bool strict) {
    using T = std::remove_cvref_t<decltype(value)>;
    const auto it = meta.find(key);
    if (it == meta.end() || it->second == text(value)) return;
    const bool given = o.given.count(option) > 0 ||
                       (std::string(option) == "--bn" && o.given.count("--no-bn") > 0);
    if (!given) {
      value = parse<T>(it->second);
      return;
    }
    if (strict) {
      throw ValueError(detail::str("--resume ", o.resume, ": the checkpoint was written with ",
                                   option, " ", it->second, ", this run has ", option, " ",
                                   text(value), "; resuming needs the same value (leave ", option,
                                   " out to take the checkpoint's)"),
                       __FILE__, __LINE__);
    }
    if (std::string(option) == "--epochs") {
      if (o.schedule != "constant") {
        std::printf(
            "note: the checkpointed run planned %s epochs; the %s schedule now spans %d, so the "
            "rates from here on are those of a %d-epoch run\n",
            it->second.c_str(), o.schedule.c_str(), o.epochs, o.epochs);
      }
      return;
    }
    std::printf("note: %s %s differs from the checkpoint's %s: training continues with it, not as "
                "the checkpointed run would have\n",
                option, text(value).c_str(), it->second.c_str());
  });
}

// Batches of one loader on the first GPU (copied ahead on a copy stream by DevicePrefetcher, so the
// copy of batch i+1 overlaps compute on batch i), or on the host when there is no GPU. Training and
// evaluation both read through it.
class BatchFeed {
 public:
  // device: a CUDA device id, or -1 for the host.
  BatchFeed(data::Loader& loader, int device) : loader_(loader) {
    if (device >= 0) prefetch_ = std::make_unique<data::DevicePrefetcher>(loader, std::vector<int>{device});
  }
  void start_epoch(int epoch) {
    if (prefetch_) {
      prefetch_->start_epoch(epoch);
    } else {
      loader_.start_epoch(epoch);
    }
  }
  bool next(Tensor& images, Tensor& labels) {
    if (prefetch_) {
      data::DeviceBatch db;
      if (!prefetch_->next(db)) return false;
      images = db.images[0];
      labels = db.labels[0];
      return true;
    }
    if (!loader_.next(host_)) return false;  // valid until the next call, as the loader promises
    images = host_.images;
    labels = host_.labels;
    return true;
  }

 private:
  data::Loader& loader_;
  std::unique_ptr<data::DevicePrefetcher> prefetch_;
  data::Batch host_;
};

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

int run(Options o) {
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

  // A resumed run takes the checkpoint's settings before anything depends on them (the data and
  // its order depend on the seed and the limits).
  if (!o.resume.empty()) {
    adopt_settings(o, load_safetensors(optimizer_state_path(o.resume)).metadata);
  }

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
    load_dropout_state(*net, resumed);  // before the replicas are made: their seeds derive from it
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
  const int64_t steps_per_epoch = train_loader.batches_per_epoch();
  if (!o.resume.empty()) {
    // Replica 0's optimizer from the checkpoint (its parameters are the model's, which names its
    // state; the model is loaded again on the way), then the same momentum buffers and step count
    // into every other replica's optimizer, and replica 0's weights and buffers to the replicas.
    load_checkpoint(o.resume, *net, &opt.primary());
    opt.load_state_dict(opt.primary().state_dict());
    for (size_t r = 1; r < opt.size(); ++r) {
      opt.replica(r).load_hyperparameters(opt.primary().hyperparameters());
    }
    model.broadcast_parameters();
    if (global_step != start_epoch * steps_per_epoch) {
      throw ValueError(detail::str("--resume ", o.resume, ": the checkpoint is at step ",
                                   global_step, " after epoch ", start_epoch, ", but this run has ",
                                   steps_per_epoch, " steps per epoch; resume with the data, "
                                   "--limit-train and --batch-size it was written with"),
                       __FILE__, __LINE__);
    }
    if (!o.eval_only && o.epochs < start_epoch) {
      throw ValueError(detail::str("--epochs ", o.epochs, " is less than the checkpoint's epoch ",
                                   start_epoch, ": nothing to train (--eval-only evaluates it)"),
                       __FILE__, __LINE__);
    }
  }
  // The epochs this run trains: [start_epoch, end_epoch). The schedule spans --epochs whatever
  // --stop-after says, so a stopped run resumes on the same schedule.
  const int end_epoch = o.stop_after > 0 ? std::min(o.epochs, o.stop_after) : o.epochs;
  std::unique_ptr<LRScheduler> schedule;
  if (!o.eval_only && start_epoch < end_epoch) {
    // The checkpoint restored the rate of its last step; the schedules compute every rate from
    // the base rate (StepLR and CosineAnnealingLR take the optimizer's at construction), and a
    // constant schedule runs at --lr.
    opt.primary().set_lr(o.lr);
    schedule = make_schedule(o, opt.primary(), steps_per_epoch * o.epochs);
    if (schedule) schedule->set_step(global_step);
  } else if (!o.eval_only) {
    std::printf("nothing to train: the model is at epoch %d and this run stops at epoch %d\n",
                start_epoch, end_epoch);
  }

  const auto print_checksum = [&] {
    if (!o.print_checksum) return;
    if (model.num_replicas() > 1) {
      model.check_replicas_identical();  // throws naming the first difference
      std::printf("replicas: %zu, bit-identical\n", model.num_replicas());
    }
    std::printf("checksum %016llx\n", static_cast<unsigned long long>(model_checksum(*net)));
    std::fflush(stdout);
  };

  CrossEntropyLoss criterion;
  JsonLog json(o.json);
  const bool tty = isatty(fileno(stdout));

  const int feed_device = main_device.is_cuda() ? main_device.index : -1;
  BatchFeed test_feed(test_loader, feed_device);
  // The test set's mean loss and accuracy. Per-batch losses and counts stay on the device and are
  // read once at the end: no host synchronisation per batch.
  auto evaluate = [&]() {
    model.eval();
    std::vector<std::pair<Tensor, int64_t>> losses;  // (0-d loss, batch size)
    std::vector<Tensor> corrects;
    test_feed.start_epoch(0);
    for (Tensor images, labels; test_feed.next(images, labels);) {
      const Tensor out = model.forward(images);
      losses.emplace_back(criterion.forward(out, labels), labels.numel());
      corrects.push_back(count_correct(argmax(out, 1), labels));
    }
    model.train();
    double loss_sum = 0;
    int64_t correct = 0, count = 0;
    for (const auto& [loss, n] : losses) {
      loss_sum += static_cast<double>(loss.to_vector<float>()[0]) * n;
      count += n;
    }
    for (const Tensor& c : corrects) correct += c.to_vector<int32_t>()[0];
    return std::pair{loss_sum / std::max<int64_t>(count, 1),
                     static_cast<double>(correct) / std::max<int64_t>(count, 1)};
  };

  if (o.eval_only) {
    const auto [loss, acc] = evaluate();
    std::printf("test loss %.4f, test accuracy %.2f%%\n", loss, 100 * acc);
    json.write({{"event", "eval"}, {"test_loss", loss}, {"test_accuracy", acc}});
    print_checksum();
    return 0;
  }

  for (int g : gpus) cuda::reset_peak_memory_stats(g);
  BatchFeed train_feed(train_loader, feed_device);
  const auto run_start = Clock::now();
  double train_seconds = 0, best_acc = 0;
  for (int epoch = start_epoch; epoch < end_epoch; ++epoch) {
    const auto epoch_start = Clock::now();
    train_feed.start_epoch(epoch);
    int64_t step = 0, images_seen = 0;
    std::vector<Tensor> corrects;
    float last_loss = 0;
    const int64_t print_every = tty ? 10 : std::max<int64_t>(steps_per_epoch / 5, 1);
    for (Tensor images, labels; train_feed.next(images, labels);) {
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
      Metadata meta = settings_metadata(o);
      meta["epoch"] = std::to_string(epoch + 1);
      meta["step"] = std::to_string(global_step);
      save_dropout_state(*net, meta);
      save_checkpoint(o.checkpoint, *net, &opt.primary(), meta);
    }
  }
  if (start_epoch >= end_epoch) {
    print_checksum();
    return 0;
  }
  std::printf("done: best test accuracy %.2f%%, training time %.1f s, total %.1f s\n", 100 * best_acc,
              train_seconds, seconds_since(run_start));
  for (int g : gpus) {
    std::printf("  cuda:%d peak memory %.2f GiB\n", g,
                static_cast<double>(cuda::max_memory_allocated(g)) / (1 << 30));
  }
  json.write({{"event", "done"}, {"best_test_accuracy", best_acc}, {"train_seconds", train_seconds},
              {"total_seconds", seconds_since(run_start)}});
  print_checksum();
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
  app.add_option("--limit-train", o.limit_train, "use only the first N training images (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--limit-test", o.limit_test, "use only the first N test images (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--stop-after", o.stop_after,
                 "stop after this epoch, as if interrupted (the schedule still spans --epochs; "
                 "--resume continues)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--print-checksum", o.print_checksum,
               "print a checksum of the model's parameters and buffers at the end (compares runs)");
  CLI11_PARSE(app, argc, argv);
  for (const CLI::Option* option : app.get_options()) {
    if (option->count() > 0) {
      for (const std::string& name : option->get_lnames()) o.given.insert("--" + name);
    }
  }
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
