#include "layers/train.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <utility>
#include <vector>

#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "kernels/elementwise.h"

namespace cudp {
namespace {

// The model's outputs, its predictions' correct count and the labels on the model's device. Host
// labels are checked before their copy (the logits give the class count).
struct Forward {
  Tensor logits, labels, correct;
};

Forward forward_batch(Module& model, const Tensor& images, const Tensor& labels) {
  const Device device = model.device();
  Forward f;
  f.logits = model.forward(images.to(device));
  CUDP_CHECK(f.logits.dim() == 2, model.type_name(),
             " must return logits [N, classes] for classification, got ", f.logits.str());
  if (labels.is_cpu() && device.is_cuda()) {
    check_label_range(labels, f.logits.size(1));
  }
  f.labels = labels.to(device);
  // Counted before backward runs: nothing after the forward may touch the logits first.
  f.correct = count_correct(argmax(f.logits, 1), f.labels);
  return f;
}

// Restores a module's training flag when it goes out of scope.
class TrainingFlagGuard {
 public:
  explicit TrainingFlagGuard(Module& model) : model_(model), training_(model.is_training()) {}
  ~TrainingFlagGuard() { model_.train(training_); }
  TrainingFlagGuard(const TrainingFlagGuard&) = delete;
  TrainingFlagGuard& operator=(const TrainingFlagGuard&) = delete;
  TrainingFlagGuard(TrainingFlagGuard&&) = delete;
  TrainingFlagGuard& operator=(TrainingFlagGuard&&) = delete;

