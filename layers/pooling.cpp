#include "layers/pooling.h"

#include <limits>

#include "kernels/elementwise.h"
#include "kernels/pool.h"

namespace cudp {

namespace {

// [N, H, W, C] as the ints the pool kernels take; names the layer in errors.
struct Nhwc {
  int n, h, w, c;
};

Nhwc nhwc_of(const Tensor& t, const char* layer, bool bf16_ok = false) {
  CUDP_CHECK(t.dim() == 4 && (t.dtype() == DType::f32 || (bf16_ok && t.dtype() == DType::bf16)),
             layer, ": expected an NHWC ", bf16_ok ? "f32 or bf16" : "f32", " input ",
             "[N, H, W, C], got ", t.str());
  for (int64_t d : t.shape()) {
    CUDP_CHECK(d <= std::numeric_limits<int>::max(), layer, ": dimension ", d, " of ", t.str(),
               " is too large");
  }
  return {static_cast<int>(t.size(0)), static_cast<int>(t.size(1)), static_cast<int>(t.size(2)),
          static_cast<int>(t.size(3))};
}

}  // namespace

// ---- MaxPool2d ----------------------------------------------------------------------------------

MaxPool2d::MaxPool2d(int kernel, int stride, int padding)
    : kernel_(kernel), stride_(stride), padding_(padding) {
  CUDP_CHECK(kernel_ > 0 && stride_ > 0 && padding_ >= 0 && 2 * padding_ <= kernel_,
             "MaxPool2d: invalid kernel ", kernel_, ", stride ", stride_, " or padding ", padding_,
             " (padding must be at most half the kernel)");
}

Tensor MaxPool2d::forward_one(const Tensor& input) {
  const Nhwc s = nhwc_of(input, "MaxPool2d", /*bf16_ok=*/true);
  const int p = kernels::max_pool2d_output_size(s.h, kernel_, stride_, padding_);
  const int q = kernels::max_pool2d_output_size(s.w, kernel_, stride_, padding_);
  Tensor y = Tensor::empty({s.n, p, q, s.c}, input.dtype(), device_);
  // 2x2 windows of stride 2 on the GPU keep one byte per output, which says where the maximum was
  // and whether it was <= 0 (kernels/pool.h), instead of int32 indices.
  const bool codes = device_.is_cuda() && kernel_ == 2 && stride_ == 2 && padding_ == 0;
  // The ReLU mask of a fused layer before (Module's hand-off): free where the codes carry it, and
  // after the reference on the CPU (which then keeps the input).
  input_grad_masked_ = mask_requested_ && (codes || device_.is_cpu());
  Tensor saved = Tensor::empty({s.n, p, q, s.c}, codes ? DType::u8 : DType::i32, device_);
  int32_t* idx = codes ? nullptr : saved.data<int32_t>();
  uint8_t* code = codes ? saved.data<uint8_t>() : nullptr;
  const int k = kernel_, st = stride_, pad = padding_;
  auto pool = [&]<typename T>(const T* x, T* out) {
    run(
        [&] {
          kernels::max_pool2d_forward_cpu(x, out, idx, s.n, s.h, s.w, s.c, k, k, st, st, pad, pad);
        },
        [&](cudaStream_t stream) {
          if (codes) {
            kernels::max_pool2d_2x2_forward(x, out, code, s.n, s.h, s.w, s.c, stream);
          } else {
            kernels::max_pool2d_forward(x, out, idx, s.n, s.h, s.w, s.c, k, k, st, st, pad, pad,
                                        stream);
          }
        });
  };
  if (input.dtype() == DType::bf16) {
    pool(input.data<__nv_bfloat16>(), y.data<__nv_bfloat16>());
  } else {
    pool(input.data<float>(), y.data<float>());
  }
  input_shape_ = input.shape();
  input_dtype_ = input.dtype();
  output_shape_ = y.shape();
  argmax_ = saved;
  input_ = input_grad_masked_ && device_.is_cpu() ? input : Tensor();
  return y;
}

Tensor MaxPool2d::backward_one(const Tensor& grad_output) {
  check_shape(grad_output, output_shape_, "MaxPool2d: grad_output");
  CUDP_CHECK(grad_output.dtype() == input_dtype_, "MaxPool2d: grad_output is ", grad_output.str(),
             " but the forward's output was ", dtype_name(input_dtype_),
             "; a gradient has its value's dtype");
  Tensor dx = Tensor::empty(input_shape_, input_dtype_, device_);
  const Nhwc s = nhwc_of(dx, "MaxPool2d", /*bf16_ok=*/true);
  const bool codes = argmax_.dtype() == DType::u8;
  const int32_t* idx = codes ? nullptr : argmax_.data<int32_t>();
  const uint8_t* code = codes ? argmax_.data<uint8_t>() : nullptr;
  const int k = kernel_, st = stride_, pad = padding_;
  auto pool = [&]<typename T>(const T* dy, const T* x, T* out) {
    run(
        [&] {
          kernels::max_pool2d_backward_cpu(dy, idx, out, s.n, s.h, s.w, s.c, k, k, st, st, pad,
                                           pad);
          if (input_grad_masked_) kernels::relu_backward_cpu(x, out, out, dx.numel());
        },
        [&](cudaStream_t stream) {
          if (codes) {
            // The bias hand-off (Module): the column sums of dx on the way, where asked.
            kernels::max_pool2d_2x2_backward(dy, code, out, s.n, s.h, s.w, s.c, stream,
                                             input_grad_masked_, grad_sums_into_);
            input_grad_summed_ = grad_sums_into_ != nullptr;
          } else {
            kernels::max_pool2d_backward(dy, idx, out, s.n, s.h, s.w, s.c, k, k, st, st, pad, pad,
                                         stream);
          }
        });
  };
  if (input_dtype_ == DType::bf16) {
    pool(grad_output.data<__nv_bfloat16>(),
         input_.defined() ? input_.data<__nv_bfloat16>() : nullptr, dx.data<__nv_bfloat16>());
  } else {
    pool(grad_output.data<float>(), input_.defined() ? input_.data<float>() : nullptr,
         dx.data<float>());
  }
  return dx;
}

std::string MaxPool2d::extra_repr() const {
  return detail::str("kernel_size=", kernel_, ", stride=", stride_, ", padding=", padding_,
                     ", dilation=1, ceil_mode=False");
}

std::shared_ptr<Module> MaxPool2d::make_empty_copy() const {
  return std::make_shared<MaxPool2d>(kernel_, stride_, padding_);
}

// ---- AdaptiveAvgPool2d --------------------------------------------------------------------------

AdaptiveAvgPool2d::AdaptiveAvgPool2d(int out_h, int out_w) : out_h_(out_h), out_w_(out_w) {
  CUDP_CHECK(out_h_ > 0 && out_w_ > 0, "AdaptiveAvgPool2d: output size must be positive, got ",
             out_h_, " x ", out_w_);
}

Tensor AdaptiveAvgPool2d::forward_one(const Tensor& input) {
  const Nhwc s = nhwc_of(input, "AdaptiveAvgPool2d");
  input_shape_ = input.shape();
  if (s.h == out_h_ && s.w == out_w_) {
    return input;
  }
  Tensor y = Tensor::empty({s.n, out_h_, out_w_, s.c}, DType::f32, device_);
  const float* x = input.data<float>();
  float* out = y.data<float>();
  const int oh = out_h_, ow = out_w_;
  run([&] { kernels::adaptive_avg_pool2d_forward_cpu(x, out, s.n, s.h, s.w, s.c, oh, ow); },
      [&](cudaStream_t stream) {
        kernels::adaptive_avg_pool2d_forward(x, out, s.n, s.h, s.w, s.c, oh, ow, stream);
      });
  return y;
}

Tensor AdaptiveAvgPool2d::backward_one(const Tensor& grad_output) {
  const Shape expected = {input_shape_[0], out_h_, out_w_, input_shape_[3]};
  check_shape(grad_output, expected, "AdaptiveAvgPool2d: grad_output");
  if (expected == input_shape_) {
    return grad_output;
  }
  Tensor dx = Tensor::empty(input_shape_, DType::f32, device_);
  const Nhwc s = nhwc_of(dx, "AdaptiveAvgPool2d");
  const float* dy = grad_output.data<float>();
  float* out = dx.data<float>();
  const int oh = out_h_, ow = out_w_;
  run([&] { kernels::adaptive_avg_pool2d_backward_cpu(dy, out, s.n, s.h, s.w, s.c, oh, ow); },
      [&](cudaStream_t stream) {
        kernels::adaptive_avg_pool2d_backward(dy, out, s.n, s.h, s.w, s.c, oh, ow, stream);
      });
  return dx;
}

std::string AdaptiveAvgPool2d::extra_repr() const {
  if (one_size_) return detail::str("output_size=", out_h_);
  return detail::str("output_size=(", out_h_, ", ", out_w_, ")");
}

std::shared_ptr<Module> AdaptiveAvgPool2d::make_empty_copy() const {
  auto copy = std::make_shared<AdaptiveAvgPool2d>(out_h_, out_w_);
  copy->one_size_ = one_size_;
  return copy;
}

}  // namespace cudp
