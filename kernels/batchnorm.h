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
// Storage types. The activations x, y, dy, dx are T = float or __nv_bfloat16 (bf16 is storage
// only: loaded into fp32, rounded to nearest even once on store); y has x's type and dx has x's
// type (a layer's output and gradients keep its input's dtype). Everything per channel (gamma,
// beta, running and saved statistics, dgamma, dbeta) and all arithmetic is fp32.
//
// Fused ReLU. With BnActivation::relu the forwards write max(bn(x), 0) with ReLU's own rule
// (kernels/elementwise.h: detail::relu, NaN kept). Rounding to bf16 keeps signs and zeros, so
// rounding then clamping and clamping then rounding give the same bits: the fused output equals
// ReLU applied to the unfused one. The backwards then take `relu_output`, the fused forward's y,
// and first mask the incoming gradient (the ReLU output's) by it with detail::relu_grad, exactly as
// ReLU's backward would, so fused and unfused gradients are the same bit for bit. relu_output ==
// nullptr means no fused ReLU.
//
// How (batchnorm.cu): no float atomics anywhere, so that results are bitwise reproducible. With
// detail::set_batchnorm_cluster(true), layers of at most kBatchnormClusterElements values (rows *
// c) take one launch per call (forward or backward): a thread-block cluster of 8 blocks per group
// of channels walks all rows, the blocks merge their partials through distributed shared memory in
// a fixed order, and the element-wise pass follows in the same launch; its grid depends on the
// shape alone. (It is correct on an H100, tests and compute-sanitizer included, but off by
// default: it measured slower, 2.9 against 2.3 ms a VGG-16-BN 32² step, its few resident blocks
// keeping too few loads in flight; bench/NOTES-tensor-cores.md.) Every other layer takes three
// kernels per call, whose grid fills the GPU, so that its result is bitwise reproducible on a
// given GPU model:
//   1. partial reduction: a grid of (channel groups) x (row blocks); each thread walks its rows
//      with 16-byte loads along C (4 floats or 8 bf16), each block writes one partial per channel
//      to a workspace;
//   2. finalize: per channel, the partials are merged in a fixed order (Chan et al.'s parallel
//      Welford merge for the forward statistics), parameters and running stats are written;
//   3. an element-wise pass (normalise + affine + ReLU + cast, or the masked dx), per-channel
//      coefficients held in registers.
// Forward statistics are numerically stable: every sum is of d = x - K, K = x[row 0] of the
// channel (a sample, so |mean - K| is a few standard deviations); threads turn their sums into
// (count, mean of d, M2), those are merged with Chan's formula, and y = ((x - K) - mean_d) * scale
// + shift, so a channel with mean 1000 is normalised as accurately as one with mean 0. Backward
// sums dy and dy * (x - mean), which needs no shift. The workspace (a few partials per channel)
// comes from cudaMallocAsync and goes back with cudaFreeAsync on the same stream: the current
// device must be the stream's device. Minimal traffic: train forward reads x twice and writes y (3
// |x|), eval reads once and writes once (2 |x|), backward reads x and dy twice and writes dx (5
// |x|), plus y twice with a fused ReLU (7 |x|).
//
// The CPU references accumulate in double and use the two-pass formula; they are templates over
// the activation type T = float, double (for finite differences in tests) or __nv_bfloat16, with
// per-channel values of type BnParam<T> (double for double, else float). Values are stored with one
// rounding of the double result (bf16: round to nearest even, kernels/layout.h's rule). T is
// deduced from x alone, so nullptr and literals of the other type are accepted.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

