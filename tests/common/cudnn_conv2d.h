// cuDNN's descriptors of one convolution on our layouts, for the tests and the benchmark that
// compare kernels/conv2d.h with cuDNN: NHWC tensors, KRSC filters (filter format
// CUDNN_TENSOR_NHWC), cross-correlation, fp32 with CUDNN_FMA_MATH (no TF32). Header-only, so that
// bench/ can include it as "tests/common/cudnn_conv2d.h".
#pragma once

#include "engine/core/vendor_check.h"
#include "kernels/conv2d.h"

namespace cudp::testing {

struct CudnnConv2dDescriptors {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;

  explicit CudnnConv2dDescriptors(const kernels::Conv2dShape& s) {
    CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&x));
    CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&y));
    CUDP_CUDNN_CHECK(cudnnCreateFilterDescriptor(&w));
    CUDP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&conv));
    CUDP_CUDNN_CHECK(
        cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT, s.n, s.c, s.h, s.w));
    CUDP_CUDNN_CHECK(
        cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT, s.n, s.k, s.p(), s.q()));
    CUDP_CUDNN_CHECK(
        cudnnSetFilter4dDescriptor(w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NHWC, s.k, s.c, s.r, s.s));
    CUDP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(conv, s.pad_h, s.pad_w, s.stride_h, s.stride_w,
                                                     1, 1, CUDNN_CROSS_CORRELATION,
                                                     CUDNN_DATA_FLOAT));
    CUDP_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, CUDNN_FMA_MATH));
  }
  ~CudnnConv2dDescriptors() {
    cudnnDestroyConvolutionDescriptor(conv);
    cudnnDestroyFilterDescriptor(w);
    cudnnDestroyTensorDescriptor(y);
    cudnnDestroyTensorDescriptor(x);
  }
  CudnnConv2dDescriptors(const CudnnConv2dDescriptors&) = delete;
  CudnnConv2dDescriptors& operator=(const CudnnConv2dDescriptors&) = delete;
};

}  // namespace cudp::testing
