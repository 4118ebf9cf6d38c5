// CrossEntropyLoss (PyTorch's, reduction='mean'), argmax and accuracy counting.
//
// The loss is not a Module: it has no parameters and takes two inputs (logits and labels) of which
// only one has a gradient, so it has its own small interface, as in PyTorch's training loops:
//
//   Tensor loss = criterion.forward(logits, labels);    // 0-d f32 on the logits' device, no sync
//   Tensor dlogits = criterion.backward();              // [N, classes], what model.backward takes
//   float value = criterion.item();                     // reads the loss: the one host sync
//
// Logits are [N, classes] f32 and labels [N] i32 on the same device. The loss tensor has shape {}
// (PyTorch's 0-d scalar; numel() is 1, to_vector<float>() gives one value).
//
// Data parallel without a gather (docs/architecture.md §3): a replica holding chunk i (n_i samples) of a batch
// of B passes weight = n_i / B (chunk_weight(n_i, B)). Its loss is then mean_i * n_i / B, so the
// replicas' losses sum to the batch mean, and its dlogits are (softmax - onehot) / B, so the summed
// parameter gradients are exactly the single-device gradients, uneven chunks included.
//
// Labels out of range [0, classes): on the CPU, forward() throws ValueError at once, naming the
// first bad label's value, its index and the class count. On a GPU, checking before the kernel
// would cost a synchronisation per step, so the kernel flags bad labels on the device (their rows'
// loss and gradient are NaN, never garbage) and the flag is read when the loss value is: item() and
// check_labels() then throw the same error, after copying the labels to the host to find the
// culprit. backward() does not check (it would have to synchronise). Labels that come from the host
// (a data loader's) are best checked there before the upload, with check_label_range(): the
// training helpers (layers/train.h) do that.
#pragma once

#include <cstdint>

#include "engine/core/tensor.h"

namespace cudp {

class CrossEntropyLoss {
 public:
  // `weight` scales the loss and its gradient (1 for a whole batch; n_i / B for a replica's chunk).
  Tensor forward(const Tensor& logits, const Tensor& labels, double weight = 1.0);
  // dlogits = (softmax - onehot) * weight * grad_scale / N, a fresh tensor on the logits' device.
  // grad_scale is d(objective)/d(loss), usually 1. May be called more than once per forward.
  Tensor backward(double grad_scale = 1.0) const;

  // The last forward's loss as a host float (synchronises with its device), after check_labels().
  float item() const;
  // Throws ValueError if the last forward saw a label out of range (synchronises on a GPU).
  void check_labels() const;
  // Drops the last forward's state (the tensors returned by forward() stay valid); item(),
  // check_labels() and backward() then need a new forward. A captured training step calls it at
  // its end, so that the graph keeps no memory past the step (layers/train.h).
  void release();

  // The weight that makes a replica's chunk of n_i samples count as its share of a batch of B.
  static double chunk_weight(int64_t chunk, int64_t batch);

 private:
  void check_forward_done(const char* what) const;

  // The last forward's state. On a GPU, `result_` holds two 4-byte words: the loss (f32) and the
  // bad-label flag (i32) written by the kernel, so item() reads both with one copy; `loss_` is a
  // 0-d view of the first.
  Tensor result_, loss_, probs_, labels_;
  double weight_ = 1.0;
};

// Throws ValueError naming the first label outside [0, classes), its index and the class count
// (host labels only: i32 [N] on the CPU).
void check_label_range(const Tensor& labels, int64_t classes);

// out[i] = argmax over dim 1 of a 2-D f32 tensor, as i32 [N] on x's device (ties: the first index,
// as torch.max(x, 1)[1]; a NaN counts as the maximum). Only dim = 1 (or -1) of a 2-D tensor.
Tensor argmax(const Tensor& x, int64_t dim = 1);

// The number of i with predictions[i] == labels[i] (both i32 [N], same device), as a 0-d i32 tensor
// on their device: no host synchronisation, so a loop can accumulate it and read it once.
Tensor count_correct(const Tensor& predictions, const Tensor& labels);

// count_correct(argmax(logits, 1), labels) read to the host (synchronises).
int64_t num_correct(const Tensor& logits, const Tensor& labels);

}  // namespace cudp