 private:
  Module& model_;
  bool training_;
};

}  // namespace

StepResult PendingStep::wait() const {
  return {loss.to_vector<float>()[0], correct.to_vector<int32_t>()[0], count};
}

PendingStep train_step_async(Module& model, CrossEntropyLoss& criterion, Optimizer& optimizer,
                             const Tensor& images, const Tensor& labels) {
  const cuda::AllocationPurpose purpose(detail::str(
      "a training step on ", model.device(), " (activations and gradients of ",
      images.dim() > 0 ? images.size(0) : 0, " images)"));
  model.set_input_grad(false);  // the images need no gradient: the first layer skips backward-data
  const Forward f = forward_batch(model, images, labels);
  Tensor loss = criterion.forward(f.logits, f.labels);
  optimizer.zero_grad(ZeroGrad::deferred);  // the backward writes what it can (layers/module.h)
  model.backward(criterion.backward());
  optimizer.step();
  return {loss, f.correct, f.logits.size(0)};
}

StepResult train_step(Module& model, CrossEntropyLoss& criterion, Optimizer& optimizer,
                      const Tensor& images, const Tensor& labels) {
  const PendingStep pending = train_step_async(model, criterion, optimizer, images, labels);
  const float loss = criterion.item();  // waits for the step, checks the labels' flag
  return {loss, pending.correct.to_vector<int32_t>()[0], pending.count};
}

// ---- gradient accumulation (train.h) ------------------------------------------------------------

MicroBatchStep forward_backward_micro_batches(Module& model, CrossEntropyLoss& criterion,
                                              const Tensor& images, const Tensor& labels,
                                              int64_t micro_batches, const MicroBackward& backward,
                                              const MicroGradient& gradient, double batch_weight) {
  CUDP_CHECK(micro_batches >= 1, "gradient accumulation: micro_batches must be at least 1, got ",
             micro_batches);
  CUDP_CHECK(batch_weight > 0 && std::isfinite(batch_weight),
             "gradient accumulation: batch_weight must be positive and finite, got ", batch_weight);
  CUDP_CHECK(images.dim() >= 1 && labels.dim() == 1 && images.size(0) == labels.size(0),
             "gradient accumulation: images ", images.str(), " and labels ", labels.str(),
             " must have the same rows");
  const int64_t batch = labels.size(0);
  CUDP_CHECK(batch >= micro_batches, "gradient accumulation: a batch of ", batch,
             " rows cannot make ", micro_batches, " micro-batches; use a batch of at least ",
             micro_batches, " rows or fewer micro-batches (--accumulate)");
  // torch.chunk's sizes, as DataParallel's scatter: ceil(B / N) rows, the last shorter, and fewer
  // micro-batches than asked when the rows run out first (6 rows in 4 give 2, 2, 2).
  const int64_t rows = (batch + micro_batches - 1) / micro_batches;
  MicroBatchStep result;
  for (int64_t begin = 0; begin < batch; begin += rows) {
    const int64_t end = std::min(batch, begin + rows);
    const bool last = end == batch;
    const Tensor x = images.slice(begin, end);
    const Tensor y = labels.slice(begin, end);
    const Tensor logits = model.forward(x);
    const double weight =
        batch_weight * static_cast<double>(end - begin) / static_cast<double>(batch);
    // The micro-batch's mean times batch_weight n_j / B.
    const Tensor loss = criterion.forward(logits, y, weight);
    const Tensor grad = gradient ? gradient(criterion, logits, y, weight) : criterion.backward();
    if (backward) {
      backward(grad, last);
    } else {
      model.backward(grad);
    }
    if (!result.logits.defined()) {
      result.logits = Tensor::empty({batch, logits.size(1)}, logits.dtype(), logits.device());
      result.loss = Tensor::zeros({}, DType::f32, loss.device());
    }
    result.logits.slice(begin, end).copy_from(logits);
    // loss += this micro-batch's weighted loss, on its device's current stream.
    float* total = result.loss.data<float>();
    const float* part = loss.data<float>();
    if (loss.device().is_cuda()) {
      const cuda::DeviceGuard guard(loss.device().index);
      kernels::add(total, part, total, 1, cuda::current_stream(loss.device().index));
    } else {
      kernels::add_cpu(total, part, total, 1);
    }
  }
  return result;
}

// ---- GraphedStep (train.h, NOTE [Graphed training steps]) ---------------------------------------

GraphedStep::GraphedStep(Body body, Device device, Options options, std::vector<int> devices)
    : body_(std::move(body)), device_(device), options_(options), devices_(std::move(devices)) {
  CUDP_CHECK(body_ != nullptr, "GraphedStep: the step body is empty");
  CUDP_CHECK(options_.warmup_steps >= 1, "GraphedStep: warmup_steps must be at least 1 (the "
             "first step of a shape creates state a capture must not create), got ",
             options_.warmup_steps);
  if (device_.is_cuda() && devices_.empty()) devices_.push_back(device_.index);
}

GraphedStep::GraphedStep(Module& model, CrossEntropyLoss& criterion, Optimizer& optimizer,
                         Options options)
    : GraphedStep(
          [&model, &criterion, &optimizer](const Tensor& images, const Tensor& labels) {
            const PendingStep p = train_step_async(model, criterion, optimizer, images, labels);
            criterion.release();  // the step's results are p's: nothing outlives the step
            return TensorList{p.loss, p.correct};
          },
          model.device(), options) {}

GraphedStep::~GraphedStep() {
  if (copied_.get() != nullptr) cudaEventSynchronize(copied_.get());  // the held inputs' copies
  if (captured()) {  // the graph and its replay scalars go: let the last replay finish first
    const cuda::DeviceGuard guard(device_.index);
    cudaStreamSynchronize(cuda::current_stream(device_.index));
  }
}

GraphedStep::Key GraphedStep::key_of(const Tensor& images, const Tensor& labels) {
  CUDP_CHECK(images.defined() && labels.defined(),
             "GraphedStep: the images or labels are undefined");
  return {images.shape(), labels.shape(), images.dtype(), labels.dtype()};
}

TensorList GraphedStep::run(const Tensor& images, const Tensor& labels) {
  const Key key = key_of(images, labels);
  if (captured() && key == captured_) {
    copy_in(images, labels);
    return launch(/*first=*/false);
  }
  const bool may_capture = options_.enabled && device_.is_cuda() && !captured();
  if (may_capture && key == warming_ && warm_count_ >= options_.warmup_steps) {
    return capture(images, labels);
  }
  if (!(key == warming_)) {
    warming_ = key;
    warm_count_ = 0;
  }
  ++warm_count_;
  ++eager_steps_;
  last_eager_ = body_(images, labels);
  return last_eager_;
}

PendingStep GraphedStep::step(const Tensor& images, const Tensor& labels) {
  const TensorList out = run(images, labels);
  CUDP_CHECK(out.size() >= 2, "GraphedStep::step: the body must return {loss, correct}, got ",
             out.size(), " tensors");
  return {out[0], out[1], images.dim() > 0 ? images.size(0) : 0};
}

void GraphedStep::copy_in(const Tensor& images, const Tensor& labels) {
  const cudaStream_t stream = cuda::current_stream(device_.index);
  const bool pinned =
      (images.is_cpu() && images.is_pinned()) || (labels.is_cpu() && labels.is_pinned());
  if (pinned) {
    // The previous step's pinned inputs may go once their copies have run (long since, normally).
    if (copied_.get() != nullptr) copied_.synchronize();
    held_ = {images, labels};
  }
  for (auto [dst, src] : {std::pair{&images_, &images}, std::pair{&labels_, &labels}}) {
    if (src->is_cpu() && !src->is_pinned()) {
      dst->copy_from(*src);  // pageable: CUDA reads it before returning (and waits)
    } else {
      dst->copy_from(*src, stream);
    }
  }
  if (pinned) {
    if (copied_.get() == nullptr) copied_ = cuda::Event::create(device_.index);
    copied_.record(stream);
  }
}

TensorList GraphedStep::capture(const Tensor& images, const Tensor& labels) {
  const int device = device_.index;
  const cuda::DeviceGuard guard(device);
  const cudaStream_t stream = cuda::current_stream(device);
  {
    const cuda::AllocationPurpose purpose(
        "the static inputs, outputs and replay scalars of a CUDA graph of a step (training or "
        "evaluation)",
        "Run the steps without a CUDA graph (--graphs off) to save this memory.");
    images_ = Tensor::empty(images.shape(), images.dtype(), device_);
    labels_ = Tensor::empty(labels.shape(), labels.dtype(), device_);
    outputs_.clear();
    for (const Tensor& t : last_eager_) {
      CUDP_CHECK(t.defined() && t.device() == device_,
                 "GraphedStep: the step body's results must be tensors on ", device_, ", got ",
                 t.defined() ? t.str() : std::string("an undefined tensor"));
      outputs_.push_back(Tensor::empty(t.shape(), t.dtype(), device_));
    }
    if (!scalars_) scalars_ = std::make_unique<cuda::ReplayScalars>(devices_);
    if (launched_.get() == nullptr) launched_ = cuda::Event::create(device);
    for (size_t i = ready_.size(); i < devices_.size(); ++i) {
      ready_.push_back(cuda::Event::create(devices_[i]));
    }
  }
  scalars_->clear();
  copy_in(images, labels);
  const std::string what =
      detail::str("the captured step (batch ", shape_str(images.shape()), ") on ", device_);
  {
    const cuda::ReplayScalars::Activation active(*scalars_);
    graph_.capture_begin(device, stream, what);
    try {
      // Every device's stream is in the capture from the start: an allocation on one before it
      // joined through a copy would be pool memory, freed after the capture under the graph.
      for (const int d : devices_) graph_.fork(d, cuda::current_stream(d));
      const TensorList out = body_(images_, labels_);  // freed inside the capture
      CUDP_CHECK(out.size() == outputs_.size(), "GraphedStep: the step body returned ",
                 out.size(), " tensors while capturing but ", outputs_.size(), " before");
      for (size_t i = 0; i < out.size(); ++i) {
        CUDP_CHECK(out[i].defined() && out[i].shape() == outputs_[i].shape() &&
                       out[i].dtype() == outputs_[i].dtype() && out[i].device() == device_,
                   "GraphedStep: result ", i, " of the step body is ",
                   out[i].defined() ? out[i].str() : std::string("undefined"),
                   " while capturing but was ", outputs_[i].str(), " in the eager steps");
        outputs_[i].copy_from(out[i], stream);
      }
      // Work the step put on other devices (DataParallel's replicas) ends in the graph too.
      for (const int d : devices_) graph_.join(d, cuda::current_stream(d));
    } catch (const std::exception& e) {
      graph_.capture_abort();
      throw Error(detail::str("capturing ", what, " into a CUDA graph failed: ", e.what(),
                              ". The model's saved activations may refer to the abandoned "
                              "capture: rebuild it, and run the step without a graph "
                              "(--graphs off)"),
                  __FILE__, __LINE__);
    }
    graph_.capture_end();
  }
  captured_ = key_of(images, labels);
  last_eager_.clear();
  return launch(/*first=*/true);
}

TensorList GraphedStep::launch(bool first) {
  const cuda::DeviceGuard guard(device_.index);
  const cudaStream_t stream = cuda::current_stream(device_.index);
  // The capture ran the host side of the first launch's step; later ones run it here.
  if (!first) {
    if (options_.before_replay) options_.before_replay();
    scalars_->prepare_replay();
  }
  scalars_->upload(stream);
  // The graph's work on the other devices follows what their streams hold (an eager step's), and
  // what they are given next follows the graph.
  for (size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i] == device_.index) continue;
    const cuda::DeviceGuard other(devices_[i]);
    ready_[i].record(cuda::current_stream(devices_[i]));
    CUDP_CUDA_CHECK(cudaStreamWaitEvent(stream, ready_[i].get(), 0));
  }
  graph_.launch(stream);
  ++replays_;
  if (options_.after_launch) options_.after_launch();
  if (devices_.size() > 1) {
    launched_.record(stream);
    for (const int d : devices_) {
      if (d == device_.index) continue;
      const cuda::DeviceGuard other(d);
      CUDP_CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(d), launched_.get(), 0));
    }
  }
  const cuda::AllocationPurpose purpose("the results of a replayed step");
  TensorList out;
  for (const Tensor& t : outputs_) {
    Tensor copy = Tensor::empty(t.shape(), t.dtype(), device_);
    copy.copy_from(t, stream);
    out.push_back(std::move(copy));
  }
  return out;
}

EvalResult evaluate(Module& model, CrossEntropyLoss& criterion, const BatchSource& next) {
  TrainingFlagGuard restore(model);
  model.eval();
  const cuda::AllocationPurpose purpose(detail::str("evaluation on ", model.device()));
  std::vector<PendingStep> batches;
  Tensor images, labels;
  while (next(images, labels)) {
    const Forward f = forward_batch(model, images, labels);
    batches.push_back({criterion.forward(f.logits, f.labels), f.correct, f.logits.size(0)});
  }
  EvalResult result;
  double loss_sum = 0;
  for (const PendingStep& batch : batches) {
    const StepResult r = batch.wait();
    loss_sum += static_cast<double>(r.loss) * static_cast<double>(r.count);
    result.correct += r.correct;
    result.count += r.count;
  }
  if (result.count > 0) {
    result.loss = loss_sum / static_cast<double>(result.count);
  }
  return result;
}

}  // namespace cudp
