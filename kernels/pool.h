// Max pooling and adaptive average pooling over NHWC activations (docs/architecture.md §2.2).
//
// The conventions are PyTorch's, so that a torchvision model behaves the same here:
// - Max pooling's output size is floor((H + 2*pad_h - kernel_h) / stride_h) + 1 (ceil_mode=False,
//   dilation 1), likewise along W. Padding counts as -inf, so a padded position is never the max.
//   As in PyTorch, pad must be at most half the kernel, which guarantees that every window holds at
//   least one real element.
// - indices[n, oh, ow, c] (int32, NHWC like y) is the position of the max inside the input plane of
//   (n, c): ih * W + iw. This is PyTorch's return_indices convention, so the two can be compared.
// - Ties: the first maximum in row-major window order wins (strict >), as in PyTorch. A NaN beats
//   every number and propagates; of several NaNs the last in window order gives the index
//   (PyTorch's test is `v > max || isnan(v)`, and so is ours).
// - Backward writes dx (=) everywhere: zero where no window took its max, and the sum over windows
//   where overlapping windows (3x3 stride 2) took the same element. It is a gather: each input
//   element visits the few windows that can contain it, in a fixed order. No atomics, so the result
//   is deterministic and does not depend on a zeroed dx.
// - Adaptive average pooling to (out_h, out_w) uses PyTorch's windows: output row i averages input
//   rows [floor(i*H/out_h), ceil((i+1)*H/out_h)), likewise for columns. Windows may overlap (H not
//   a multiple of out_h) or repeat rows (out_h > H, as torchvision's VGG head does with 1x1
//   features and AdaptiveAvgPool2d(7)); backward is a gather over the windows that contain each
//   input element.
//
// Fast paths: C % 4 == 0 with pointers aligned to 4 elements moves 4 channels at a time along C;
// the common VGG window (2x2, stride 2, no padding) has its own kernels, forward and backward.
// Everything else takes the general kernels. Both give identical results (same comparisons in the
// same order).
//
// The CPU references are templates instantiated for float and double (double lets the tests take
// finite differences in double); they accumulate in double and the backward ones scatter, an
// independent formulation from the GPU's gather. T is deduced from the first argument alone
// (std::type_identity_t elsewhere), so nullptr and literals of the other type are accepted.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

