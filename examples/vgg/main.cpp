// cudp-vgg: trains a VGG on Fashion-MNIST (the default), MNIST, CIFAR-10, an ImageFolder of your
// own JPEGs and PNGs (data/image_folder.h) or generated data, on every visible GPU (or the ones
// given), with the data-parallel engine. The program most users run first.
//
//   cudp-vgg                                      # VGG-16-BN, Fashion-MNIST, all GPUs, 10 epochs
//   cudp-vgg --gpus 0 --epochs 2 --output runs/a  # a run folder: metrics, curves, checkpoints
//   cudp-vgg --resume runs/a --epochs 4           # goes on exactly where the checkpoint stopped
//   mpirun -np 2 cudp-vgg --batch-size 128        # one process per GPU: DistributedDataParallel
//   cudp-vgg --data folder --data-dir pets --image-size 224  # pets/train/<class>/, pets/val/...
//   cudp-vgg --data synthetic --arch vgg11 --epochs 1 --limit-train 64 --limit-test 32
//            --batch-size 32                      # a CI smoke run on the CPU (the CPU references
//                                                 # train a few images per second)
//
// Settings (examples/vgg/options.h): one table read by the command line and by --resume, so a
// checkpoint's settings come back validated, and every recorded one comes back.
//
// Exact resume: a checkpoint written after epoch e holds the model (weights and BatchNorm buffers),
// the optimizer's state, step count and rate, the global step (the schedule's position), the
// Dropout seeds and offsets (not part of a state dict) and the settings. The data order is a pure
// function of (seed, epoch), so `--resume` replays epoch e + 1 onwards exactly. A onecycle, cosine
// or step schedule spans --epochs: `--epochs 4 --stop-after 2` then `--resume` (an interrupted run)
// is exact with any schedule.
//
// The loop, per step: the loader's next pinned batch is copied to the first GPU on a copy stream,
// DataParallel scatters it, runs forward, gathers the logits on the first GPU, the loss and its
// gradient are computed there, backward runs on the replicas with an NCCL all-reduce, the
// gradients' global norm is reduced on the device (clipped with --clip-grad) and the optimizer
// updates every replica. The step's loss, gradient norm, logits and labels stay on the device (the
// logits and labels are copied to pinned host buffers on the stream); the host reads them only at a
// read point (a progress line, every 64 steps, the end of the epoch), which is where the divergence
// guard looks at them: no host synchronisation per step. --on-nan skip-step decides on the device:
// a flag computed there from the loss and the norm (nonfinite_flag) is copied to every replica and
// the optimizer skips the update there (Optimizer::step(skip), layers/optim.h); the host names the
// skipped steps at the next read point and counts them, from the optimizer, at the epoch's end.
//
// Under mpirun (or srun; a world of more than one rank, engine/parallel/mpi_bootstrap.h, in a build
// with MPI) every process is one rank: its local rank picks its GPU, the model is wrapped in
// DistributedDataParallel (engine/parallel/ddp.h) over NCCL, or over MPI with --gpus none, each
// rank trains on its DistributedSampler shard of every epoch's order with --batch-size images per
// step, and its loss is weighted by its share of the global batch, 1 / N. Rank 0 alone prints,
// evaluates, writes the JSON log, the run folder and the checkpoints; the training metrics are
// summed over the ranks first. The other ranks' standard output goes to /dev/null; their errors
// print with their rank. A checkpoint records the number of ranks: resuming needs the same number
// (docs/distributed.md).
//
// The divergence guard: a non-finite loss or gradient norm stops the run (exit 1) with the step,
// the epoch and the last good checkpoint; before any checkpoint is written the model's state is
// checked to be finite, so a diverged run never overwrites good weights.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/cifar.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/loader.h"
#include "data/prefetcher.h"
#include "data/sampler.h"
#include "data/synthetic.h"
#include "engine/core/device.h"
#include "engine/core/memory.h"
#include "engine/core/nvtx.h"
#include "engine/core/stream.h"
#include "engine/parallel/comm.h"
#include "engine/parallel/data_parallel.h"
#include "engine/parallel/ddp.h"
#include "engine/parallel/mpi_bootstrap.h"
#include "engine/parallel/process_group.h"
#include "engine/parallel/scatter_gather.h"
#include "examples/vgg/options.h"
#include "examples/vgg/run_folder.h"
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "layers/checkpoint.h"
#include "layers/dropout.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/schedule.h"
#include "layers/sync_batchnorm.h"
#include "layers/train.h"
#include "layers/vgg.h"

