// Batch normalisation over NHWC activations: per channel over rows = N*H*W (PyTorch's BatchNorm2d,
// CUDNN_BATCHNORM_SPATIAL). x, y, dy, dx are [rows, c] row-major; the per-channel vectors have c.
//
// Semantics, exactly PyTorch's:
// - Training normalises with the batch mean and the biased variance (divide by rows), and saves the
//   mean and invstd = 1/sqrt(var + eps) for backward. Running statistics, when given, follow
//     running_mean = (1 - momentum) * running_mean + momentum * mean
//     running_var  = (1 - momentum) * running_var  + momentum * var * rows / (rows - 1) (unbiased)
//   (PyTorch's momentum=None, a cumulative average, is momentum = 1 / num_batches_tracked here.)
//   Training needs rows > 1, as PyTorch does ("Expected more than 1 value per channel when
//   training").
// - Evaluation normalises with the running statistics.
// - gamma == nullptr means 1 and beta == nullptr means 0 (affine=False); running_mean/running_var
//   nullptr means track_running_stats=False; save_mean/save_invstd may be nullptr when no backward
//   follows. In backward dgamma/dbeta may be nullptr (affine=False).
// - Backward writes dx (=). Parameter gradients accumulate (docs/architecture.md §2.1):
//   dparam = beta_accumulate * dparam + grad, and beta_accumulate == 0 never reads dparam (so a NaN
//   there does not leak).
//
// How (batchnorm.cu): the GPU path is three kernels per call, with no float atomics, so that the
// result is bitwise reproducible on a given GPU model:
//   1. partial reduction: a grid of (channel groups) x (row blocks); each thread walks its rows
//   with
//      float4 loads along C, each block writes one partial per channel to a workspace;
//   2. finalize: per channel, the partials are merged in a fixed order (Chan et al.'s parallel
//      Welford merge for the forward statistics), parameters and running stats are written;
//   3. an element-wise pass (normalise, or dx), per-channel coefficients held in registers.
// Forward statistics are numerically stable: every sum is of d = x - K, K = x[row 0] of the
// channel (a sample, so |mean - K| is a few standard deviations); threads turn their sums into
// (count, mean of d, M2), those are merged with Chan's formula, and y = ((x - K) - mean_d) * scale
// + shift, so a channel with mean 1000 is normalised as accurately as one with mean 0. Backward
// sums dy and dy * (x - mean), which needs no shift. The workspace (a few partials per channel)
// comes from cudaMallocAsync and goes back with cudaFreeAsync on the same stream: the current
// device must be the stream's device. Minimal traffic: train forward reads x twice and writes y (3
// |x|), eval reads once and writes once (2 |x|), backward reads x and dy twice and writes dx (5
// |x|).
//
// The CPU references are templates for float and double (double for finite differences in tests),
// accumulate in double and use the two-pass formula. T is deduced from x alone
// (std::type_identity_t elsewhere), so nullptr and literals of the other type are accepted.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

namespace cudp::kernels {

void batchnorm_forward_train(const float* x, float* y, const float* gamma, const float* beta,
                             float* running_mean, float* running_var, float* save_mean,
                             float* save_invstd, int64_t rows, int c, float momentum, float eps,
                             cudaStream_t stream);
template <typename T>
void batchnorm_forward_train_cpu(const T* x, std::type_identity_t<T>* y,
                                 const std::type_identity_t<T>* gamma,
                                 const std::type_identity_t<T>* beta,
                                 std::type_identity_t<T>* running_mean,
                                 std::type_identity_t<T>* running_var,
                                 std::type_identity_t<T>* save_mean,
                                 std::type_identity_t<T>* save_invstd, int64_t rows, int c,
                                 std::type_identity_t<T> momentum, std::type_identity_t<T> eps);

void batchnorm_forward_eval(const float* x, float* y, const float* gamma, const float* beta,
                            const float* running_mean, const float* running_var, int64_t rows,
                            int c, float eps, cudaStream_t stream);
template <typename T>
void batchnorm_forward_eval_cpu(const T* x, std::type_identity_t<T>* y,
                                const std::type_identity_t<T>* gamma,
                                const std::type_identity_t<T>* beta,
                                const std::type_identity_t<T>* running_mean,
                                const std::type_identity_t<T>* running_var, int64_t rows, int c,
                                std::type_identity_t<T> eps);

// save_mean and save_invstd are the training forward's.
void batchnorm_backward(const float* x, const float* dy, const float* gamma, const float* save_mean,
                        const float* save_invstd, float* dx, float* dgamma, float* dbeta,
                        int64_t rows, int c, float beta_accumulate, cudaStream_t stream);
template <typename T>
void batchnorm_backward_cpu(const T* x, const std::type_identity_t<T>* dy,
                            const std::type_identity_t<T>* gamma,
                            const std::type_identity_t<T>* save_mean,
                            const std::type_identity_t<T>* save_invstd, std::type_identity_t<T>* dx,
                            std::type_identity_t<T>* dgamma, std::type_identity_t<T>* dbeta,
                            int64_t rows, int c, std::type_identity_t<T> beta_accumulate);

namespace detail {
// Argument checks shared by the launchers and the CPU references; throw ValueError naming the
// value.
void check_batchnorm(const char* op, int64_t rows, int c, bool training);
}  // namespace detail

}  // namespace cudp::kernels
