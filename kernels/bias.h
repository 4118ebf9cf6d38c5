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

// dbias[c] = beta * dbias[c] + sum_g partial[g * cols + c], the chunks g added in a fixed order:
// bias_grad's stage 2, for a kernel that leaves partial column sums on its way (the bf16
// backward-weight, kernels/conv2d.h). partial is chunks x cols fp32, chunks >= 1.
void bias_grad_from_partials(const float* partial, float* dbias, int64_t chunks, int64_t cols,
                             float beta, cudaStream_t stream);

namespace detail {
// The checks of both ops and their references: rows, cols >= 0, no null pointer with data to touch.
void check_bias_args(const char* op, const void* matrix, const void* bias, int64_t rows,
                     int64_t cols);
// relu_mask_bias_grad's: y, dy and dy_masked as a matrix each; dbias may be null.
void check_relu_mask_args(const char* op, const void* y, const void* dy, const void* dy_masked,
                          const void* dbias, int64_t rows, int64_t cols);
}  // namespace detail

}  // namespace cudp::kernels