namespace cudp::trainer {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// "NaN", "+inf", "-inf" or the value (printf's "-nan" says nothing useful about a NaN's sign bit).
std::string number_text(float v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+inf" : "-inf";
  return detail::str(v);
}

// A run that diverged (or would save non-finite weights): a runtime failure, exit 1.
class DivergenceError : public Error {
 public:
  explicit DivergenceError(const std::string& message) : Error(message, __FILE__, __LINE__) {}
};

// ---- data ---------------------------------------------------------------------------------------

struct Data {
  // The loaders' sources: data sets held in memory (IDX, CIFAR-10, synthetic), or image folders,
  // whose samples the loader's workers decode at every epoch.
  std::unique_ptr<data::SampleSource> train, test;
  data::Normalization normalization;
  int pad = 0;
  std::string description;
};

// Where a data set's files are expected, and what to do when they are not there.
[[noreturn]] void absent(const Options& o, const std::string& dir) {
  if (fs::exists(dir)) {
    CUDP_THROW(IoError, "--data ", o.data, ": --data-dir ", dir,
               " is a file; give the folder that holds the data set's files");
  }
  if (o.was_given("--data-dir")) {
    CUDP_THROW(IoError, "--data ", o.data, ": --data-dir ", dir,
               " does not exist; give the folder that holds the data set's files, or train on "
               "generated images with --data synthetic");
  }
  std::string how = o.data == "fashion-mnist"
                        ? "install the Debian/Ubuntu package dataset-fashion-mnist or pass "
                          "--data-dir DIR (a folder with Fashion-MNIST's IDX files)"
                    : o.data == "mnist" ? "pass --data-dir DIR (a folder with MNIST's IDX files)"
                                        : "pass --data-dir DIR (the folder cifar-10-batches-bin of "
                                          "CIFAR-10's binary version)";
  CUDP_THROW(IoError, "--data ", o.data, (o.was_given("--data") ? "" : " (the default)"), ": ",
             dir, " does not exist; ", how, ", or train on generated images with --data synthetic");
}

// --data folder: DIR/train and DIR/val (or DIR/test), decoded on the loader's workers.
void load_folder(const Options& o, Data& d) {
  const fs::path root(o.data_dir);
  const fs::path train = root / "train", test = fs::is_directory(root / "val") ? root / "val"
                                                                              : root / "test";
  if (!fs::is_directory(train) || !fs::is_directory(test)) {
    CUDP_THROW(IoError, "--data folder: ", o.data_dir, " needs the sub-folders train/ and val/ "
               "(or test/), each with one folder of images per class");
  }
  data::ImageFolderOptions f;
  f.size = o.image_size;
  f.transform = o.augment ? data::ImageTransform::Train : data::ImageTransform::Eval;
  auto train_set = std::make_unique<data::ImageFolder>(train.string(), f, "folder/train");
  f.transform = data::ImageTransform::Eval;
  f.classes = train_set->classes();  // the test labels follow train's
  auto test_set = std::make_unique<data::ImageFolder>(test.string(), f,
                                                      "folder/" + test.filename().string());
  const std::string eval = detail::str("Resize(", data::eval_resize(o.image_size), ") + CenterCrop(",
                                       o.image_size, ")");
  d.description = detail::str(
      "images from ", o.data_dir, " (", train_set->num_classes(),
      " classes, decoded every epoch on ", o.workers, " worker(s); train: ",
      o.augment ? detail::str("RandomResizedCrop(", o.image_size, ") + RandomHorizontalFlip")
                : eval + " (no --augment)",
      ", test: ", eval, ", ImageNet mean and std)");
  if (o.limit_train > 0 && o.limit_train < train_set->size()) {
    d.description += detail::str(", first ", o.limit_train, " of ", train_set->size(), " train images");
    train_set->keep_first(o.limit_train);
  }
  if (o.limit_test > 0 && o.limit_test < test_set->size()) {
    d.description += detail::str(", first ", o.limit_test, " of ", test_set->size(), " test images");
    test_set->keep_first(o.limit_test);
  }
  d.normalization = data::imagenet_normalization();  // torchvision's recipe for photographs
  d.train = std::move(train_set);
  d.test = std::move(test_set);
}

// A data set's train and test splits, the test split read on a thread of its own meanwhile: it is
// start-up time (Fashion-MNIST's test split decompresses in 35 ms beside the train split's 0.2 s).
// A failure of the train split is the one reported, as when they were read in turn.
template <class Load>
void load_splits(const Load& load, data::Dataset& train, data::Dataset& test) {
  auto test_split = std::async(std::launch::async, load, false);
  train = load(true);
  test = test_split.get();
}

Data load_data(const Options& o) {
  Data d;
  if (o.data == "folder") {
    load_folder(o, d);
    return d;
  }
  data::Dataset train, test;
  if (o.data == "synthetic") {
    if (o.was_given("--data-dir")) {
      throw UsageError(detail::str("--data synthetic generates its images and reads no files, "
                                   "so --data-dir ", o.data_dir, " would be ignored; drop one "
                                   "of the two"));
    }
    data::SyntheticOptions s;
    s.seed = o.seed;
    if (o.image_size != 32) {  // photographs' shape: 3 channels at the size asked for
      s.h = s.w = o.image_size;
      s.c = 3;
      // Samples are independent draws: generate only the ones used (a 224x224x3 set is large).
      if (o.limit_train > 0) s.n_train = std::min(s.n_train, o.limit_train);
      if (o.limit_test > 0) s.n_test = std::min(s.n_test, o.limit_test);
    } else {
      d.pad = 2;  // 28x28x1 like Fashion-MNIST, padded to 32x32
    }
    train = data::make_synthetic(s, true);
    test = data::make_synthetic(s, false);
    d.description = detail::str("synthetic (", s.h, "x", s.w, "x", s.c, ", 10 classes)");
  } else if (o.data == "cifar10") {
    const std::string dir = o.data_dir.empty() ? "cifar-10-batches-bin" : o.data_dir;
    if (!fs::is_directory(dir)) absent(o, dir);
    load_splits([&dir](bool train_split) { return data::load_cifar10(dir, train_split); }, train,
                test);
    d.description = "CIFAR-10 from " + dir;
  } else {
    const std::string dir = !o.data_dir.empty()         ? o.data_dir
                            : o.data == "fashion-mnist" ? "/usr/share/datasets/fashion-mnist"
                                                        : "/usr/share/datasets/mnist";
    if (!fs::is_directory(dir)) absent(o, dir);
    load_splits([&](bool train_split) { return data::load_mnist_like(dir, train_split, o.data); },
                train, test);
    d.pad = 2;
    d.description = o.data + " from " + dir;
  }
  // --limit-train / --limit-test: the first N images of each set (tests, CI, quick experiments).
  const auto limit = [](data::Dataset& set, int64_t n, const char* which) -> std::string {
    if (n <= 0 || n >= set.size()) return "";
    const std::string note = detail::str(", first ", n, " of ", set.size(), " ", which, " images");
    set.labels.resize(static_cast<size_t>(n));
    set.images.resize(static_cast<size_t>(n * set.image_bytes()));
    return note;
  };
  d.description += limit(train, o.limit_train, "train");
  d.description += limit(test, o.limit_test, "test");
  d.normalization = data::compute_normalization(train);
  d.train = std::make_unique<data::DatasetSource>(std::move(train));
  d.test = std::make_unique<data::DatasetSource>(std::move(test));
  return d;
}

std::shared_ptr<Vgg> build_model(const Options& o, const Data& d) {
  VggOptions v;
  v.in_channels = static_cast<int>(d.train->channels());
  v.num_classes = d.train->num_classes();
  v.batch_norm = o.bn;
  v.dropout = static_cast<float>(o.dropout);
  v.head = o.head == "compact" ? VggHead::Compact : VggHead::Torchvision;
  v.seed = o.seed;
  const std::string& a = o.arch;
  const char config = a == "vgg11" ? 'A' : a == "vgg13" ? 'B' : a == "vgg16" ? 'D' : 'E';
  return vgg(config, v);
}

// --save-test-set: the test images exactly as the loader reads them (before normalisation), their
// labels and the normalisation, so that another framework can evaluate a checkpoint on the very
// same inputs (scripts/imagefolder-check.sh does, in PyTorch).
void save_test_set(const std::string& path, const Data& d, const data::Normalization& norm,
                   int workers) {
  check_output_file(path, "--save-test-set");
  const data::Dataset t = data::materialize(*d.test, 0, 0, workers);
  TensorMap tensors;
  tensors["images"] = Tensor::from_vector<uint8_t>(t.images, {t.size(), t.height, t.width, t.channels});
  tensors["labels"] = Tensor::from_vector<int32_t>(t.labels, {t.size()});
  Metadata meta;
  const auto join = [](const std::vector<float>& v) {
    std::string s;
    for (float x : v) {
      if (!s.empty()) s += ',';
      s += detail::str(x);
    }
    return s;
  };
  meta["mean"] = join(norm.mean);
  meta["std"] = join(norm.std);
  meta["pad"] = std::to_string(d.pad);
  meta["layout"] = "NHWC uint8; model input = NCHW of (pad(images) / 255 - mean) / std";
  save_safetensors(path, tensors, meta);
  std::printf("test set written to %s (%lld images)\n", path.c_str(),
              static_cast<long long>(t.size()));
}

// ---- optimizer and schedule ---------------------------------------------------------------------

// parallel::Replicated<Opt> behind one interface, so --opt picks SGD or AdamW at run time.
class TrainOptimizer {
 public:
  virtual ~TrainOptimizer() = default;
  virtual void zero_grad() = 0;
  virtual void step() = 0;
  virtual void step(const Tensor& skip) = 0;  // skipped on the device when *skip != 0
  virtual Tensor step_and_grad_norm() = 0;    // step(), and the primary's gradient norm
  virtual int64_t skipped_steps() = 0;        // by step(skip) so far; waits for the device
  virtual Tensor clip_grad_norm(double max_norm) = 0;
  virtual Optimizer& primary() = 0;
  virtual Optimizer& replica(size_t r) = 0;
  virtual size_t size() const = 0;
  virtual void load_state_dict(const TensorMap& state) = 0;
  // The replicas take the primary's rate and momentum (before a graph replay: GraphedStep).
  virtual void follow_primary() = 0;
  // --overlap-update on: each bucket's update beside the backward (Replicated::set_update_overlap).
  virtual void set_update_overlap(parallel::DataParallel& dp) = 0;
  virtual void set_update_overlap(DistributedDataParallel& ddp) = 0;
  virtual bool last_step_overlapped() const = 0;
};

template <class Opt>
class ReplicatedOptimizer final : public TrainOptimizer {
 public:
  ReplicatedOptimizer(Module& model, const typename parallel::Replicated<Opt>::Options& options)
      : r_(model, options) {}
  void zero_grad() override { r_.zero_grad(ZeroGrad::deferred); }  // layers/module.h
  void step() override { r_.step(); }
  void step(const Tensor& skip) override { r_.step(skip); }
  Tensor step_and_grad_norm() override { return r_.step_and_grad_norm(); }
  int64_t skipped_steps() override { return r_.skipped_steps(); }
  Tensor clip_grad_norm(double max_norm) override { return r_.clip_grad_norm(max_norm); }
  Optimizer& primary() override { return r_.primary(); }
  Optimizer& replica(size_t r) override { return r_.replica(r); }
  size_t size() const override { return r_.size(); }
  void load_state_dict(const TensorMap& state) override { r_.load_state_dict(state); }
  void follow_primary() override { r_.follow_primary(); }
  void set_update_overlap(parallel::DataParallel& dp) override { r_.set_update_overlap(dp, true); }
  void set_update_overlap(DistributedDataParallel& ddp) override {
    r_.set_update_overlap(ddp, true);
  }
  bool last_step_overlapped() const override { return r_.last_step_overlapped(); }

 private:
  parallel::Replicated<Opt> r_;
};

std::unique_ptr<TrainOptimizer> make_optimizer(const Options& o, Module& model) {
  if (o.opt == "adamw") {
    return std::make_unique<ReplicatedOptimizer<AdamW>>(
        model, AdamWOptions{.lr = o.lr, .beta1 = o.momentum, .weight_decay = o.weight_decay});
  }
  return std::make_unique<ReplicatedOptimizer<SGD>>(
      model, SGDOptions{.lr = o.lr, .momentum = o.momentum, .weight_decay = o.weight_decay});
}

// Linear warm-up over the first `warmup` steps (lr * (n + 1) / warmup), then `after` shifted by
// them (or the base rate). Closed form in the step like every schedule, so a resume's set_step
// lands on the same rate.
class WarmupLR final : public LRScheduler {
 public:
  WarmupLR(Optimizer& optimizer, int64_t warmup, std::unique_ptr<LRScheduler> after)
      : LRScheduler(optimizer), warmup_(warmup), after_(std::move(after)) {
    set_step(0);
  }
  double lr_at(int64_t n) const override {
    if (n < warmup_) return base_lr_ * static_cast<double>(n + 1) / static_cast<double>(warmup_);
    return after_ ? after_->lr_at(n - warmup_) : base_lr_;
  }
  std::optional<double> momentum_at(int64_t n) const override {
    return after_ && n >= warmup_ ? after_->momentum_at(n - warmup_) : std::nullopt;
  }

 private:
  int64_t warmup_;
  std::unique_ptr<LRScheduler> after_;
};

std::unique_ptr<LRScheduler> make_schedule(const Options& o, Optimizer& opt,
                                           int64_t steps_per_epoch) {
  const int64_t warmup = o.warmup_epochs * steps_per_epoch;
  const int64_t steps = std::max<int64_t>(steps_per_epoch * o.epochs - warmup, 1);
  std::unique_ptr<LRScheduler> s;
  if (o.schedule == "onecycle") {
    OneCycleOptions c;
    c.max_lr = o.lr;
    c.total_steps = steps;
    s = std::make_unique<OneCycleLR>(opt, c);
  } else if (o.schedule == "cosine") {
    s = std::make_unique<CosineAnnealingLR>(opt, steps);
  } else if (o.schedule == "step") {
    s = std::make_unique<StepLR>(opt, std::max<int64_t>(steps / 3, 1), 0.1);
  }
  if (warmup == 0) return s;
  opt.set_lr(o.lr);  // the warm-up's base rate (the schedule above set its step-0 rate)
  return std::make_unique<WarmupLR>(opt, warmup, std::move(s));
}

// ---- checkpoint metadata ------------------------------------------------------------------------

// Dropout seeds and offsets are part of an exact resume but not of the state dict (torchvision's
// Dropout has no state): they travel in the metadata. Replica 0's are saved and restored before the
// replicas are made (their seeds derive from it, engine/parallel/replicate.h).
void save_dropout_state(Module& model, Metadata& meta) {
  for (auto& [name, m] : model.named_modules()) {
    if (auto* d = dynamic_cast<Dropout*>(m)) {
      meta["dropout_seed." + name] = std::to_string(d->seed());
      meta["dropout_offset." + name] = std::to_string(d->offset());
    }
  }
}
void load_dropout_state(Module& model, const Metadata& meta, const std::string& file) {
  for (auto& [name, m] : model.named_modules()) {
    if (auto* d = dynamic_cast<Dropout*>(m)) {
      const std::string seed = "dropout_seed." + name, offset = "dropout_offset." + name;
      d->set_seed(meta.count(seed) ? metadata_uint(meta, seed, file) : d->seed(),
                  meta.count(offset) ? metadata_uint(meta, offset, file) : 0);
    }
  }
}

// --print-checksum: FNV-1a (64 bit) over every state_dict() entry in key order, name and bytes.
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

// The gradient of PyTorch's CrossEntropyLoss(label_smoothing=e) for the last criterion.forward:
// (softmax - onehot) / N + e (onehot - 1/K) / N. The library's loss has no smoothing; its
// gradient on all-zero logits is exactly (1/K - onehot) / N (a uniform softmax), so the second
// term is that gradient scaled by -e, added on the logits' device.
// `weight` is the one criterion.forward was given (a micro-batch's share of the batch,
// --accumulate).
Tensor smoothed_gradient(const CrossEntropyLoss& criterion, const Tensor& logits,
                         const Tensor& labels, double smoothing, double weight = 1.0) {
  Tensor grad = criterion.backward();
  CrossEntropyLoss uniform;
  uniform.forward(Tensor::zeros(logits.shape(), DType::f32, logits.device()), labels, weight);
  const Tensor extra = uniform.backward(-smoothing);
  if (logits.device().is_cuda()) {
    const cuda::DeviceGuard guard(logits.device().index);
    kernels::axpy(1.0f, extra.data<float>(), grad.data<float>(), grad.numel(),
                  cuda::current_stream(logits.device().index));
  } else {
    kernels::axpy_cpu(1.0f, extra.data<float>(), grad.data<float>(), grad.numel());
  }
  return grad;
}

// ---- batches and step results -------------------------------------------------------------------

// Batches of one loader on the first GPU (copied ahead by DevicePrefetcher), or on the host.
class BatchFeed {
 public:
  BatchFeed(data::Loader& loader, int device) : loader_(loader) {
    if (device >= 0) {
      prefetch_ = std::make_unique<data::DevicePrefetcher>(loader, std::vector<int>{device});
    }
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
    if (!loader_.next(host_)) return false;
    images = host_.images;
    labels = host_.labels;
    return true;
  }

