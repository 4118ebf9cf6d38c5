// Single-device training and evaluation helpers: the loop body every example writes, once.
//
// A step is forward, loss, zero_grad, backward, optimizer step, and the batch's accuracy counted as
// the seed program counts it (torch.max(output, 1)[1] compared with the labels, on the training
// forward's outputs). Everything is enqueued on the model's device's current stream; the only host
// synchronisation is reading the results:
//
//   train_step()        reads the loss and the correct count at the end of the step (one
//                       synchronisation point: the second read finds the device already done);
//   train_step_async()  reads nothing and returns device tensors; call wait() when the numbers are
//                       wanted (every k steps, or at the end of an epoch), or never.
//
// Inputs may be on the host or on the model's device; host tensors are copied to the device here
// (synchronously; a loader that overlaps copies passes device tensors). Host labels are checked
// against the class count before the copy (layers/loss.h says why: an error naming the bad label
// with no synchronisation). Labels already on the device are checked by the loss kernel's flag,
// which train_step reads with the loss; train_step_async leaves that to the caller
// (CrossEntropyLoss::check_labels), and a bad label shows as a NaN loss. By the time the flag is
// read, the step has been taken with NaN gradients: the model is lost, as after PyTorch's device
// assert. Host labels are checked before anything runs.
#pragma once

#include <cstdint>
#include <functional>

#include "layers/loss.h"
#include "layers/module.h"
#include "layers/optim.h"

namespace cudp {

struct StepResult {
  float loss;       // the batch's mean loss
  int64_t correct;  // samples whose argmax is the label
  int64_t count;    // samples in the batch
};

// A step's results still on the device.
struct PendingStep {
  Tensor loss;     // 0-d f32
  Tensor correct;  // 0-d i32
  int64_t count = 0;
  StepResult wait() const;  // reads both (synchronises)
};

// Images [N, H, W, C] f32 (NHWC, layers/module.h), labels [N] i32. The model's training flag is
// left as it is (the caller chooses train() or eval()); its input_grad is set off (the images need
// no gradient, so the first layer skips backward-data: Module::set_input_grad).
PendingStep train_step_async(Module& model, CrossEntropyLoss& criterion, Optimizer& optimizer,
                             const Tensor& images, const Tensor& labels);
StepResult train_step(Module& model, CrossEntropyLoss& criterion, Optimizer& optimizer,
                      const Tensor& images, const Tensor& labels);

struct EvalResult {
  double loss = 0;  // mean over samples (each batch's mean weighted by its size)
  int64_t correct = 0;
  int64_t count = 0;
  double accuracy() const { return count ? static_cast<double>(correct) / count : 0.0; }
};

// Fills images and labels with the next batch and returns true, or returns false at the end.
using BatchSource = std::function<bool(Tensor& images, Tensor& labels)>;

// Runs the model in evaluation mode over every batch from `next` (the training flag is restored
// afterwards, also on an exception) and reads the results once, at the end: no synchronisation per
// batch.
EvalResult evaluate(Module& model, CrossEntropyLoss& criterion, const BatchSource& next);

}  // namespace cudp
