// Bias addition and its gradient, over a row-major [rows, cols] fp32 matrix whose columns are the
// bias's entries: NHWC activations (rows = N*H*W, cols = C) and Linear outputs (rows = batch,
// cols = out_features) alike.
//
// bias_grad is a column reduction of the whole activation gradient (3.2M rows of 64 columns for
// VGG's first layers at 224², batch 64), so it is built to run at memory bandwidth and to be
// deterministic, since data-parallel replicas must stay bit-identical:
//   stage 1: the rows are cut into G fixed chunks (G from the shape alone, at most ~1024); a block
//            sums one chunk for a tile of columns — each thread one column (or 4 adjacent columns
//            as a float4) down every lanes-th row, then the block's lanes summed in order through
//            shared memory — and writes G partial rows to a workspace;
//   stage 2: one thread per column and lane sums the G partials in a fixed order, the lanes are
//            summed in order, and beta * dbias is added.
// No atomics anywhere: the result depends only on (rows, cols, whether dy is 16-byte aligned with
// cols % 4 == 0) and the data, never on scheduling. Sums are fp32 (docs/architecture.md §2.3); the longest
// chain of additions any element goes through is about rows / (G * lanes) + lanes + G / 32 + 32,
// under 300 for every shape the tests use. The workspace (G * cols floats) comes from
// cudaMallocAsync on the stream and is freed with cudaFreeAsync right after; with G == 1 there is
// none.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/workspace.h"

namespace cudp::kernels {

// y[r * cols + c] += bias[c].
void bias_add(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream);
void bias_add_cpu(float* y, const float* bias, int64_t rows, int64_t cols);

// dbias[c] = beta * dbias[c] + sum_r dy[r * cols + c]. beta = 1 accumulates parameter gradients
// (docs/architecture.md §2.1); beta = 0 overwrites and never reads dbias (it may hold garbage or NaN). The
// CPU reference accumulates in double.
void bias_grad(const float* dy, float* dbias, int64_t rows, int64_t cols, float beta,
               cudaStream_t stream);
void bias_grad_cpu(const float* dy, float* dbias, int64_t rows, int64_t cols, float beta);

// The same reduction over bf16 gradients (the bf16 precision policy): sums in fp32, the same order.
void bias_grad(const __nv_bfloat16* dy, float* dbias, int64_t rows, int64_t cols, float beta,
               cudaStream_t stream);
void bias_grad_cpu(const __nv_bfloat16* dy, float* dbias, int64_t rows, int64_t cols, float beta);

// The backward of a ReLU fused into a layer's output ahead of the bias gradient, in one pass over
// dy and y: dy_masked = relu_grad(y, dy) (y > 0 ? dy : 0, kernels/elementwise.h), written, and,
// when dbias is not null, dbias = beta * dbias + the column sums of dy_masked (as bias_grad).
// dy_masked may alias dy. T is float or __nv_bfloat16; masking is exact, so dy_masked is bit for
// bit what ReLU's own backward writes.
template <typename T>
void relu_mask_bias_grad(const T* y, const T* dy, T* dy_masked, float* dbias, int64_t rows,
                         int64_t cols, float beta, cudaStream_t stream);
template <typename T>
void relu_mask_bias_grad_cpu(const T* y, const T* dy, T* dy_masked, float* dbias, int64_t rows,
                             int64_t cols, float beta);
// The reference of detail::relu_mask_bias_grad_deferrable<float, __nv_bfloat16>: fp32 y and dy,
// the masked gradient stored in bf16 (rounded to nearest even, as kernels/layout.h's
// f32_to_bf16), dbias the sums of the fp32 masked values (relu_mask_bias_grad<float>'s).
void relu_mask_bias_grad_cpu(const float* y, const float* dy, __nv_bfloat16* dy_masked,
                             float* dbias, int64_t rows, int64_t cols, float beta);

// dbias[c] = beta * dbias[c] + sum_g partial[g * cols + c], the chunks g added in a fixed order:
// bias_grad's stage 2, for a kernel that leaves partial column sums on its way (the bf16
// backward-weight, kernels/conv2d.h). partial is chunks x cols fp32, chunks >= 1.
void bias_grad_from_partials(const float* partial, float* dbias, int64_t chunks, int64_t cols,
                             float beta, cudaStream_t stream);
// The same, taking the partials' workspace over, for a parameter's gradient that nothing reads
// before the backward ends: inside a DeferredBiasGrads scope of this thread on `stream` the
// launch is queued (below), else it runs now and the workspace is freed after it.
void bias_grad_from_partials(Workspace partials, float* dbias, int64_t chunks, int64_t cols,
                             float beta, cudaStream_t stream);

// NOTE [Deferred bias gradients]
// A bias gradient that a kernel leaves as partial column sums on its way (max pooling's backward,
// backward-data's column sums, BatchNorm's dx pass, backward-weight's fused bias sums) needs one
// more launch to add the partial rows up: a few blocks and a few microseconds on the backward's
// critical path, although nothing in the backward reads its result (2.5-4.5 us of a 32 x 32
// training step's wall time each on an H100, bench/NOTES-tensor-cores.md, session 34). Inside a
// DeferredBiasGrads scope, those last launches on the scope's stream and device are queued, each
// with its partials' workspace, and flush_deferred_bias_grads() runs the whole queue as one launch
// whose blocks do each of them exactly as its own launch would: the same bits.
// - Which sums: the Workspace overload of bias_grad_from_partials and bias_grad_deferrable, that
//   is, the bias arguments of max_pool2d_2x2_backward (dbias), batchnorm_backward
//   (input_grad_sums), conv2d_backward_weight (dbias) and ConvOperands::column_sums, and
//   detail::relu_mask_bias_grad_deferrable (Linear's fused ReLU): parameters' gradients. Inside a
//   scope they are complete at its flush, not when the call returns. bias_grad,
//   relu_mask_bias_grad and the pointer overload never queue.
// - Who opens it: Module::backward_all, at a thread's outermost backward (an inner scope is
//   inactive and its sums go to the outer queue); it flushes before any module's backward hook
//   (the Reducer's bucket all-reduce reads the gradients; with a Reducer on every module, each
//   flush carries a module's sums or two) and at the outermost backward's end, so nothing outside
//   the backward sees a gradient before its sum.
// - Order: a second sum into a gradient already queued flushes the queue first, and so does a
//   launch that writes a queued gradient itself (a stream other than the queue's waits for that
//   flush); launches on other streams (backward-weight's side stream) are not queued.
// - Memory: the partials stay allocated until the flush (up to a few MB a layer at VGG's sizes).
class DeferredBiasGrads {
 public:
  // Active only as the thread's outermost scope and while detail::deferred_bias_grads() holds;
  // `stream` belongs to `device`.
  DeferredBiasGrads(int device, cudaStream_t stream);
  // Drops what was not flushed, freeing the workspaces on the stream: whoever opens a scope
  // flushes it before it ends (Module::backward_all does), so only an exception leaving the
  // backward, whose gradients are incomplete anyway, leaves sums behind.
  ~DeferredBiasGrads();
  DeferredBiasGrads(const DeferredBiasGrads&) = delete;
  DeferredBiasGrads& operator=(const DeferredBiasGrads&) = delete;
  bool active() const { return active_; }