 private:
  data::Loader& loader_;
  std::unique_ptr<data::DevicePrefetcher> prefetch_;
  data::Batch host_;
};

// What a step or an evaluation batch left behind, read later in one go: the 0-d loss and gradient
// norm, the logits and the labels are copied to pinned host buffers on the compute stream (reused:
// no allocation per step). read() waits for the device once, then adds the finite steps to the sums
// (mean loss, top-1, top-5) and returns the others, in order. It reads host memory only: a copy of
// each step's loss and norm from the device there, after the wait, kept the drained GPU idle for
// two synchronous copies per step read.
class StepResults {
 public:
  struct Bad {
    int64_t step;  // the global step (1-based), or the batch index in an evaluation
    int64_t batch;
    std::string what;  // "the loss is nan"
  };

  // smoothing: the loss summed is the label-smoothed one, computed here from the logits (the device
  // loss, plain cross-entropy, still decides whether a step is finite).
  // training: the steps of a training epoch, whose non-finite ones are left out of the sums (they
  // stop the run, or were skipped); an evaluation sums every batch.
  StepResults(int device, bool training, double smoothing = 0)
      : device_(device), training_(training), smoothing_(smoothing) {}

  // `weight`: the one the loss was computed with (DistributedDataParallel's loss_weight(), n_r /
  // B); the loss read back is divided by it, so the sums hold this rank's own mean losses.
  // `decides`, when defined: the ranks' summed loss, which decided whether the step was skipped
  // (--on-nan skip-step under DistributedDataParallel); a step is bad when it or the norm is not
  // finite, so that every rank leaves the same steps out.
  void add(int64_t step, int64_t batch, const Tensor& loss, const Tensor& norm,
           const Tensor& logits, const Tensor& labels, double weight = 1.0,
           const Tensor& decides = Tensor()) {
    Pending p{step, batch, loss, norm, decides, {}, {}, labels.numel(), {}, weight};
    if (device_ < 0) {
      p.logits = logits.clone();
      p.labels = labels.clone();
    } else {
      const cudaStream_t stream = cuda::current_stream(device_);
      Buffers b = take(logits.shape(), labels.numel());
      p.logits = b.logits.slice(0, p.n);
      p.labels = b.labels.slice(0, p.n);
      p.logits.copy_from(logits, stream);
      p.labels.copy_from(labels, stream);
      p.loss = to_host(loss, b.scalars.slice(0, 1), stream);
      p.norm = to_host(norm, b.scalars.slice(1, 2), stream);
      p.decides = to_host(decides, b.scalars.slice(2, 3), stream);
      p.buffers = b;
    }
    pending_.push_back(std::move(p));
  }
  size_t pending() const { return pending_.size(); }

  std::vector<Bad> read() {
    if (device_ >= 0 && !pending_.empty()) cuda::synchronize(device_);
    std::vector<Bad> bad;
    for (Pending& p : pending_) {
      if (p.buffers.logits.defined()) free_.push_back(p.buffers);
      const float loss = p.loss.to_vector<float>()[0];
      const float norm = p.norm.defined() ? p.norm.to_vector<float>()[0] : 0.f;
      const float decides = p.decides.defined() ? p.decides.to_vector<float>()[0] : loss;
      if (!std::isfinite(loss) || !std::isfinite(decides) || !std::isfinite(norm)) {
        bad.push_back(Bad{p.step, p.batch,
                          !std::isfinite(loss)      ? "the loss is " + number_text(loss)
                          : !std::isfinite(decides) ? "another rank's loss is not finite (the "
                                                      "ranks' sum is " +
                                                          number_text(decides) + ")"
                                                    : "the gradient norm is " + number_text(norm)});
        if (training_) continue;
      }
      const double smoothed_sum = count_top_k(p);
      last_norm_ = norm;
      const double mean_loss = smoothing_ > 0 ? smoothed_sum / static_cast<double>(p.n)
                                              : static_cast<double>(loss) / p.weight;
      last_loss_ = static_cast<float>(mean_loss);
      last_count_ = p.n;
      loss_sum_ += mean_loss * static_cast<double>(p.n);
      count_ += p.n;
    }
    pending_.clear();
    return bad;
  }

  void reset() {
    read();
    loss_sum_ = 0;
    count_ = top1_ = top5_ = 0;
  }
  int64_t count() const { return count_; }
  double mean_loss() const { return count_ ? loss_sum_ / static_cast<double>(count_) : 0.0; }
  double top1() const { return count_ ? 100.0 * static_cast<double>(top1_) / count_ : 0.0; }
  double top5() const { return count_ ? 100.0 * static_cast<double>(top5_) / count_ : 0.0; }
  float last_loss() const { return last_loss_; }
  float last_norm() const { return last_norm_; }  // the gradient norm before clipping
  int64_t last_count() const { return last_count_; }
  int64_t top1_count() const { return top1_; }
  int64_t top5_count() const { return top5_; }
  double loss_sum() const { return loss_sum_; }

 private:
  struct Buffers {
    Tensor logits, labels, scalars;  // pinned, [capacity, classes], [capacity] and [3]
  };
  struct Pending {
    int64_t step, batch;
    Tensor loss, norm, decides, logits, labels;
    int64_t n;
    Buffers buffers;
    double weight;
  };

  Buffers take(const Shape& logits_shape, int64_t n) {
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].logits.shape()[0] >= n && free_[i].logits.shape()[1] == logits_shape[1]) {
        Buffers b = free_[i];
        free_.erase(free_.begin() + static_cast<ptrdiff_t>(i));
        return b;
      }
    }
    return {Tensor::empty(logits_shape, DType::f32, Device::cpu(), true),
            Tensor::empty({n}, DType::i32, Device::cpu(), true),
            Tensor::empty({3}, DType::f32, Device::cpu(), true)};
  }

  // A one-element result of the step (undefined: none), as read() will find it: copied into the
  // pinned `slot` on the stream where it is on the device.
  static Tensor to_host(const Tensor& value, const Tensor& slot, cudaStream_t stream) {
    if (!value.defined() || !value.is_cuda()) return value;
    Tensor host = slot.view(value.shape());
    host.copy_from(value, stream);
    return host;
  }

  // Top-k as torch.topk / torch.max count it: the label's logit ranks k-th or better, ties going
  // to the lower index (torch.max(x, 1)[1] returns the first maximum). Returns the batch's summed
  // label-smoothed loss, (1 - e) (lse - x_label) + e (lse - mean x), in double.
  double count_top_k(const Pending& p) {
    const std::vector<float> x = p.logits.to_vector<float>();
    const std::vector<int32_t> y = p.labels.to_vector<int32_t>();
    const int64_t k = p.logits.shape()[1];
    double smoothed = 0;
    for (int64_t i = 0; i < p.n; ++i) {
      const float* row = x.data() + i * k;
      const int32_t label = y[static_cast<size_t>(i)];
      if (label < 0 || label >= k || std::isnan(row[label])) {
        smoothed += std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      if (smoothing_ > 0) {
        double max = row[0], sum = 0, mean = 0;
        for (int64_t j = 0; j < k; ++j) max = std::max(max, static_cast<double>(row[j]));
        for (int64_t j = 0; j < k; ++j) {
          sum += std::exp(row[j] - max);
          mean += row[j];
        }
        const double lse = max + std::log(sum);
        smoothed += (1 - smoothing_) * (lse - row[label]) + smoothing_ * (lse - mean / k);
      }
      int64_t rank = 0;
      for (int64_t j = 0; j < k; ++j) {
        rank += row[j] > row[label] || (row[j] == row[label] && j < label) || std::isnan(row[j]);
      }
      top1_ += rank == 0;
      top5_ += rank < 5;
    }
    return smoothed;
  }

  int device_;
  bool training_;
  double smoothing_;
  std::vector<Pending> pending_;
  std::vector<Buffers> free_;
  double loss_sum_ = 0;
  int64_t count_ = 0, top1_ = 0, top5_ = 0;
  float last_loss_ = 0, last_norm_ = 0;
  int64_t last_count_ = 0;
};

class JsonLog {
 public:
  explicit JsonLog(const std::string& path) : path_(path) {
    if (path.empty()) return;
    check_output_file(path, "--json");
    out_.open(path, std::ios::app);
    if (!out_) CUDP_THROW(IoError, "--json ", path, " cannot be opened for appending");
  }
  void write(const nlohmann::json& j) {
    if (path_.empty()) return;
    out_ << j.dump() << '\n' << std::flush;
    if (!out_) CUDP_THROW(IoError, "--json ", path_, ": writing failed (is the disk full?)");
  }

 private:
  std::string path_;
  std::ofstream out_;
};

// ---- ranks --------------------------------------------------------------------------------------

// This process's place in a multi-process launch (mpirun -np N cudp-vgg ...): rank 0 of 1 without
// one. Lives outside run() so that main can end a failed rank without MPI_Finalize (see main).
struct Ranks {
  int rank = 0, world = 1, local_rank = 0;
  std::unique_ptr<parallel::mpi::Session> session;        // MPI, for every multi-process run
  std::shared_ptr<parallel::ProcessGroup> process_group;  // NCCL, when the ranks train on GPUs
  std::shared_ptr<parallel::DistributedGroup> group;      // what DistributedDataParallel uses

