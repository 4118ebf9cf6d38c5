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
#include <memory>
#include <vector>

#include "engine/core/graph.h"

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

// Gradient accumulation (cudp-vgg --accumulate N): the forward and backward of one batch of B rows
// run as `micro_batches` micro-batches (torch.chunk's sizes along dim 0: ceil(B / N) rows, the
// last shorter), so activations take 1/N of the memory. Micro-batch j of n_j rows computes its
// loss with weight n_j / B (CrossEntropyLoss::forward's weight), so the gradients its backward
// adds (parameter gradients accumulate, layers/module.h) sum to the whole batch's mean-loss
// gradient, and its weighted losses to the batch's mean loss. `backward(grad_logits, last)` runs
// the model's backward of one micro-batch; a DataParallel passes all but the last under
// no_sync(), so the replicas sum their gradients once (DataParallel::no_sync), and without one
// `model.backward` is used. `gradient(criterion, logits, labels, weight)` makes the gradient of
// the logits after criterion.forward (label smoothing); null: criterion.backward(). Zero the
// gradients before and step the optimizer after, as for one batch. Returns the batch's mean loss
// (0-d, on the logits' device) and the logits of all B rows (for accuracy). BatchNorm in training
// mode normalises each micro-batch with its own statistics, so a model with BatchNorm computes
// another function than on the whole batch (as PyTorch's accumulation does).
// `batch_weight` scales every micro-batch's weight (batch_weight n_j / B) and so the returned
// loss: the weight of the whole batch's mean loss, DistributedDataParallel::loss_weight(B) on a
// rank (n_r over the global batch), which DDP passes all but the last micro-batch under no_sync()
// as DataParallel does.
struct MicroBatchStep {
  Tensor loss;    // 0-d f32: the batch's mean loss
  Tensor logits;  // [B, classes]
};
using MicroBackward = std::function<void(const Tensor& grad_logits, bool last)>;
using MicroGradient = std::function<Tensor(CrossEntropyLoss& criterion, const Tensor& logits,
                                           const Tensor& labels, double weight)>;
MicroBatchStep forward_backward_micro_batches(Module& model, CrossEntropyLoss& criterion,
                                              const Tensor& images, const Tensor& labels,
                                              int64_t micro_batches,
                                              const MicroBackward& backward = {},
                                              const MicroGradient& gradient = {},
                                              double batch_weight = 1.0);

// NOTE [Graphed training steps]
// A training step captured into a CUDA graph once and replayed (engine/core/graph.h): the host
// issues ~one launch per step instead of ~150. GraphedStep runs a step body (train_step_async, or
// a trainer's own) on batches of one shape:
//   - the first `warmup_steps` batches of a shape run eagerly: the allocator's pool grows to the
//     step's size, the kernels' per-shape plans are made, the optimizer's state is created (none
//     of which may first happen inside a capture);
//   - the next one is captured: its batch is copied into static input tensors, the body runs on
//     them with the stream captured (no kernel runs), and the graph is instantiated and launched;
//   - every later batch of that shape is copied into the static inputs and the graph replayed.
//   - a batch of another shape (an epoch's last, partial batch) runs eagerly, the graph is kept.
// Results: the body returns device tensors (loss, correct count, ...); the graph copies them into
// static outputs and each step returns fresh copies of those, so a caller may keep several steps'
// results. What changes between steps without changing the graph (the learning rate, the
// optimizer's counts, Dropout's offsets) is written into device memory before each replay (NOTE
// [Replay scalars]); a replay therefore computes exactly what an eager step would, bit for bit
// (tests/layers/graphed_step_gpu_test.cpp). What a replay cannot follow must not change after the
// capture: the shapes, the model's structure and train/eval mode, which parameters the optimizer
// holds, whether a step is gated (step(skip)), and anything the body decides on the host from
// values of earlier steps. The model, criterion and optimizer must outlive the GraphedStep.
// Host inputs are copied synchronously unless pinned (then asynchronously, and kept until the copy
// has run); host labels are not range-checked here (the loss kernel flags a bad label, and
// CrossEntropyLoss::item() reports it). Memory: the captured step's activations live in the
// graph's own memory, beside what the eager steps left reserved in the pool.
struct GraphedStepOptions {
  int warmup_steps = 2;  // eager steps of a shape before it is captured (>= 1)
  bool enabled = true;   // false: every step eager (the --graphs off comparison)
  // Host code the body runs that a replay must repeat, run before each replay after the first
  // (parallel::Replicated::follow_primary: the replicas' optimizers take the primary's rate).
  std::function<void()> before_replay;
  // Host code run after each launch of the graph, the first included, with the launch just
  // enqueued on the device's current stream: a DistributedDataParallel step's collectives run
  // inside the graph, so the trainer watches each launch with
  // parallel::Communicator::watch_graph_launch (a peer that never joins ends in the collective
  // watchdog's error, as in an eager step).
  std::function<void()> after_launch;
};

