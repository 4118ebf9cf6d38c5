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

  // fp32 with FMA math by default; the tensor-core benchmarks pass CUDNN_DATA_BFLOAT16 or
  // CUDNN_DATA_FLOAT with CUDNN_TENSOR_OP_MATH (fp32 accumulation either way).
  explicit CudnnConv2dDescriptors(const kernels::Conv2dShape& s,
                                  cudnnDataType_t data = CUDNN_DATA_FLOAT,
                                  cudnnMathType_t math = CUDNN_FMA_MATH) {
    CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&x));
    CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&y));
    CUDP_CUDNN_CHECK(cudnnCreateFilterDescriptor(&w));
    CUDP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&conv));
    CUDP_CUDNN_CHECK(
        cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NHWC, data, s.n, s.c, s.h, s.w));
    CUDP_CUDNN_CHECK(
        cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NHWC, data, s.n, s.k, s.p(), s.q()));
    CUDP_CUDNN_CHECK(
        cudnnSetFilter4dDescriptor(w, data, CUDNN_TENSOR_NHWC, s.k, s.c, s.r, s.s));
    CUDP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(conv, s.pad_h, s.pad_w, s.stride_h, s.stride_w,
                                                     1, 1, CUDNN_CROSS_CORRELATION,
                                                     CUDNN_DATA_FLOAT));
    CUDP_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, math));
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