  bool distributed() const { return world > 1; }
  // The groups, then MPI (MPI_Finalize), in that order.
  void finish() {
    group.reset();
    process_group.reset();
    session.reset();
  }
  // Sums `values` over the ranks, in place (collective: every rank calls it at the same point).
  // f32, as the collectives move them: the counts summed (images, correct answers of an epoch)
  // are exact below 2^24, the loss sums good to 7 digits.
  void sum(std::vector<float>& values) const {
    if (!distributed() || values.empty()) return;
    if (process_group) {
      const Tensor t = Tensor::from_vector(values, {static_cast<int64_t>(values.size())})
                           .to(Device::cuda(process_group->devices()[0]));
      process_group->comm().all_reduce({t});
      // The host waits for the sum anyway; through synchronize() a collective the watchdog ended
      // throws its error here, instead of t.cpu() reading this rank's unreduced values.
      process_group->comm().synchronize();
      values = t.cpu().to_vector<float>();
    } else {
      session->all_reduce_sum(values.data(), values.size());
    }
  }
};
Ranks g_ranks;

// A test hook (tests/examples/mpi_vgg_test.cpp): CUDP_TEST_NAN_LOSS="<rank>:<step>" makes that
// rank's loss NaN at that global step (from 1), as a bad batch on one rank would, with the
// gradients left finite; under mpirun only, and with CUDA graphs off while it is set (a replayed
// graph would keep what it captured). Whether every rank then skips the step under --on-nan
// skip-step is what the test checks.
struct NanLossAt {
  int rank = -1;
  int64_t step = -1;
};
NanLossAt nan_loss_at() {
  NanLossAt at;
  const char* env = std::getenv("CUDP_TEST_NAN_LOSS");
  long long step = -1;
  if (env == nullptr || std::sscanf(env, "%d:%lld", &at.rank, &step) != 2) return {};
  at.step = step;
  return at;
}

// What a StepResults holds, summed over the ranks (collective), so that rank 0 prints the figures
// of the global batch and epoch; a single process's own.
struct Figures {
  double mean_loss, top1, top5, last_loss;
};
Figures global_figures(const StepResults& r) {
  if (!g_ranks.distributed()) return {r.mean_loss(), r.top1(), r.top5(), r.last_loss()};
  std::vector<float> v{static_cast<float>(r.loss_sum()),
                       static_cast<float>(r.count()),
                       static_cast<float>(r.top1_count()),
                       static_cast<float>(r.top5_count()),
                       static_cast<float>(static_cast<double>(r.last_loss()) * r.last_count()),
                       static_cast<float>(r.last_count())};
  g_ranks.sum(v);
  const auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  return {ratio(v[0], v[1]), 100 * ratio(v[2], v[1]), 100 * ratio(v[3], v[1]), ratio(v[4], v[5])};
}

// A loss as printed: NaN without its sign bit ("nan", not printf's "-nan").
double shown(double loss) {
  return std::isnan(loss) ? std::fabs(loss) : loss;
}

void progress(bool tty, int64_t epoch, int64_t epochs, int64_t step, int64_t steps,
              double images_per_s, float loss, double mean_loss, double eta) {
  if (tty) {
    const int width = 30;
    const int filled = static_cast<int>(width * step / std::max<int64_t>(steps, 1));
    std::printf(
        "\repoch %lld/%lld [%-*s] %lld/%lld  %8.0f img/s  loss %.4f (mean %.4f)  ETA %5.1f s ",
        static_cast<long long>(epoch + 1), static_cast<long long>(epochs), width,
        std::string(filled, '=').c_str(), static_cast<long long>(step),
        static_cast<long long>(steps), images_per_s, shown(loss), shown(mean_loss), eta);
  } else {
    std::printf("epoch %lld/%lld step %lld/%lld  %.0f img/s  loss %.4f (mean %.4f)\n",
                static_cast<long long>(epoch + 1), static_cast<long long>(epochs),
                static_cast<long long>(step), static_cast<long long>(steps), images_per_s,
                shown(loss), shown(mean_loss));
  }
  std::fflush(stdout);
}

// The checkpoint of --resume: a run folder means its last checkpoint.
std::string resume_path(const std::string& given) {
  if (fs::is_directory(given)) return (fs::path(given) / "last.safetensors").string();
  return given;
}

// A file to evaluate with nothing of a cudp checkpoint beside it (no training-state file, no
// previous save): a model's weights alone, a state dict as PyTorch saves it
// (safetensors.torch.save_file(model.state_dict(), path)). It records no settings.
bool weights_only_file(const std::string& path) {
  std::error_code ignored;
  const std::string prev = previous_checkpoint_path(path);
  for (const std::string& p : {optimizer_state_path(path), prev, optimizer_state_path(prev)}) {
    if (fs::exists(p, ignored)) return false;
  }
  return fs::is_regular_file(path, ignored);
}

// Under a launcher that started more than one process (mpirun, srun): MPI, this process's rank,
// and its standard output sent to /dev/null unless it is rank 0.
void join_ranks() {
  const parallel::LaunchInfo env = parallel::launch_info_from_env();
  if (env.world_size <= 1) return;
  if (!parallel::mpi::available()) {
    throw UsageError(detail::str(
        "this process is rank ", env.rank, " of ", env.world_size, " (", env.source,
        "), but this cudp-vgg was built without MPI: rebuild with MPI (Debian: libopenmpi-dev, "
        "cmake "
        "-DCUDP_WITH_MPI=ON) to train as one of several processes, or run it as one process"));
  }
  g_ranks.session = std::make_unique<parallel::mpi::Session>();
  const parallel::LaunchInfo info = g_ranks.session->info();
  g_ranks.rank = info.rank;
  g_ranks.world = info.world_size;
  g_ranks.local_rank = info.local_rank;
  if (g_ranks.rank != 0 && !std::freopen("/dev/null", "w", stdout)) {
    CUDP_THROW(IoError, "rank ", g_ranks.rank, ": cannot send its standard output to /dev/null");
  }
}