namespace cudp::kernels {

// What the forward applies to the normalised, affine output before storing it.
enum class BnActivation : uint8_t { none, relu };

// The type of the per-channel values beside activations of type T.
template <typename T>
using BnParam = std::conditional_t<std::is_same_v<T, double>, double, float>;

// T: float or __nv_bfloat16. batches_tracked: a device counter (the layer's num_batches_tracked),
// or null; += 1 by the launches that compute the statistics, so it costs no launch of its own.
template <typename T>
void batchnorm_forward_train(const T* x, std::type_identity_t<T>* y, const float* gamma,
                             const float* beta, float* running_mean, float* running_var,
                             float* save_mean, float* save_invstd, int64_t rows, int c,
                             float momentum, float eps, BnActivation act, cudaStream_t stream,
                             int64_t* batches_tracked = nullptr);
// T: float, double or __nv_bfloat16.
template <typename T>
void batchnorm_forward_train_cpu(const T* x, std::type_identity_t<T>* y, const BnParam<T>* gamma,
                                 const BnParam<T>* beta, BnParam<T>* running_mean,
                                 BnParam<T>* running_var, BnParam<T>* save_mean,
                                 BnParam<T>* save_invstd, int64_t rows, int c, BnParam<T> momentum,
                                 BnParam<T> eps, BnActivation act = BnActivation::none);

template <typename T>
void batchnorm_forward_eval(const T* x, std::type_identity_t<T>* y, const float* gamma,
                            const float* beta, const float* running_mean, const float* running_var,
                            int64_t rows, int c, float eps, BnActivation act, cudaStream_t stream);
template <typename T>
void batchnorm_forward_eval_cpu(const T* x, std::type_identity_t<T>* y, const BnParam<T>* gamma,
                                const BnParam<T>* beta, const BnParam<T>* running_mean,
                                const BnParam<T>* running_var, int64_t rows, int c, BnParam<T> eps,
                                BnActivation act = BnActivation::none);

// Backward of a training forward: save_mean and save_invstd are its. relu_output: see above.
// input_grad_sums (c floats, nullable): += the column sums of dx as stored (bf16: the rounded
// values), in fp32 and a fixed order (per thread in row order, a fixed tree over the block, then
// the row blocks in order: kernels/bias.h's bias_grad_from_partials, whose launch inside a Module's
// backward may be queued to its end: NOTE [Deferred bias gradients]). That is the bias gradient of
// the layer whose output x is (a convolution's before BatchNorm), taken in the pass that writes dx
// instead of a second read of it; dx is the same bits with or without. The sums are bias_grad's
// over dx in another order (its CPU reference, bias_grad_cpu, is theirs).
template <typename T>
void batchnorm_backward(const T* x, const std::type_identity_t<T>* dy,
                        const std::type_identity_t<T>* relu_output, const float* gamma,
                        const float* save_mean, const float* save_invstd,
                        std::type_identity_t<T>* dx, float* dgamma, float* dbeta, int64_t rows,
                        int c, float beta_accumulate, cudaStream_t stream,
                        float* input_grad_sums = nullptr);
template <typename T>
void batchnorm_backward_cpu(const T* x, const std::type_identity_t<T>* dy,
                            const std::type_identity_t<T>* relu_output, const BnParam<T>* gamma,
                            const BnParam<T>* save_mean, const BnParam<T>* save_invstd,
                            std::type_identity_t<T>* dx, BnParam<T>* dgamma, BnParam<T>* dbeta,
                            int64_t rows, int c, BnParam<T> beta_accumulate);

// Backward of an evaluation forward: the statistics are constants, so the layer is affine per
// channel, dx = dy * gamma * invstd with invstd = 1 / sqrt(running_var + eps) (computed as the
// evaluation forward computes it), dgamma = sum dy * (x - running_mean) * invstd, dbeta = sum dy
// (PyTorch's gradient of a BatchNorm2d in eval mode).
template <typename T>
void batchnorm_backward_eval(const T* x, const std::type_identity_t<T>* dy,
                             const std::type_identity_t<T>* relu_output, const float* gamma,
                             const float* running_mean, const float* running_var,
                             std::type_identity_t<T>* dx, float* dgamma, float* dbeta, int64_t rows,
                             int c, float eps, float beta_accumulate, cudaStream_t stream);
template <typename T>
void batchnorm_backward_eval_cpu(const T* x, const std::type_identity_t<T>* dy,
                                 const std::type_identity_t<T>* relu_output,
                                 const BnParam<T>* gamma, const BnParam<T>* running_mean,
                                 const BnParam<T>* running_var, std::type_identity_t<T>* dx,
                                 BnParam<T>* dgamma, BnParam<T>* dbeta, int64_t rows, int c,
                                 BnParam<T> eps, BnParam<T> beta_accumulate);

// ---- Split passes for batch norm over several participants (layers/sync_batchnorm.h) -----------
//
// SyncBatchNorm2d normalises each participant's rows with the statistics of all participants'
// rows together. The passes above are split at the points where the participants exchange
// per-channel f32 vectors, and the exchange is the caller's (a StatsGroup sum):
//
//   forward   batchnorm_local_stats writes this participant's summary into its slot of a zeroed
//             buffer of parts summaries; a sum over participants then gives every participant all
//             slots (adding zeros is exact, so this sum is an all-gather, bit for bit); then
//             batchnorm_merge_stats merges the slots in slot order and batchnorm_apply normalises.
//   backward  batchnorm_backward_local writes [sum g | sum g * (x - mean) | rows] (2c + 1) and this
//             participant's dgamma, dbeta (its rows' share: summed over participants they are the
//             gradient of the whole batch, as the engine sums gradients); the caller sums the
//             vector over participants; batchnorm_backward_global writes dx from the sums.
//
// A summary (batchnorm_summary_size(c) floats) is [n | K (c) | mean of x - K (c) | M2 (c)], the
// numerically careful form of the forward (above): K = x[row 0] of the participant, so every value
// is of the order of the data's spread, not of its mean. The merge works relative to K_0, slot 0's
// shift (x[row 0] of the whole batch when slots follow the batch order, the single-device pass's
// K): slot p's mean becomes (K_p - K_0) + mean_p, both terms a few standard deviations at most,
// then Chan's merge in slot order, so every participant computes the same statistics bit for bit
// and the running statistics stay identical. Counts are f32 sums, exact up to 2^24 rows in all.
//
// coef (4c floats on the GPU; doubles on the CPU, which computes in double) is [K_0 | mean of
// x - K_0 | gamma * invstd | beta]: y = ((x - K_0) - mean_d) * scale + shift, as the single-device
// forward. save_mean = K_0 + mean_d and save_invstd are the batch's, for the backward.
inline int64_t batchnorm_summary_size(int c) {
  return 1 + 3 * int64_t(c);
}

// T: float or __nv_bfloat16; rows >= 1.
template <typename T>
void batchnorm_local_stats(const T* x, int64_t rows, int c, float* summary, cudaStream_t stream);
template <typename T>
void batchnorm_local_stats_cpu(const T* x, int64_t rows, int c, float* summary);

// summaries: parts slots of batchnorm_summary_size(c) floats. Needs more than one row in all.
void batchnorm_merge_stats(const float* summaries, int parts, int c, const float* gamma,
                           const float* beta, float* running_mean, float* running_var,
                           float* save_mean, float* save_invstd, float momentum, float eps,
                           float* coef, cudaStream_t stream);
// The CPU's: merges in double; throws a ValueError when all slots hold one row or none.
void batchnorm_merge_stats_cpu(const float* summaries, int parts, int c, const float* gamma,
                               const float* beta, float* running_mean, float* running_var,
                               float* save_mean, float* save_invstd, float momentum, float eps,
                               double* coef);

template <typename T>
void batchnorm_apply(const T* x, std::type_identity_t<T>* y, const float* coef, int64_t rows, int c,
                     BnActivation act, cudaStream_t stream);
template <typename T>
void batchnorm_apply_cpu(const T* x, std::type_identity_t<T>* y, const double* coef, int64_t rows,
                         int c, BnActivation act = BnActivation::none);

// sums: 2c + 1 floats, [sum g | sum g * (x - save_mean) | rows]; dgamma/dbeta as the backward
// above (nullable, beta_accumulate), from this participant's rows.
template <typename T>
void batchnorm_backward_local(const T* x, const std::type_identity_t<T>* dy,
                              const std::type_identity_t<T>* relu_output, const float* save_mean,
                              const float* save_invstd, int64_t rows, int c, float* sums,
                              float* dgamma, float* dbeta, float beta_accumulate,
                              cudaStream_t stream);
template <typename T>
void batchnorm_backward_local_cpu(const T* x, const std::type_identity_t<T>* dy,
                                  const std::type_identity_t<T>* relu_output,
                                  const float* save_mean, const float* save_invstd, int64_t rows,
                                  int c, float* sums, float* dgamma, float* dbeta,
                                  float beta_accumulate);
// sums: the participants' sums added up (their rows slot: the batch's rows M). dx = gamma * invstd
// * (g - sum g / M - (x - mean) * invstd^2 * sum g (x - mean) / M).
template <typename T>
void batchnorm_backward_global(const T* x, const std::type_identity_t<T>* dy,
                               const std::type_identity_t<T>* relu_output, const float* gamma,
                               const float* save_mean, const float* save_invstd, const float* sums,
                               std::type_identity_t<T>* dx, int64_t rows, int c,
                               cudaStream_t stream);
template <typename T>
void batchnorm_backward_global_cpu(const T* x, const std::type_identity_t<T>* dy,
                                   const std::type_identity_t<T>* relu_output, const float* gamma,
                                   const float* save_mean, const float* save_invstd,
                                   const float* sums, std::type_identity_t<T>* dx, int64_t rows,
                                   int c);

// The largest layer (rows * c values) whose training forward and backward take one launch.
// Above it the bytes, not the launches, are the cost, and the multi-pass kernels' full grid reads
// them faster than clusters of 8 blocks per channel group would.
inline constexpr int64_t kBatchnormClusterElements = int64_t(1) << 23;
// Layers of fewer than 64 channels take one launch only up to this many values.
inline constexpr int64_t kBatchnormClusterFewChannels = int64_t(1) << 20;

namespace detail {
// Argument checks shared by the launchers and the CPU references; throw ValueError naming the
// value.
void check_batchnorm(const char* op, int64_t rows, int c, bool training);

// The one-launch cluster kernels for the layers small enough (on), or the multi-pass kernels at
// every size (off, the default for now: see above): to compare (bench_train --bn-cluster), and for
// tests that need the multi-pass path's bits (the split passes of SyncBatchNorm2d are multi-pass).
// The paths give the same values up to fp32 rounding in another order. The evaluation forward and
// the backward of an evaluation forward are one pass either way.
void set_batchnorm_cluster(bool on);
bool batchnorm_cluster();
// Whether a training forward or backward of rows x c on the current device takes one launch.
bool batchnorm_one_launch(int64_t rows, int c);
// The one-launch kernels' threads along the rows of a block, for rows x c values of `bytes` bytes
// read `v` to a lane (16 / bytes where c is a multiple of it and the pointers are 16-byte aligned,
// else 1); 0 where the layer takes the multi-pass kernels. Block rank q's thread ty walks rows q *
// it + ty, stepping by 8 * it; tests emulate the kernels' order of operations with it.
int batchnorm_cluster_rows_per_block(int64_t rows, int c, int v, int bytes);
}  // namespace detail

}  // namespace cudp::kernels
