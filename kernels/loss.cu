// Softmax cross-entropy, argmax and accuracy kernels (semantics: kernels/loss.h).
//
// One warp per row: class counts are small (10 for Fashion-MNIST, 1000 for ImageNet), so a warp
// striding over a row, then reducing with shuffles, keeps every row in L1 across its passes. The
// xor-butterfly reductions leave the same value in every lane and are the same every run; the mean
// over rows is one block in a fixed order, so the loss is bitwise reproducible.
#include <algorithm>
#include <cmath>

#include "engine/core/launch.cuh"
#include "kernels/loss.h"
#include "kernels/workspace.h"

namespace cudp::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarp * kWarpsPerBlock;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFull, v, offset));
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFull, v, offset);
  return v;
}

__device__ __forceinline__ bool label_ok(int32_t label, int classes) {
  return label >= 0 && label < classes;
}

// Per row: probs = exp(x - max) / sum, row_loss = log(sum) - (x[label] - max), both small terms
// (subtracting max + log(sum) from x[label] instead would lose digits for large logits).
__global__ void ce_forward_rows_kernel(const float* __restrict__ logits,
                                       const int32_t* __restrict__ labels,
                                       float* __restrict__ probs, float* __restrict__ row_loss,
                                       int n, int classes, int* __restrict__ bad_label) {
  kernel_entry();
  const int i = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= n) return;  // the whole warp: no shuffle is left waiting
  const float* row = logits + int64_t(i) * classes;
  float max = -INFINITY;
  for (int j = lane; j < classes; j += kWarp) max = fmaxf(max, row[j]);
  max = warp_max(max);
  float sum = 0.f;
  for (int j = lane; j < classes; j += kWarp) sum += expf(row[j] - max);
  sum = warp_sum(sum);
  float* out = probs + int64_t(i) * classes;
  for (int j = lane; j < classes; j += kWarp) out[j] = expf(row[j] - max) / sum;
  if (lane == 0) {
    const int32_t label = labels[i];
    if (label_ok(label, classes)) {
      row_loss[i] = logf(sum) - (row[label] - max);
    } else {
      row_loss[i] = NAN;
      if (bad_label) *bad_label = 1;  // every writer writes the same value
    }
  }
}

// One block: *loss = (sum of row_loss in a fixed order) / n.
__global__ void ce_mean_kernel(const float* __restrict__ row_loss, int n,
                               float* __restrict__ loss) {
  kernel_entry();
  __shared__ float partial[kThreads];
  float sum = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) sum += row_loss[i];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = partial[0] / float(n);
}

// probs and dlogits may be the same buffer: each element is read, then written, by one thread.
__global__ void ce_backward_kernel(const float* probs, const int32_t* __restrict__ labels,
                                   float* dlogits, int n, int classes, float scale) {
  kernel_entry();
  const int64_t total = int64_t(n) * classes;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int i = int(e / classes), j = int(e - int64_t(i) * classes);
    const int32_t label = labels[i];
    const float onehot = j == label ? 1.f : 0.f;
    dlogits[e] = label_ok(label, classes) ? (probs[e] - onehot) * scale : NAN;
  }
}

// Is (a, ia) preferred over (b, ib)? ia < 0 marks "no candidate". A NaN beats numbers; among
// equals (or NaNs) the smaller index wins.
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  const bool nan_a = isnan(a), nan_b = isnan(b);
  if (nan_a || nan_b) return nan_a && (!nan_b || ia < ib);
  return a > b || (a == b && ia < ib);
}

__global__ void argmax_rows_kernel(const float* __restrict__ x, int32_t* __restrict__ out, int n,
                                   int classes) {
  kernel_entry();
  const int i = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= n) return;
  const float* row = x + int64_t(i) * classes;
  float best = 0.f;
  int at = -1;
  for (int j = lane; j < classes; j += kWarp) {
    const float v = row[j];
    if (better(v, j, best, at)) best = v, at = j;
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const float other = __shfl_down_sync(kFull, best, offset);
    const int other_at = __shfl_down_sync(kFull, at, offset);
    if (better(other, other_at, best, at)) best = other, at = other_at;
  }
  if (lane == 0) out[i] = at;
}

__global__ void count_correct_kernel(const int32_t* __restrict__ pred,
                                     const int32_t* __restrict__ labels, int n,
                                     int* __restrict__ count) {
  kernel_entry();
  __shared__ int partial[kThreads];
  int hits = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) hits += pred[i] == labels[i];
  partial[threadIdx.x] = hits;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *count = partial[0];
}

unsigned row_blocks(int n) {
  return unsigned((n + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

void softmax_cross_entropy_forward(const float* logits, const int32_t* labels, float* loss,
                                   float* probs, int n, int classes, int* bad_label,
                                   cudaStream_t stream) {
  detail::check_cross_entropy("softmax_cross_entropy_forward", n, classes);
  Workspace ws(size_t(n) * sizeof(float), stream, "cross-entropy's per-row losses");
  float* row_loss = ws.get();
  launch("ce_forward_rows_kernel", ce_forward_rows_kernel, row_blocks(n), kThreads, 0, stream,
         logits, labels, probs, row_loss, n, classes, bad_label);
  launch("ce_mean_kernel", ce_mean_kernel, 1, kThreads, 0, stream, row_loss, n, loss);
}

void softmax_cross_entropy_backward(const float* probs, const int32_t* labels, float* dlogits,
                                    int n, int classes, float grad_scale, cudaStream_t stream) {
  detail::check_cross_entropy("softmax_cross_entropy_backward", n, classes);
  const float scale = float(double(grad_scale) / n);
  const unsigned blocks = std::min(grid_for(int64_t(n) * classes, kThreads), 65535u);
  launch("ce_backward_kernel", ce_backward_kernel, blocks, kThreads, 0, stream, probs, labels,
         dlogits, n, classes, scale);
}

void argmax_rows(const float* x, int32_t* out, int n, int classes, cudaStream_t stream) {
  detail::check_rows("argmax_rows", n, classes);
  launch("argmax_rows_kernel", argmax_rows_kernel, row_blocks(n), kThreads, 0, stream, x, out, n,
         classes);
}

void count_correct(const int32_t* pred, const int32_t* labels, int n, int* count,
                   cudaStream_t stream) {
  CUDP_CHECK(n >= 0, "count_correct: n must be >= 0, got ", n);
  launch("count_correct_kernel", count_correct_kernel, 1, kThreads, 0, stream, pred, labels, n,
         count);
}

}  // namespace cudp::kernels