int run(Options o) {
  join_ranks();
  const bool distributed = g_ranks.distributed();
  const int rank = g_ranks.rank;
  const int visible = cuda::device_count();
  std::vector<int> gpus = o.gpus;
  if (distributed && !o.no_gpus) {
    // One GPU per rank, picked by the local rank (or device 0 of a rank that sees only one).
    if (!gpus.empty()) {
      throw UsageError(
          "--gpus with several processes: each process drives one GPU, picked by its "
          "local rank; leave --gpus out (restrict them with CUDA_VISIBLE_DEVICES), "
          "or give --gpus none to train on the CPU");
    }
    if (visible == 0) {
      const std::string reason = cuda::unavailable_reason();
      throw UsageError(detail::str("rank ", rank, " sees no GPU",
                                   reason.empty() ? "" : " (" + reason + ")",
                                   "; give --gpus none to train on the "
                                   "CPU with MPI moving the gradients"));
    }
    gpus.push_back(parallel::device_for_local_rank(g_ranks.local_rank, visible));
  }
  if (gpus.empty() && !o.no_gpus) {
    // By default every visible GPU, or the CPU on a machine without one; but not the CPU instead
    // of GPUs that CUDA cannot use (an old driver, a CUDA_VISIBLE_DEVICES naming none): hours of
    // training on the CPU are not what such a run asked for.
    if (visible == 0) {
      if (const std::string reason = cuda::unavailable_reason(); !reason.empty()) {
        throw Error("no GPU can be used: " + reason + "; or give --gpus none to train on the CPU",
                    __FILE__, __LINE__);
      }
    }
    for (int i = 0; i < visible; ++i) gpus.push_back(i);
  }
  for (int g : gpus) {
    try {
      cuda::check_device(g);
    } catch (const ValueError& e) {
      // Left out, --gpus takes the CPU only where no GPU is to be had (not where CUDA failed).
      const bool cpu_by_default = visible == 0 && cuda::unavailable_reason().empty();
      throw UsageError("--gpus: " + e.message() +
                       (visible == 0
                            ? cpu_by_default
                                  ? "; train on the CPU with --gpus none (or leave --gpus out)"
                                  : "; train on the CPU with --gpus none"
                            : ""));
    }
  }
  // The main thread's current device is the run's first GPU: every DeviceGuard restores it, and
  // restoring device 0 would make a CUDA context there (~0.5 GB) on a GPU the run does not use
  // (each rank but one under mpirun, or --gpus 1).
  if (!gpus.empty()) cuda::set_device(gpus[0]);

  // A resumed run takes the checkpoint's settings before anything depends on them. Evaluating a
  // file of weights alone needs no training state, and takes the command line's settings.
  std::string resume_file, state_file;
  CheckpointFiles resumed_files;
  Metadata resumed_meta;
  if (!o.resume.empty()) resume_file = resume_path(o.resume);
  const bool weights_only = o.eval_only && !resume_file.empty() && weights_only_file(resume_file);
  if (!resume_file.empty() && !weights_only) {
    // The last complete save (a torn pair falls back to the previous one, layers/checkpoint.h).
    resumed_files = find_checkpoint(resume_file);
    if (resumed_files.fallback && rank == 0) {  // once, not once per rank (stderr is not muted)
      std::fprintf(stderr, "warning: %s\n", resumed_files.note.c_str());
    }
    state_file = resumed_files.train;
    resumed_meta = load_checkpoint_metadata(resume_file);
    adopt_settings(o, resumed_meta, state_file);
    // A run folder resumes in place: where it is now, wherever it was first written (it may have
    // been copied or moved since), unless --output says otherwise.
    if (fs::is_directory(o.resume) && !o.was_given("--output")) o.output = o.resume;
  }
  resolve_and_check(o);
  const cuda::VisibleDevices vis = cuda::visible_devices();
  std::printf("cudp-vgg: %d visible GPU(s)%s%s\n", visible,
              vis.set ? (" (CUDA_VISIBLE_DEVICES=\"" + vis.raw + "\")").c_str() : "",
              o.no_gpus ? " (--gpus none: the CPU)" : "");
  if (distributed) {
    std::printf(
        "processes: %d (rank 0 prints, evaluates and writes; the others are silent unless "
        "they fail)\n",
        g_ranks.world);
  }
  int64_t start_epoch = 0, global_step = 0;
  if (!resume_file.empty() && !weights_only) {
    start_epoch = metadata_int(resumed_meta, "epoch", 0, 1000000, state_file);
    global_step = metadata_int(resumed_meta, "step", 0, std::numeric_limits<int64_t>::max(),
                               state_file);
    if (!o.eval_only && o.epochs < start_epoch) {
      throw UsageError(detail::str("--epochs ", o.epochs, " is less than the checkpoint's epoch ",
                                   start_epoch, ": nothing to train (--eval-only evaluates it)"));
    }
    if (!o.eval_only && o.stop_after > 0 && o.stop_after <= start_epoch) {
      throw UsageError(detail::str("--stop-after ", o.stop_after, ": the checkpoint is already at "
                                   "epoch ", start_epoch, "; give a later epoch or leave it out"));
    }
    // Each rank's shard of an epoch, and so the training, depends on the number of ranks.
    const int64_t saved_world =
        resumed_meta.count("world_size")
            ? metadata_int(resumed_meta, "world_size", 1, std::numeric_limits<int>::max(),
                           state_file)
            : 1;  // written before multi-process training: one process
    if (resumed_meta.count("sampler_epoch") &&
        metadata_int(resumed_meta, "sampler_epoch", 0, 1000000, state_file) != start_epoch) {
      CUDP_THROW(IoError, state_file, ": the saved sampler position (epoch ",
                 resumed_meta.at("sampler_epoch"), ") is not the checkpoint's epoch ", start_epoch,
                 "; the file is damaged or was not written by cudp-vgg");
    }
    if (!o.eval_only && saved_world != g_ranks.world) {
      throw UsageError(detail::str(
          "--resume ", o.resume, ": the checkpoint was written by a run of ", saved_world,
          " process(es), this run has ", g_ranks.world, "; an exact resume needs the same number (",
          saved_world > 1 ? detail::str("mpirun -np ", saved_world, " cudp-vgg ...")
                          : std::string("one process, without mpirun"),
          "): each process's share of every epoch depends on it"));
    }
  }

  // Every output is checked before anything is loaded or trained.
  // Rank 0 alone writes files.
  const bool training = !o.eval_only;
  const bool writer = rank == 0;
  std::unique_ptr<RunFolder> folder;
  if (writer && training && !o.checkpoint.empty()) {
    check_output_file(o.checkpoint, "--checkpoint");
  }
  if (writer && training && !o.checkpoint.empty()) {
    check_output_file(optimizer_state_path(o.checkpoint), "--checkpoint");
  }
  JsonLog json(writer ? o.json : std::string());
  if (writer && training && !o.output.empty()) {
    folder = std::make_unique<RunFolder>(o.output, start_epoch, o.command_line, settings_text(o));
  }

  const Data d = load_data(o);
  std::printf("data: %s: %lld train, %lld test images\n", d.description.c_str(),
              static_cast<long long>(d.train->size()), static_cast<long long>(d.test->size()));
  if (d.test->size() == 0) {
    // Every epoch reports a test accuracy, and the best checkpoint is chosen by it: from no images
    // it would be a number that means nothing.
    CUDP_THROW(IoError, "--data ", o.data, ": the test split holds no images (", d.description,
               "); give a data set with a test split");
  }

  data::LoaderOptions lo;
  lo.batch_size = o.batch_size;
  lo.seed = o.seed;
  lo.normalization = d.normalization;
  lo.pad = d.pad;
  lo.workers = static_cast<int>(o.workers);
  if (o.augment && o.data != "folder") {  // a folder's crop and flip are its own (load_folder)
    lo.random_crop = 4;
    lo.horizontal_flip = o.data == "cifar10" || (o.data == "synthetic" && o.image_size != 32);
  }
  if (distributed) {
    // This rank's shard of each epoch's order (the one a single process follows, from --seed and
    // the epoch), padded as PyTorch's DistributedSampler pads it.
    lo.sampler = std::make_shared<data::DistributedSampler>(
        d.train->size(), data::DistributedSamplerOptions{.rank = rank,
                                                         .world_size = g_ranks.world,
                                                         .shuffle = true,
                                                         .seed = o.seed,
                                                         .drop_last = false});
    std::printf(
        "each process: %lld of the %lld train images per epoch, batches of %lld (global "
        "batch %lld)\n",
        static_cast<long long>(lo.sampler->size()), static_cast<long long>(d.train->size()),
        static_cast<long long>(o.batch_size), static_cast<long long>(o.batch_size * g_ranks.world));
  }
  data::Loader train_loader(*d.train, lo);
  data::LoaderOptions to = lo;
  to.shuffle = false;
  to.sampler = nullptr;  // rank 0 evaluates the whole test set
  to.random_crop = 0;
  to.horizontal_flip = false;
  data::Loader test_loader(*d.test, to);
  if (writer && !o.save_test_set.empty()) {
    save_test_set(o.save_test_set, d, lo.normalization, static_cast<int>(o.workers));
  }

  const std::string model_advice =
      "The model does not fit: choose a smaller --arch, or --head compact.";
  std::shared_ptr<Vgg> net;
  {
    const cuda::AllocationPurpose purpose("the model's parameters on the host", model_advice);
    net = build_model(o, d);
  }
  if (o.sync_bn) {
    if (!o.bn) {
      throw UsageError(
          "--sync-bn synchronises the BatchNorm layers, but the model has none "
          "(--no-bn, or the --resume checkpoint's setting): drop --sync-bn");
    }
    // Every GPU's SyncBatchNorm takes part in each training forward, and DataParallel refuses a
    // batch that reaches fewer replicas; it scatters in torch.chunk's sizes (ceil(rows / GPUs)
    // each), so 5 rows on 4 GPUs fill only 3. Each epoch's last, smaller batch and the
    // micro-batches of --accumulate are checked here rather than after a whole epoch.
    const auto n_gpus = static_cast<int>(gpus.size());
    const int64_t last = d.train->size() % o.batch_size;
    for (const int64_t batch : {o.batch_size, last}) {
      if (distributed || n_gpus < 2 || batch == 0) break;
      for (const int64_t rows : parallel::chunk_sizes(batch, static_cast<int>(o.accumulate))) {
        const size_t reached = parallel::chunk_sizes(rows, n_gpus).size();
        if (reached == gpus.size()) continue;
        throw UsageError(detail::str(
            "--sync-bn on ", n_gpus, " GPUs: ",
            batch == o.batch_size ? detail::str("a batch of ", batch, " images")
                                  : detail::str("each epoch's last batch, of ", last, " of the ",
                                                d.train->size(), " training images,"),
            o.accumulate > 1 ? detail::str(" split into --accumulate ", o.accumulate,
                                           " micro-batches, has one of ", rows, " images that")
                             : std::string(),
            " reaches only ", reached, " of them (DataParallel gives each GPU ceil(", rows, " / ",
            n_gpus,
            ") images), and every GPU's batch norm takes part in each step; choose a "
            "--batch-size (or --limit-train, --accumulate) that gives every GPU images in every "
            "step"));
      }
    }
    // PyTorch's convert_sync_batchnorm; DataParallel (the GPUs of this process) or
    // DistributedDataParallel (the processes) gives the layers their group. The state_dict keys do
    // not change, so checkpoints load either way.
    convert_sync_batchnorm(net);
    std::printf("SyncBatchNorm: training normalises with the statistics of the whole batch%s\n",
                distributed       ? detail::str(" over all ", g_ranks.world, " processes").c_str()
                : gpus.size() > 1 ? " over all GPUs"
                                  : " (one device: the same as BatchNorm)");
  }
  const Precision precision = parse_precision(o.precision);
  net->set_precision(precision);
  for (int g : gpus) {
    if (precision != Precision::fp32 && !kernels::tensor_cores_available(g)) {
      throw UsageError(detail::str("--precision ", o.precision, " needs the tensor-core kernels of "
                                   "an sm_90 GPU (H100, H200); GPU ", g, " is not one: use "
                                   "--precision fp32 there"));
    }
  }
  const Device main_device = gpus.empty() ? Device::cpu() : Device::cuda(gpus[0]);
  std::string where = o.no_gpus ? "the CPU (--gpus none)" : "the CPU (no GPU visible)";
  if (!gpus.empty()) {
    where = "GPUs ";
    for (size_t i = 0; i < gpus.size(); ++i) where += (i ? "," : "") + std::to_string(gpus[i]);
  }
  // On the CPU the layers emulate the policy's operand rounding: bf16's rounding to nearest even,
  // TF32's truncation (layers/precision.h).
  const char* cpu_note = "";
  if (gpus.empty() && precision == Precision::bf16) cpu_note = " (emulated on the CPU)";
  if (gpus.empty() && precision == Precision::tf32) {
    cpu_note = " (emulated on the CPU: operands truncated to TF32, fp32 arithmetic)";
  }
  std::printf("model: %s%s (%s head, %lldx%lld input), %lld parameters, %s products%s, on %s\n",
              o.arch.c_str(), o.bn ? "-bn" : "", o.head.c_str(),
              static_cast<long long>(o.image_size), static_cast<long long>(o.image_size),
              static_cast<long long>(net->num_parameters()), o.precision.c_str(), cpu_note,
              where.c_str());

  // The checkpoint is read, and its model scanned for NaN, once for both of its loads: the model
  // now, the model and its optimizer once they are on their devices. Its host copies go after the
  // second.
  std::optional<CheckpointContents> resumed;
  if (weights_only) {
    try {
      load_weights(resume_file, *net);
    } catch (const ValueError& e) {
      throw UsageError(detail::str(e.message(),
                                   "; a file of weights alone records no settings: "
                                   "give the --arch, --bn/--no-bn, --head, --image-size and data "
                                   "set its model was trained with"));
    }
    std::printf(
        "evaluating the weights in %s (no training state beside them: the settings are "
        "the command line's)\n",
        resume_file.c_str());
  } else if (!resume_file.empty()) {
    resumed = read_checkpoint(resumed_files);
    load_checkpoint(*resumed, *net, nullptr);
    load_dropout_state(*net, resumed_meta, state_file);
    std::printf(
        "resumed from %s at epoch %lld (step %lld)\n",
        resumed_files.fallback
            ? detail::str(resumed_files.model, " (the last complete save at ", resume_file, ")")
                  .c_str()
            : resume_file.c_str(),
        static_cast<long long>(start_epoch), static_cast<long long>(global_step));
  }
  {
    const cuda::AllocationPurpose purpose(
        detail::str("the model's parameters, gradients and buffers on ", main_device),
        model_advice);
    net->to(main_device);
  }

  // For the communicator DataParallel makes (at least a millisecond: the watchdog's resolution).
  parallel::Communicator::set_default_timeout(std::chrono::milliseconds(
      std::max<long long>(1, std::llround(o.collective_timeout * 1000))));
  // One process: DataParallel over its GPUs; on the CPU (--gpus none, or no GPU visible) the
  // module as it is, with no wrapper: DataParallel given no device list would take every visible
  // GPU. Several: DistributedDataParallel, rank 0's model broadcast to every rank.
  std::unique_ptr<parallel::DataParallel> dp;
  std::unique_ptr<DistributedDataParallel> ddp;
  if (distributed) {
    const parallel::ProcessGroupOptions pgo{std::chrono::milliseconds(
        std::max<long long>(1, std::llround(o.collective_timeout * 1000)))};
    if (gpus.empty()) {
      g_ranks.group = parallel::mpi_host_group(*g_ranks.session);
    } else {
      g_ranks.process_group = parallel::ProcessGroup::from_mpi(*g_ranks.session, pgo, gpus[0]);
      g_ranks.group = parallel::nccl_group(g_ranks.process_group);
    }
    net->set_input_grad(false);
    ddp = std::make_unique<DistributedDataParallel>(net, g_ranks.group);
    std::printf("DistributedDataParallel: %d processes, each on %s (%s), batch %lld per process\n",
                g_ranks.world, gpus.empty() ? "the CPU" : "one GPU",
                gpus.empty() ? "MPI all-reduces the gradients" : "NCCL all-reduces the gradients",
                static_cast<long long>(o.batch_size));
  } else {
    if (!gpus.empty()) dp = std::make_unique<parallel::DataParallel>(net, gpus);
  }
  Module& model = dp ? static_cast<Module&>(*dp) : ddp ? static_cast<Module&>(*ddp) : *net;
  model.set_input_grad(false);  // the images need no gradient: the first layer skips backward-data
  if (dp && !gpus.empty()) {
    std::printf("batch %lld split over %zu GPU(s):", static_cast<long long>(o.batch_size),
                gpus.size());
    const auto n_gpus = static_cast<int64_t>(gpus.size());
    const int64_t chunk = (o.batch_size + n_gpus - 1) / n_gpus;
    for (int64_t i = 0; i < n_gpus; ++i) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(chunk, o.batch_size - chunk * i));
      std::printf(" %lld on cuda:%d", static_cast<long long>(n), gpus[static_cast<size_t>(i)]);
    }
    std::printf("\n");
  }
  std::unique_ptr<TrainOptimizer> opt = make_optimizer(o, model);
  if (gpus.empty() && o.was_given("--graphs") && o.graphs == "on") {
    // Refused where it cannot run rather than left off (as --overlap-update on): the user asked.
    throw UsageError(
        "--graphs on needs GPUs: CUDA graphs replay GPU work; drop --graphs on to "
        "train on the CPU");
  }
  if (o.overlap_update == "on") {
    // Refused where it cannot run rather than left off: the user asked for it.
    if (gpus.empty()) {
      throw UsageError(
          "--overlap-update on needs GPUs: on the CPU the buckets' updates would run one after "
          "another once the backward is done, with nothing to overlap; drop --overlap-update");
    }
    const char* other = o.clip_grad > 0           ? "--clip-grad"
                        : o.on_nan == "skip-step" ? "--on-nan skip-step"
                                                  : nullptr;
    if (other != nullptr) {
      throw UsageError(detail::str(
          "--overlap-update on cannot be used with ", other,
          ": each bucket's update starts before the whole backward's gradients exist, which a "
          "clip or a skip decision needs; drop one of the two"));
    }
    if (dp) {
      opt->set_update_overlap(*dp);
    } else {
      opt->set_update_overlap(*ddp);
    }
    std::printf(
        "update beside the backward: on (each gradient bucket's update as soon as the "
        "backward completes it)\n");
  }
  const int64_t steps_per_epoch = train_loader.batches_per_epoch();
  if (!resume_file.empty() && !weights_only) {
    // Replica 0's optimizer from the checkpoint, then its state into every replica's.
    load_checkpoint(*resumed, *net, &opt->primary());
    resumed.reset();
    opt->load_state_dict(opt->primary().state_dict());
    for (size_t r = 1; r < opt->size(); ++r) {
      opt->replica(r).load_hyperparameters(opt->primary().hyperparameters());
    }
    if (dp) {
      dp->broadcast_parameters();
    } else if (ddp) {
      ddp->broadcast_parameters();  // every rank loaded the same file: a formality
    }
    if (global_step != start_epoch * steps_per_epoch) {
      throw UsageError(detail::str("--resume ", o.resume, ": the checkpoint is at step ",
                                   global_step, " after epoch ", start_epoch, ", but this run has ",
                                   steps_per_epoch, " steps per epoch; resume with the data, "
                                   "--limit-train and --batch-size it was written with"));
    }
  }
  // The epochs this run trains: [start_epoch, end_epoch). The schedule spans --epochs whatever
  // --stop-after says, so a stopped run resumes on the same schedule.
  const int64_t end_epoch = o.stop_after > 0 ? std::min(o.epochs, o.stop_after) : o.epochs;
  std::unique_ptr<LRScheduler> schedule;
  if (training && start_epoch < end_epoch) {
    // The checkpoint restored the rate of its last step; the schedules compute every rate from
    // the base rate, and a constant schedule runs at --lr.
    opt->primary().set_lr(o.lr);
    schedule = make_schedule(o, opt->primary(), steps_per_epoch);
    if (schedule) schedule->set_step(global_step);
  } else if (training) {
    std::printf("nothing to train: the model is at epoch %lld and this run stops at epoch %lld\n",
                static_cast<long long>(start_epoch), static_cast<long long>(end_epoch));
  }

  const auto print_checksum = [&] {
    if (!o.print_checksum) return;
    if (dp && dp->num_replicas() > 1) {
      dp->check_replicas_identical();
      std::printf("replicas: %zu, bit-identical\n", dp->num_replicas());
    }
    std::printf("checksum %016llx\n", static_cast<unsigned long long>(model_checksum(*net)));
    std::fflush(stdout);
  };

  CrossEntropyLoss criterion;
  // Rank 0's answer on every rank: the progress lines, where the ranks sum their metrics, must come
  // at the same steps everywhere (mpirun may give rank 0 a terminal and the others pipes).
  int tty_flag = isatty(fileno(stdout)) ? 1 : 0;
  if (distributed) g_ranks.session->broadcast(&tty_flag, sizeof tty_flag, 0);
  const bool tty = tty_flag != 0;
  const int feed_device = main_device.is_cuda() ? main_device.index : -1;
  BatchFeed test_feed(test_loader, feed_device);

  struct Eval {
    double loss, top1, top5;
  };
  StepResults eval_results(feed_device, /*training=*/false);
  const std::string batch_advice = detail::str(
      "Reduce the batch size (--batch-size, now ", o.batch_size, "): each GPU holds the "
      "activations of its share of a batch.");
  // --graphs on: the evaluation's full batches replay a CUDA graph of its forward and loss too
  // (after one eager batch), the last partial batch runs eagerly; the same results bit for bit.
  const auto eval_body = [&](const Tensor& images, const Tensor& labels) {
    const Tensor out = model.forward(images);
    const Tensor loss = criterion.forward(out, labels);
    // What the forward and the loss saved for a backward that never comes: a captured evaluation
    // keeps no memory past its end (and an eager one frees its activations now).
    criterion.release();
    model.release_forward_state();
    return TensorList{loss, out};
  };
  // Under DistributedDataParallel rank 0 evaluates alone, and an evaluation forward makes no
  // collective: its graph holds none to watch.
  GraphedStep eval_graphed(
      eval_body, main_device,
      {.warmup_steps = 1, .enabled = o.graphs == "on", .before_replay = {}, .after_launch = {}},
      gpus);
  const auto evaluate = [&]() {
    const nvtx::Range range("evaluation");
    const cuda::AllocationPurpose purpose(
        detail::str("evaluation (batches of ", o.batch_size, " test images)"), batch_advice);
    model.eval();
    eval_results.reset();
    test_feed.start_epoch(0);
    int64_t batch = 0;
    for (Tensor images, labels; test_feed.next(images, labels); ++batch) {
      const TensorList r = eval_graphed.run(images, labels);  // eager, captured or replayed
      eval_results.add(batch + 1, batch + 1, r[0], Tensor(), r[1], labels);
      if (eval_results.pending() >= 64) eval_results.read();
    }
    eval_results.read();
    model.train();
    return Eval{eval_results.mean_loss(), eval_results.top1(), eval_results.top5()};
  };

  if (o.eval_only) {
    if (rank != 0) return 0;  // rank 0 evaluates
    const Eval e = evaluate();
    std::printf("test loss %.4f, test accuracy %.2f%% (top-5 %.2f%%)\n", shown(e.loss), e.top1,
                e.top5);
    json.write({{"event", "eval"}, {"test_loss", e.loss}, {"test_accuracy", e.top1 / 100},
                {"test_top5", e.top5 / 100}});
    print_checksum();
    return 0;
  }

  // The last checkpoint known to hold finite weights: what the divergence error points at.
  std::string last_good = resume_file.empty()
                              ? std::string("none (no checkpoint was written before it)")
                              : detail::str(resume_file, " (after epoch ", start_epoch,
                                            ", the checkpoint this run resumed from)");
  if (resume_file.empty() && o.checkpoint.empty() && o.output.empty()) {
    last_good = "none (give --checkpoint or --output to keep one)";
  }
  // Checkpoints are written on the writer's thread while the next epoch trains; `pending_good` is
  // the save in flight, which becomes `last_good` once it completed. settle() waits for it, so
  // that a message naming the last good checkpoint names one that is complete.
  CheckpointWriter checkpoint_writer;
  std::string pending_good;
  bool have_good = !resume_file.empty();  // whether last_good names a checkpoint
  const auto settle = [&] {
    if (pending_good.empty()) return;
    const std::string pending = std::exchange(pending_good, std::string());
    try {
      checkpoint_writer.wait();  // a failed save throws its error here
    } catch (const Error& e) {
      CUDP_THROW(IoError, "the checkpoint save ", pending, " did not complete: ", e.message(),
                 ". The last complete checkpoint is ", last_good,
                 ". Make room on the disk (or fix "
                 "the path), then ",
                 have_good ? "continue from it with --resume" : "run again");
    }
    last_good = pending;
    have_good = true;
  };
  // The last good checkpoint for a divergence error: the save in flight completes first; if it
  // failed, the one before it, and the failure is said.
  const auto settled_last_good = [&]() -> std::string {
    try {
      settle();
    } catch (const std::exception& e) {
      const auto* error = dynamic_cast<const Error*>(&e);
      return detail::str(last_good, "; the save after it did not complete: ",
                         error ? error->message() : std::string(e.what()));
    }
    return last_good;
  };
  const bool skip_bad_steps = o.on_nan == "skip-step";
  // --fused-grad-norm: the update computes the norm where nothing before it needs the norm (no
  // clipping, no skip flag made from it).
  const bool norm_by_update = o.clip_grad <= 0 && !skip_bad_steps && o.fused_grad_norm == "on";
  // The non-finite steps a read found: the end of the run, or, with skip-step, steps the device
  // skipped (named here; counted at the end of the epoch).
  int64_t skipped_seen = 0;
  const auto check_steps = [&](int64_t epoch, const std::vector<StepResults::Bad>& bad) {
    if (bad.empty()) return;
    if (!skip_bad_steps) {
      throw DivergenceError(detail::str(
          "training diverged at step ", bad[0].step, " (epoch ", epoch + 1, ", batch ",
          bad[0].batch, " of ", steps_per_epoch, "): ", bad[0].what,
          ". No checkpoint was "
          "written after it; the last good checkpoint is ",
          settled_last_good(), ". Lower --lr (", o.lr,
          "), clip the gradients with --clip-grad, or pass --on-nan skip-step to skip such "
          "steps."));
    }
    for (const StepResults::Bad& b : bad) {
      std::printf("step %lld (epoch %lld, batch %lld): %s; update skipped (--on-nan skip-step)\n",
                  static_cast<long long>(b.step), static_cast<long long>(epoch + 1),
                  static_cast<long long>(b.batch), b.what.c_str());
    }
    skipped_seen += static_cast<int64_t>(bad.size());
  };
  // Only decides when best is replaced; -1 until a run has evaluated (a percentage after).
  double best_top1 = -1;
  if (resumed_meta.count("best_test_top1")) {
    best_top1 = metadata_double(resumed_meta, "best_test_top1", -1, 100, state_file);
  }

  // One training step: its results {loss, gradient norm, logits} stay on the device.
  // Under DistributedDataParallel, this rank's share n_r / B of the global batch. The sampler pads
  // the ranks' shards to equal length, so every rank's k-th batch has the same rows and the share
  // is 1 / world: known without the collective that DistributedDataParallel::loss_weight() makes
  // (through NCCL, with a wait for the device, every step).
  const double loss_weight = ddp ? 1.0 / static_cast<double>(g_ranks.world) : 1.0;
  const NanLossAt nan_loss = nan_loss_at();
  const auto train_body = [&](const Tensor& images, const Tensor& labels) {
    Tensor out, loss;
    if (o.accumulate > 1) {
      // --accumulate: micro-batches whose gradients add up on each replica or rank (no_sync), one
      // all-reduce with the last one's backward (layers/train.h, forward_backward_micro_batches).
      // Under DistributedDataParallel the whole local batch's loss weight n_r / B scales every
      // micro-batch's n_j / n_r. Every rank runs as many micro-batches, each forward a collective
      // (the buffers' broadcast, SyncBatchNorm's sums): the sampler's shards are equal, so every
      // rank's batch has the same rows.
      opt->zero_grad();
      const MicroBatchStep micro = forward_backward_micro_batches(
          model, criterion, images, labels, std::min<int64_t>(o.accumulate, labels.numel()),
          [&](const Tensor& grad, bool last) {
            if (last || (!dp && !ddp)) {  // on one CPU there is no all-reduce to hold back
              model.backward(grad);
            } else if (dp) {
              const auto no_sync = dp->no_sync();
              model.backward(grad);
            } else {
              const auto no_sync = ddp->no_sync();
              model.backward(grad);
            }
          },
          o.label_smoothing > 0 ? MicroGradient([&](CrossEntropyLoss& c, const Tensor& logits,
                                                    const Tensor& y, double weight) {
            return smoothed_gradient(c, logits, y, o.label_smoothing, weight);
          })
                                : MicroGradient{},
          loss_weight);
      out = micro.logits;
      loss = micro.loss;
    } else {
      out = model.forward(images);
      // DistributedDataParallel: this rank's mean loss weighted by its share of the global batch
      // (n_r / B), so the ranks' summed gradients are the global batch's.
      loss = criterion.forward(out, labels, loss_weight);
      opt->zero_grad();
      model.backward(o.label_smoothing > 0
                         ? smoothed_gradient(criterion, out, labels, o.label_smoothing, loss_weight)
                         : criterion.backward());
    }
    if (distributed && nan_loss.rank == g_ranks.rank && nan_loss.step == global_step + 1) {
      loss = loss.clone_async();
      loss.fill_(std::numeric_limits<float>::quiet_NaN());
    }
    // The gradients' global norm, reduced on the device with no host read. Without --clip-grad
    // only replica 0's is needed (all hold the same all-reduced gradients), and nothing is
    // scaled, so the replicas stay bit-identical. When nothing before the update needs it (no
    // clipping, no skip flag made from it), the update computes it as it reads the gradients
    // (--fused-grad-norm, the same bits).
    Tensor norm, decided_by;  // decided_by: the ranks' summed loss, when it decides a skip
    if (!norm_by_update) {
      norm =
          o.clip_grad > 0 ? opt->clip_grad_norm(o.clip_grad) : grad_norm(opt->primary().params());
      if (skip_bad_steps) {
        // Under DistributedDataParallel the loss is this rank's own (the norm is global): the flag
        // is made from the ranks' sum, non-finite when any rank's is, so that every rank skips the
        // same steps and the replicas stay alike.
        if (distributed) {
          decided_by = loss.clone_async();
          g_ranks.group->all_reduce_sum(
              decided_by, loss.is_cuda() ? cuda::current_stream(loss.device().index) : nullptr);
        }
        // Decided on the device, no host read.
        opt->step(nonfinite_flag(decided_by.defined() ? decided_by : loss, norm));
      } else {
        opt->step();
      }
    } else {
      norm = opt->step_and_grad_norm();
    }
    criterion.release();  // nothing the step made outlives it (a captured step's graph owns none)
    // Under DDP the summed loss goes back too: the host's count of skipped steps must see the
    // steps another rank's loss made every rank skip.
    if (decided_by.defined()) return TensorList{loss, norm, out, decided_by};
    return TensorList{loss, norm, out};
  };
  // --graphs on: full batches replay a CUDA graph of train_body (layers/train.h NOTE [Graphed
  // training steps]); the schedule's rate reaches the replicas through follow_primary. Under
  // DistributedDataParallel on GPUs the graph holds the step's collectives (the buffers'
  // broadcast, the buckets' all-reduces, SyncBatchNorm's sums): every rank replays it for its
  // full batches, which come at the same steps on every rank (the sampler's shards are equal),
  // and the collective watchdog watches each launch as it watches an eager collective.
  const bool nan_hook = distributed && nan_loss.rank >= 0;  // decided on the host: eager steps
  GraphedStep graphed(train_body, main_device,
                      {.warmup_steps = GraphedStepOptions{}.warmup_steps,
                       .enabled = o.graphs == "on" && !nan_hook,
                       .before_replay = [&opt] { opt->follow_primary(); },
                       .after_launch = distributed && g_ranks.process_group
                                           ? g_ranks.process_group->comm().launch_watcher(
                                                 "a replayed training step")
                                           : std::function<void()>{}},
                      gpus);
  if (o.accumulate > 1) {
    std::printf("gradient accumulation: each batch as %lld micro-batches, one all-reduce\n",
                static_cast<long long>(o.accumulate));
  }
  if (!gpus.empty()) {
    std::printf("CUDA graphs: %s\n",
                o.graphs == "off" ? "off"
                : nan_hook ? "off (CUDP_TEST_NAN_LOSS is set: a test hook decided on the host)"
                           : "on (full batches replay a captured step)");
  }

  for (int g : gpus) cuda::reset_peak_memory_stats(g);
  BatchFeed train_feed(train_loader, feed_device);
  StepResults results(feed_device, /*training=*/true, o.label_smoothing);
  const auto run_start = Clock::now();
  double train_seconds = 0;
  const int64_t first_global_step = global_step;  // of this run (a resume starts later)
  int64_t overlapped_steps = 0;                   // --overlap-update: steps that did
  for (int64_t epoch = start_epoch; epoch < end_epoch; ++epoch) {
    std::optional<cuda::AllocationPurpose> purpose;  // ends before the evaluation
    purpose.emplace(detail::str("training (batches of ", o.batch_size, " images)"), batch_advice);
    const auto epoch_start = Clock::now();
    train_feed.start_epoch(static_cast<int>(epoch));
    // The evaluation's first batches are prepared while the epoch trains (Loader::start_epoch keeps
    // them when the evaluation starts the same epoch): its first batch is then ready at once.
    if (rank == 0) test_loader.start_epoch(0);
    results.reset();
    int64_t step = 0, images_seen = 0;
    const int64_t skipped_before = opt->skipped_steps();  // read at the last epoch's end: no wait
    skipped_seen = 0;
    double lr = opt->primary().lr();  // the rate of the epoch's last step
    const int64_t print_every =
        o.print_freq > 0 ? o.print_freq : tty ? 10 : std::max<int64_t>(steps_per_epoch / 5, 1);
    for (Tensor images, labels; train_feed.next(images, labels);) {
      const nvtx::Range range("training step");
      const double step_lr = opt->primary().lr();
      const TensorList r = graphed.run(images, labels);  // train_body, eager or replayed
      const Tensor &loss = r[0], &norm = r[1], &out = r[2];
      if (opt->last_step_overlapped()) ++overlapped_steps;
      ++global_step;
      ++step;
      results.add(global_step, step, loss, norm, out, labels, loss_weight,
                  r.size() > 3 ? r[3] : Tensor());
      images_seen += labels.numel();
      lr = step_lr;
      if (schedule) schedule->step();
      if (step % print_every == 0 || step == steps_per_epoch || results.pending() >= 64) {
        check_steps(epoch, results.read());
      }
      if (step % print_every == 0 || step == steps_per_epoch) {
        const double t = seconds_since(epoch_start);
        const Figures f = global_figures(results);  // collective under mpirun
        const double images_per_s = images_seen * g_ranks.world / t;
        progress(tty, epoch, o.epochs, step, steps_per_epoch, images_per_s,
                 static_cast<float>(f.last_loss), f.mean_loss,
                 t / static_cast<double>(step) * (steps_per_epoch - step));
        json.write({{"event", "step"},
                    {"epoch", epoch + 1},
                    {"step", global_step},
                    {"loss", f.last_loss},
                    {"mean_loss", f.mean_loss},
                    {"grad_norm", results.last_norm()},
                    {"lr", step_lr},
                    {"images_per_s", images_per_s}});
      }
    }
    // The epoch's input figures are read before the next epoch starts: its first batches are
    // prepared while this one ends (the evaluation, the checkpoint), so that they are ready when it
    // begins, and the device does not wait for them.
    const double input_wait = train_loader.wait_seconds();
    const double device_wait = train_loader.device_wait_seconds();
    if (epoch + 1 < end_epoch) train_loader.start_epoch(static_cast<int>(epoch + 1));
    check_steps(epoch, results.read());
    const int64_t skipped = opt->skipped_steps() - skipped_before;
    if (skipped != skipped_seen) {
      throw Error(detail::str("internal error: the optimizer skipped ", skipped,
                              " steps of epoch ", epoch + 1, " but ", skipped_seen,
                              " had a non-finite loss or gradient norm; please report this"),
                  __FILE__, __LINE__);
    }
    if (skipped == steps_per_epoch) {
      throw DivergenceError(
          detail::str("every step of epoch ", epoch + 1,
                      " was skipped (--on-nan skip-step): the run has "
                      "diverged. No checkpoint was written after it; the last good checkpoint is ",
                      settled_last_good(), ". Lower --lr (", o.lr,
                      ") or clip the gradients with --clip-grad."));
    }
    if (main_device.is_cuda()) cuda::synchronize(main_device.index);
    const double epoch_seconds = seconds_since(epoch_start);
    train_seconds += epoch_seconds;
    const Figures train = global_figures(results);  // collective under mpirun
    const double train_loss = train.mean_loss, train_top1 = train.top1, train_top5 = train.top5;
    images_seen *= g_ranks.world;  // every rank's (the shards are equal: the sampler pads them)
    purpose.reset();  // the epoch's training allocations end here
    // Rank 0 evaluates the whole test set alone (the others go on to the next epoch and wait for
    // it at its first collective, a wait the collective timeout bounds on GPUs); other ranks
    // report zeros they never print.
    const Eval test = rank == 0 ? evaluate() : Eval{0, 0, 0};
    if (tty) std::printf("\n");
    std::printf(
        "epoch %lld/%lld: train loss %.4f, train accuracy %.2f%%, test loss %.4f, test "
        "accuracy %.2f%% (top-5 %.2f%%), lr %.4g, %.1f s (%.0f img/s, input wait %.2f s, "
        "waiting for the device %.2f s), %.1f s so far%s\n",
        static_cast<long long>(epoch + 1), static_cast<long long>(o.epochs), shown(train_loss),
        train_top1, shown(test.loss), test.top1, test.top5, lr, epoch_seconds,
        images_seen / epoch_seconds, input_wait, device_wait, seconds_since(run_start),
        skipped ? detail::str(", ", skipped, " step(s) skipped").c_str() : "");
    json.write({{"event", "epoch"},
                {"epoch", epoch + 1},
                {"train_loss", train_loss},
                {"train_accuracy", train_top1 / 100},
                {"train_top5", train_top5 / 100},
                {"test_loss", test.loss},
                {"test_accuracy", test.top1 / 100},
                {"test_top5", test.top5 / 100},
                {"lr", lr},
                {"seconds", epoch_seconds},
                {"images_per_s", images_seen / epoch_seconds},
                {"skipped_steps", skipped},
                {"elapsed", seconds_since(run_start)},
                {"input_wait", input_wait},
                {"device_wait", device_wait}});

    const bool best = test.top1 > best_top1;
    if (best) best_top1 = test.top1;
    std::vector<std::string> targets;
    if (!o.checkpoint.empty()) targets.push_back(o.checkpoint);
    if (folder) targets.push_back(folder->last_checkpoint());
    if (folder && best) targets.push_back(folder->best_checkpoint());
    if (!writer) targets.clear();  // rank 0 writes the checkpoints (every rank's model is the same)
    if (!targets.empty()) {
      Metadata meta = settings_metadata(o);
      meta["epoch"] = std::to_string(epoch + 1);
      meta["step"] = std::to_string(global_step);
      meta["best_test_top1"] = detail::str(best_top1);
      // The training state of a multi-process run: the number of ranks, which decides every
      // rank's shard, and the epoch the samplers start at on --resume (their order is a function
      // of the seed and the epoch alone, so that is their whole position).
      meta["world_size"] = std::to_string(g_ranks.world);
      meta["sampler_epoch"] = std::to_string(epoch + 1);
      save_dropout_state(*net, meta);
      const nvtx::Range range("checkpoint snapshot");
      settle();  // the previous save completed (or its error ends the run here)
      // The state is copied on the device (stage_checkpoint), checked there (~0.1 ms), and
      // brought to the host and written on the writer's thread while the next epoch trains: the
      // copy to the host and the check here took ~70 ms a Fashion-MNIST epoch, the GPU idle.
      StagedCheckpoint staged = stage_checkpoint(*net, &opt->primary(), meta);
      if (const std::string bad = staged.first_non_finite(); !bad.empty()) {
        throw DivergenceError(detail::str(
            "after epoch ", epoch + 1, " the model's ", bad,
            " holds non-finite values (an update, "
            "or a skipped step's BatchNorm statistics, overflowed), so no checkpoint was written. "
            "The last good checkpoint is ",
            settled_last_good(), ". Lower --lr (", o.lr,
            ") or clip the gradients with --clip-grad."));
      }
      checkpoint_writer.save(targets, std::move(staged));
      pending_good = detail::str(targets.front(), " (after epoch ", epoch + 1, ")");
    }
    if (folder) {
      folder->add({epoch + 1, train_loss, train_top1, train_top5, test.loss, test.top1, test.top5,
                   lr, images_seen / epoch_seconds, epoch_seconds});
    }
  }
  settle();  // the last save is complete before the run says it is done
  if (folder) folder->wait();  // and the last metrics.csv and curves.png (their error, if any)
  if (start_epoch >= end_epoch) {
    print_checksum();
    return 0;
  }
  std::printf("done: best test accuracy %.2f%%, training time %.1f s, total %.1f s\n", best_top1,
              train_seconds, seconds_since(run_start));
  if (graphed.captured() || eval_graphed.captured()) {
    std::printf("  CUDA graphs: %lld training and %lld evaluation replays\n",
                static_cast<long long>(graphed.replays()),
                static_cast<long long>(eval_graphed.replays()));
  }
  if (o.overlap_update == "on") {
    // What ran, not what was asked: a step that makes the optimizer's state (the first) and the
    // steps that cannot overlap take one update after the backward.
    std::printf("  update beside the backward: %lld of %lld steps\n",
                static_cast<long long>(overlapped_steps),
                static_cast<long long>(global_step - first_global_step));
  }
  if (norm_by_update) {
    // What ran in the last step (a replay keeps its capture's), not what was asked.
    std::printf("  gradient norm: %s\n",
                opt->primary().last_norm_was_fused()
                    ? "summed by the optimizer's update"
                    : "a pass of its own after the update (the parameters are not one flat "
                      "buffer, or the update ran beside the backward)");
  }
  for (int g : gpus) {
    std::printf("  cuda:%d peak memory %.2f GiB\n", g,
                static_cast<double>(cuda::max_memory_allocated(g)) / (1 << 30));
  }
  if (folder) std::printf("run folder: %s (metrics.csv, curves.png, last and best checkpoints)\n",
                          folder->dir().c_str());
  json.write({{"event", "done"}, {"best_test_accuracy", best_top1 / 100},
              {"train_seconds", train_seconds}, {"total_seconds", seconds_since(run_start)}});
  print_checksum();
  return 0;
}

}  // namespace
}  // namespace cudp::trainer