 private:
  bool active_ = false;
};
// Runs the calling thread's queued sums, if any (one launch on the scope's stream).
void flush_deferred_bias_grads();

namespace detail {
// Whether DeferredBiasGrads scopes queue (on by default; bench_train --bias-final each turns it
// off to compare). Process-wide; read when a scope opens.
void set_deferred_bias_grads(bool on);
bool deferred_bias_grads();
// bias_grad for a parameter's gradient that nothing reads before the backward ends (Module's bias
// hand-off): its stage 2 may be queued (NOTE [Deferred bias gradients]). bias_grad itself never
// queues: its callers may read dbias in the next launch.
void bias_grad_deferrable(const float* dy, float* dbias, int64_t rows, int64_t cols, float beta,
                          cudaStream_t stream);
void bias_grad_deferrable(const __nv_bfloat16* dy, float* dbias, int64_t rows, int64_t cols,
                          float beta, cudaStream_t stream);
// relu_mask_bias_grad (T = M = float) for a parameter's gradient in the same way (Linear's fused
// ReLU): its stage 2 may be queued. With M = bf16 (T = float) the masked gradient is stored in
// bf16, rounded to nearest even as f32_to_bf16 rounds, for products that take bf16 operands
// (Linear under the bf16 policy: no conversion pass of its own), while dbias sums the fp32 masked
// values: the float form's bits. Outside an active scope it runs at once.
template <typename T, typename M>
void relu_mask_bias_grad_deferrable(const T* y, const T* dy, M* dy_masked, float* dbias,
                                    int64_t rows, int64_t cols, float beta, cudaStream_t stream);
// Flushes this thread's queue if it holds a sum into `dbias`, for a launch on `stream` about to
// write dbias itself, which must come after it (NOTE [Deferred bias gradients]); `stream` waits
// for the flush when it is not the queue's.
void flush_deferred_bias_grads_into(const float* dbias, cudaStream_t stream);
// The sums queued on this thread now (for the tests).
int deferred_bias_grads_queued();
// The checks of both ops and their references: rows, cols >= 0, no null pointer with data to touch.
void check_bias_args(const char* op, const void* matrix, const void* bias, int64_t rows,
                     int64_t cols);
// relu_mask_bias_grad's: y, dy and dy_masked as a matrix each; dbias may be null.
void check_relu_mask_args(const char* op, const void* y, const void* dy, const void* dy_masked,
                          const void* dbias, int64_t rows, int64_t cols);
}  // namespace detail

}  // namespace cudp::kernels
