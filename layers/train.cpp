#include "layers/train.h"

#include <vector>

#include "engine/core/memory.h"

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
  optimizer.zero_grad();
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
