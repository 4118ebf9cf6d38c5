// The forward and backward-weight convolutions of layers with one 16-byte chunk of input channels
// (8 bf16 or 4 fp32, padded) and 64 output channels, VGG's first layer, on tensor cores without the
// GEMM mainloop (kernels/conv2d_narrow.cu says why). kernels/conv2d_tc.cu dispatches to them;
// nothing else should call them.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/conv2d.h"

namespace cudp::kernels::detail {

// Whether the bf16 kernels below take paired taps for `shape` when x's channels past
// `live_channels` are zeros: C = 8 padded from 1 to 4 live channels, a 3 x 3 filter.
bool narrow_paired_taps(const Conv2dShape& shape, int live_channels);

// Whether conv2d_forward_narrow takes this forward: bf16 x (C = 8) and filters, or TF32 (fp32 x
// with C = 4 and filters), K = 64, R and S at most 3, stride 1, no mask, 16-byte aligned x, w and
// y (bf16 or fp32 y).
bool narrow_forward_applies(const Conv2dShape& shape, const ConvOperands& ops);

// y = relu?(conv(x, w) + bias), the same epilogue arithmetic as the mainloop's. Throws ValueError
// where narrow_forward_applies does not hold. bf16 3 x 3 filters with ops.live_channels of 1 to 4
// (x's and w's channels past it zeros: the layer's padding) take paired taps, three k steps
// instead of five.
void conv2d_forward_narrow(const Conv2dShape& shape, const ConvOperands& ops, cudaStream_t stream);

// Whether conv2d_backward_weight_narrow takes this backward-weight: bf16 x (C = 8) and dy (K = 64),
// R and S at most 3, stride 1, 16-byte aligned x and dy.
bool narrow_wgrad_applies(const Conv2dShape& shape, const void* x, const void* dy);

// dw (fp32, K x R x S x 8) = beta * dw + dy^T (*) x; beta 0 does not read dw. Deterministic (one
// partial per block, summed in a fixed order). Throws ValueError where narrow_wgrad_applies does
// not hold. With `live_channels` of 1 to 4 (x's channels past it zeros) and a 3 x 3 filter, paired
// taps; dw's channels past 4 are then written as zeros, which they are.
void conv2d_backward_weight_narrow(const Conv2dShape& shape, const void* x, const void* dy,
                                   float* dw, float beta, cudaStream_t stream,
                                   int live_channels = 0);

// The same in TF32 (fp32 operands, as the float launcher's Math::TF32): x of at most 4 channels as
// it is (no padded copy), dy with K = 64 (16-byte aligned); dw is K x R x S x C.
bool narrow_wgrad_tf32_applies(const Conv2dShape& shape, const float* dy);
void conv2d_backward_weight_narrow_tf32(const Conv2dShape& shape, const float* x, const float* dy,
                                        float* dw, float beta, cudaStream_t stream);

}  // namespace cudp::kernels::detail