namespace cudp::kernels {

// Output size of max pooling along one dimension; throws ValueError naming the bad argument when
// kernel, stride or pad are out of range or the output would be empty.
int max_pool2d_output_size(int in, int kernel, int stride, int pad);

// x [n, h, w, c] -> y, indices [n, out_h, out_w, c] with out_h/out_w from max_pool2d_output_size.
void max_pool2d_forward(const float* x, float* y, int32_t* indices, int n, int h, int w, int c,
                        int kh, int kw, int stride_h, int stride_w, int pad_h, int pad_w,
                        cudaStream_t stream);
template <typename T>
void max_pool2d_forward_cpu(const T* x, std::type_identity_t<T>* y, int32_t* indices, int n, int h,
                            int w, int c, int kh, int kw, int stride_h, int stride_w, int pad_h,
                            int pad_w);

// bf16 activations (the bf16 precision policy): the same kernels, the comparisons in float (exact
// for bf16 values), so y and indices are what the float path gives on the same values. The CPU
// reference runs the float one on the widened values.
void max_pool2d_forward(const __nv_bfloat16* x, __nv_bfloat16* y, int32_t* indices, int n, int h,
                        int w, int c, int kh, int kw, int stride_h, int stride_w, int pad_h,
                        int pad_w, cudaStream_t stream);
void max_pool2d_forward_cpu(const __nv_bfloat16* x, __nv_bfloat16* y, int32_t* indices, int n,
                            int h, int w, int c, int kh, int kw, int stride_h, int stride_w,
                            int pad_h, int pad_w);

// dy, indices [n, out_h, out_w, c] -> dx [n, h, w, c] (=). Same geometry arguments as the forward.
void max_pool2d_backward(const float* dy, const int32_t* indices, float* dx, int n, int h, int w,
                         int c, int kh, int kw, int stride_h, int stride_w, int pad_h, int pad_w,
                         cudaStream_t stream);
template <typename T>
void max_pool2d_backward_cpu(const T* dy, const int32_t* indices, std::type_identity_t<T>* dx,
                             int n, int h, int w, int c, int kh, int kw, int stride_h, int stride_w,
                             int pad_h, int pad_w);

// 2x2 windows of stride 2 without padding (VGG's pooling) keep one byte per output instead of an
// int32 index: codes[n, oh, ow, c] (u8, NHWC like y). Bits 0-1 are the maximum's place in window
// order (0: row 0 col 0, 1: row 0 col 1, 2: row 1 col 0, 3: row 1 col 1), found with the
// comparisons above (the same element, NaNs and ties included); bit 2 is set where that maximum is
// <= 0 (not NaN). Backward reads the codes, not x: where x is a fused ReLU's output, bit 2 is the
// ReLU's mask at the only element that gets a gradient. So neither the pool nor the layer before
// keeps x for the backward (0.78 GB of VGG-16's bf16 activations at 224^2, batch 64; the codes are
// 0.1 GB). GPU; the CPU references derive the codes from the general forward's indices and scatter
// them back.
void max_pool2d_2x2_forward(const float* x, float* y, uint8_t* codes, int n, int h, int w, int c,
                            cudaStream_t stream);
void max_pool2d_2x2_forward(const __nv_bfloat16* x, __nv_bfloat16* y, uint8_t* codes, int n, int h,
                            int w, int c, cudaStream_t stream);
template <typename T>
void max_pool2d_2x2_forward_cpu(const T* x, std::type_identity_t<T>* y, uint8_t* codes, int n,
                                int h, int w, int c);

// dy, codes [n, out_h, out_w, c] -> dx [n, h, w, c] (=): dy at each window's maximum, 0 at its
// other elements and at an odd edge's elements, which no window covers. With `relu_mask` (x was the
// output of a fused ReLU) dx is also 0 where bit 2 is set: the ReLU's backward (kernels/
// elementwise.h's relu_grad), bit for bit, without a pass of its own. With `dbias` (C floats, or
// null) dbias[c] += the sum of dx's channel c over n, h and w, fp32, taken from the values the pass
// stores (the bias gradient of the layer whose output x is, Module's bias hand-off; bias_grad's sum
// in another order, deterministic); inside a Module's backward it is complete when the backward
// ends (kernels/bias.h, NOTE [Deferred bias gradients]).
void max_pool2d_2x2_backward(const float* dy, const uint8_t* codes, float* dx, int n, int h, int w,
                             int c, cudaStream_t stream, bool relu_mask = false,
                             float* dbias = nullptr);
void max_pool2d_2x2_backward(const __nv_bfloat16* dy, const uint8_t* codes, __nv_bfloat16* dx,
                             int n, int h, int w, int c, cudaStream_t stream,
                             bool relu_mask = false, float* dbias = nullptr);
template <typename T>
void max_pool2d_2x2_backward_cpu(const T* dy, const uint8_t* codes, std::type_identity_t<T>* dx,
                                 int n, int h, int w, int c, bool relu_mask = false);

// bf16: the gradients summed in float (double on the CPU) and rounded once to bf16; with windows
// that do not overlap (VGG's 2x2 stride 2) nothing is summed and dx holds dy's values exactly.
void max_pool2d_backward(const __nv_bfloat16* dy, const int32_t* indices, __nv_bfloat16* dx, int n,
                         int h, int w, int c, int kh, int kw, int stride_h, int stride_w, int pad_h,
                         int pad_w, cudaStream_t stream);
void max_pool2d_backward_cpu(const __nv_bfloat16* dy, const int32_t* indices, __nv_bfloat16* dx,
                             int n, int h, int w, int c, int kh, int kw, int stride_h, int stride_w,
                             int pad_h, int pad_w);

// x [n, h, w, c] -> y [n, out_h, out_w, c], each output the mean of its window.
void adaptive_avg_pool2d_forward(const float* x, float* y, int n, int h, int w, int c, int out_h,
                                 int out_w, cudaStream_t stream);
template <typename T>
void adaptive_avg_pool2d_forward_cpu(const T* x, std::type_identity_t<T>* y, int n, int h, int w,
                                     int c, int out_h, int out_w);

// dy [n, out_h, out_w, c] -> dx [n, h, w, c] (=).
void adaptive_avg_pool2d_backward(const float* dy, float* dx, int n, int h, int w, int c, int out_h,
                                  int out_w, cudaStream_t stream);
template <typename T>
void adaptive_avg_pool2d_backward_cpu(const T* dy, std::type_identity_t<T>* dx, int n, int h, int w,
                                      int c, int out_h, int out_w);

namespace detail {
// Argument checks shared by the launchers and the CPU references; throw ValueError naming the
// value.
void check_max_pool2d(int n, int h, int w, int c, int kh, int kw, int stride_h, int stride_w,
                      int pad_h, int pad_w);
void check_adaptive_avg_pool2d(int n, int h, int w, int c, int out_h, int out_w);
}  // namespace detail

}  // namespace cudp::kernels