int main(int argc, char** argv) {
  using namespace cudp::trainer;
  Options o;
  if (const int code = parse_command_line(argc, argv, o); code >= 0) return code;
  const char* env = std::getenv("CUDP_VERBOSE");
  const bool verbose = o.verbose || (env && std::string(env) == "1");
  // Under mpirun an error names its rank, and the rank ends the job with MPI_Abort, not
  // MPI_Finalize (which would wait for the other ranks, themselves waiting for this one in a
  // collective or in an MPI call that no timeout covers). A run that succeeds finalizes MPI here.
  const auto fail = [](int code, const char* message) {
    if (g_ranks.distributed()) {
      std::fprintf(stderr, "cudp-vgg: rank %d of %d: %s\n", g_ranks.rank, g_ranks.world, message);
      std::fflush(stdout);
      std::fflush(stderr);
      if (g_ranks.session) {
        // The others' own errors first: ranks failing at the same point (a bad option) each say
        // theirs within this grace period; a rank still waiting after it is ended by the abort.
        std::this_thread::sleep_for(std::chrono::seconds(3));
        g_ranks.session->abort(code);
      }
      std::_Exit(code);
    }
    std::fprintf(stderr, "cudp-vgg: %s\n", message);
    return code;
  };
  try {
    const int code = run(o);
    std::fflush(stdout);
    g_ranks.finish();
    return code;
  } catch (const UsageError& e) {
    return fail(kExitUsage, e.what());
  } catch (const cudp::Error& e) {
    // Source locations only when asked for: a user needs what went wrong, not our file names.
    return fail(kExitFailure, verbose ? e.what() : e.message().c_str());
  } catch (const std::bad_alloc&) {
    return fail(kExitFailure, "out of host memory; lower --batch-size or -j/--workers");
  } catch (const std::exception& e) {
    return fail(kExitFailure, e.what());
  } catch (...) {
    return fail(kExitFailure, "an unknown error ended the run");
  }
}
