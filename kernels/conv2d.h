// 2-D convolution (cross-correlation, as PyTorch's Conv2d), fp32, forward and both backward passes.
//
// Layouts (DESIGN.md §2.2): activations x, y, dx, dy are NHWC; weights w, dw are KRSC (K output
// channels, an R x S filter, C input channels), so one output channel's filter is R*S*C contiguous
// floats. PyTorch's OIHW checkpoints are converted at load time, not here.
//
// Each pass is an implicit GEMM (kernels/conv2d.cu explains the tiling):
//   forward          y  = x (*) w      M = N*P*Q  GEMM-N = K  reduction = R*S*C
//   backward_data    dx = dy (*) w^T   M = N*H*W  GEMM-N = C  reduction = R*S*K
//   backward_weight  dw = dy^T (*) x   M = K      GEMM-N = R*S*C  reduction = N*P*Q
// Activation gradients are written (dx =), parameter gradients accumulate when asked (dw = beta*dw
// + grad), following DESIGN.md §2.1. The bias gradient is a reduction of dy and lives with the bias
// kernels, not here.
//
// Every launcher validates the shape and throws ValueError before touching the GPU. Results are
// deterministic: no atomics, and a split reduction is summed in a fixed order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common.h"

namespace cudp::kernels {

struct Conv2dShape {
  int n = 0, h = 0, w = 0, c = 0;  // input: batch, height, width, channels
  int k = 0, r = 0, s = 0;         // filters: output channels, height, width
  int stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;

  // Output height and width: (h + 2*pad_h - r)/stride_h + 1 and likewise.
  int p() const;
  int q() const;

  // Throws ValueError naming the first bad field: sizes and strides must be positive, pads
  // non-negative, the output at least 1 x 1, and the GEMM extents must fit in int.
  void validate() const;

  int64_t x_size() const { return int64_t(n) * h * w * c; }
  int64_t w_size() const { return int64_t(k) * r * s * c; }
  int64_t y_size() const { return int64_t(n) * p() * q() * k; }
  // Multiply-adds times two, the same for each of the three passes.
  double flops() const { return 2.0 * double(n) * p() * q() * k * r * s * c; }
};

// y = relu?(conv(x, w) + bias). bias (K floats) may be null; relu applies max(., 0) after the bias.
void conv2d_forward(const Conv2dShape& shape, const float* x, const float* w, const float* bias,
                    float* y, bool relu, cudaStream_t stream, Math math = Math::FP32);
void conv2d_forward_cpu(const Conv2dShape& shape, const float* x, const float* w, const float* bias,
                        float* y, bool relu);

// dx = d(sum y*dy)/dx, written (not accumulated).
void conv2d_backward_data(const Conv2dShape& shape, const float* dy, const float* w, float* dx,
                          cudaStream_t stream, Math math = Math::FP32);
void conv2d_backward_data_cpu(const Conv2dShape& shape, const float* dy, const float* w, float* dx);

// dw = beta*dw + d(sum y*dy)/dw. beta = 1 accumulates parameter gradients; beta = 0 overwrites dw
// without reading it (so dw may hold garbage, even NaN).
void conv2d_backward_weight(const Conv2dShape& shape, const float* x, const float* dy, float* dw,
                            float beta, cudaStream_t stream, Math math = Math::FP32);
void conv2d_backward_weight_cpu(const Conv2dShape& shape, const float* x, const float* dy,
                                float* dw, float beta);

}  // namespace cudp::kernels
