// Softmax cross-entropy for classification, and argmax/accuracy for evaluation.
//
// The loss is PyTorch's CrossEntropyLoss(reduction='mean') with no class weights, no ignore_index
// and no label smoothing: loss = mean_i (logsumexp(logits_i) - logits_i[label_i]), computed stably
// (the row maximum is subtracted before exp). logits are [n, classes] row-major fp32, labels int32.
//
// Forward writes the softmax probabilities to `probs` [n, classes], which backward consumes:
//   dlogits = (probs - onehot(label)) * grad_scale / n.
// grad_scale is the gradient of the final objective with respect to this loss, usually 1. It lets a
// replica that computes the loss on its own chunk of the batch (the fast data-parallel path, no
// gather) weight the chunk by its share: with n_i of N samples on replica i, grad_scale = n_i / N
// gives dlogits = (probs - onehot) / N, so the gradients summed over replicas are exactly those of
// the mean loss over the whole batch, uneven chunks included (docs/architecture.md §3). dlogits may be the
// same buffer as probs (in place); logits and probs must not overlap.
//
// A label outside [0, classes) cannot be trusted and must not be read past: its row's loss and
// gradient are NaN (so the mean is NaN and nothing silently trains on garbage), and, when
// bad_label is given (a device int the caller zeroes), *bad_label is set to 1. The check costs no
// host synchronisation; the caller reads the flag when it wants to (PyTorch raises a device
// assert).
//
// Reductions are deterministic: the mean over rows is one block summing in a fixed order.
//
// The CPU references accumulate in double; the cross-entropy ones are templates for float and
// double (double for finite differences in tests), T deduced from the logits/probs alone.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

namespace cudp::kernels {

// loss: one device float (=). probs: [n, classes] (=). bad_label: nullable device int.
void softmax_cross_entropy_forward(const float* logits, const int32_t* labels, float* loss,
                                   float* probs, int n, int classes, int* bad_label,
                                   cudaStream_t stream);
// bad_label here is host memory (nullable).
template <typename T>
void softmax_cross_entropy_forward_cpu(const T* logits, const int32_t* labels,
                                       std::type_identity_t<T>* loss,
                                       std::type_identity_t<T>* probs, int n, int classes,
                                       int* bad_label);

// dlogits [n, classes] (=), may alias probs.
void softmax_cross_entropy_backward(const float* probs, const int32_t* labels, float* dlogits,
                                    int n, int classes, float grad_scale, cudaStream_t stream);
template <typename T>
void softmax_cross_entropy_backward_cpu(const T* probs, const int32_t* labels,
                                        std::type_identity_t<T>* dlogits, int n, int classes,
                                        std::type_identity_t<T> grad_scale);

// out[i] = argmax_j x[i, j] (int32), ties to the first index as torch.max/argmax do; a NaN counts
// as the maximum (the first NaN of the row).
void argmax_rows(const float* x, int32_t* out, int n, int classes, cudaStream_t stream);
void argmax_rows_cpu(const float* x, int32_t* out, int n, int classes);

// *count = number of i with pred[i] == labels[i] (=), one device int. Integer sums: deterministic.
void count_correct(const int32_t* pred, const int32_t* labels, int n, int* count,
                   cudaStream_t stream);
void count_correct_cpu(const int32_t* pred, const int32_t* labels, int n, int* count);

namespace detail {
// Argument checks shared by the launchers and the CPU references; throw ValueError naming the
// value.
void check_cross_entropy(const char* op, int n, int classes);
void check_rows(const char* op, int n, int classes);
}  // namespace detail

}  // namespace cudp::kernels