class GraphedStep {
 public:
  // One training step on device tensors of a fixed shape, returning its results on the device.
  using Body = std::function<TensorList(const Tensor& images, const Tensor& labels)>;
  using Options = GraphedStepOptions;

  // `device`: where the step runs (a CUDA device; on the CPU every step is eager). `devices`: every
  // device the step launches work on (for the replay scalars), `device` when empty.
  GraphedStep(Body body, Device device, Options options, std::vector<int> devices = {});
  // train_step_async(model, criterion, optimizer, ...) as the body, on the model's device.
  GraphedStep(Module& model, CrossEntropyLoss& criterion, Optimizer& optimizer,
              Options options = {});
  ~GraphedStep();
  GraphedStep(const GraphedStep&) = delete;
  GraphedStep& operator=(const GraphedStep&) = delete;
  GraphedStep(GraphedStep&&) = delete;
  GraphedStep& operator=(GraphedStep&&) = delete;

  // One step on a batch (host or device tensors): eager, captured or replayed (see above).
  TensorList run(const Tensor& images, const Tensor& labels);
  // The train_step_async form: {loss, correct, count}.
  PendingStep step(const Tensor& images, const Tensor& labels);

  bool captured() const { return graph_.instantiated(); }
  int64_t replays() const { return replays_; }          // graph launches, the first included
  int64_t eager_steps() const { return eager_steps_; }  // steps run without the graph
  size_t graph_nodes() const { return graph_.node_count(); }
  // Memory the captured step allocated and kept past its end (CudaGraph::graph_owned_allocations):
  // 0 when the body leaves nothing behind, as train_step_async's does (layers free what they saved
  // at backward; the body releases the criterion).
  size_t graph_owned_allocations() const { return graph_.graph_owned_allocations(); }

 private:
  struct Key {
    Shape images, labels;
    DType images_dtype, labels_dtype;
    bool operator==(const Key&) const = default;
  };
  static Key key_of(const Tensor& images, const Tensor& labels);
  TensorList capture(const Tensor& images, const Tensor& labels);
  void copy_in(const Tensor& images, const Tensor& labels);
  TensorList launch(bool first);

  Body body_;
  Device device_;
  Options options_;
  std::vector<int> devices_;
  cuda::CudaGraph graph_;
  std::unique_ptr<cuda::ReplayScalars> scalars_;
  Key captured_{}, warming_{};
  int warm_count_ = 0;
  Tensor images_, labels_;  // static inputs
  TensorList outputs_;      // static outputs
  TensorList last_eager_;   // the last eager step's results: the outputs' shapes and dtypes
  TensorList held_;         // pinned host inputs until their copies have run
  cuda::Event copied_;
  // Ordering the other devices' streams around a launch: one event per device, and the launch's.
  std::vector<cuda::Event> ready_;
  cuda::Event launched_;
  int64_t replays_ = 0, eager_steps_ = 0;
};

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
