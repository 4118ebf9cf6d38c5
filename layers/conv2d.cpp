#include "layers/conv2d.h"

#include "kernels/bias.h"
#include "kernels/layout.h"

namespace cudp {

Conv2d::Conv2d(int in_channels, int out_channels, int kernel, int stride, int padding, bool bias,
               uint64_t seed)
    : Conv2d(init::skip_init, in_channels, out_channels, kernel, stride, padding, bias) {
  reset_parameters(seed);
}

Conv2d::Conv2d(init::SkipInit, int in_channels, int out_channels, int kernel, int stride,
               int padding, bool bias)
    : in_(in_channels), out_(out_channels), kernel_(kernel), stride_(stride), padding_(padding) {
  CUDP_CHECK(in_ > 0 && out_ > 0, "Conv2d: channels must be positive, got in ", in_, ", out ",
             out_);
  CUDP_CHECK(kernel_ > 0 && stride_ > 0 && padding_ >= 0, "Conv2d: invalid kernel ", kernel_,
             ", stride ", stride_, " or padding ", padding_);
  weight_ = &register_parameter("weight", Tensor::empty({out_, kernel_, kernel_, in_}));
  if (bias) {
    bias_ = &register_parameter("bias", Tensor::empty({out_}));
  }
}

void Conv2d::reset_parameters(uint64_t seed) {
  init::kaiming_normal_fan_out(weight_->data, int64_t{out_} * kernel_ * kernel_,
                               init::derive_seed(seed, "weight"));
  if (bias_) {
    bias_->data.zero_();
  }
}

Parameter& Conv2d::bias() {
  CUDP_CHECK(bias_ != nullptr, "Conv2d: built with bias=false, it has no bias");
  return *bias_;
}

kernels::Conv2dShape Conv2d::shape_for(const Tensor& input) const {
  CUDP_CHECK(input.dim() == 4 && input.size(3) == in_ && input.dtype() == DType::f32,
             "Conv2d: expected an NHWC f32 input [N, H, W, ", in_, "], got ", input.str());
  kernels::Conv2dShape s;
  s.n = static_cast<int>(input.size(0));
  s.h = static_cast<int>(input.size(1));
  s.w = static_cast<int>(input.size(2));
  s.c = in_;
  s.k = out_;
  s.r = s.s = kernel_;
  s.stride_h = s.stride_w = stride_;
  s.pad_h = s.pad_w = padding_;
  s.validate();
  return s;
}

Tensor Conv2d::forward_one(const Tensor& input) {
  const kernels::Conv2dShape s = shape_for(input);
  Tensor y = Tensor::empty({s.n, s.p(), s.q(), s.k}, DType::f32, device_);
  const float* x = input.data<float>();
  const float* w = weight_->data.data<float>();
  const float* b = bias_ ? bias_->data.data<float>() : nullptr;
  float* out = y.data<float>();
  // Under bf16 on the GPU the layer converts x itself and keeps the bf16 copy (not x) for the
  // weight gradient, so x is converted once per step, not twice.
  const bool keep_bf16 = device_.is_cuda() && precision_ == Precision::bf16;
  input_bf16_ = Tensor();
  run(
      [&] {
        const OperandView xr(x, s.x_size(), precision_), wr(w, s.w_size(), precision_);
        kernels::conv2d_forward_cpu(s, xr.get(), wr.get(), b, out, /*relu=*/false);
      },
      [&](cudaStream_t stream) {
        kernels::Bf16Operands converted;
        if (keep_bf16) {
          input_bf16_ = Tensor::empty({s.n, s.h, s.w, kernels::bf16_channels(s.c)}, DType::bf16,
                                      device_);
          kernels::conv2d_to_bf16(x, int64_t{s.n} * s.h * s.w, s.c, input_bf16_.data_ptr(),
                                  stream);
          converted.x = input_bf16_.data_ptr();
        }
        kernels::conv2d_forward(s, x, w, b, out, false, stream, math(), converted);
      });
  input_ = keep_bf16 ? Tensor() : input;
  saved_shape_ = s;
  return y;
}

Tensor Conv2d::backward_one(const Tensor& grad_output) {
  const kernels::Conv2dShape& s = saved_shape_;
  check_shape(grad_output, {s.n, s.p(), s.q(), s.k}, "Conv2d: grad_output");
  CUDP_CHECK(precision_ != Precision::tf32,
             "Conv2d: backward under the tf32 precision policy is not available: the weight "
             "gradient has no TF32 tensor-core kernel yet; train with bf16 or fp32 "
             "(set_precision(Precision::bf16)), tf32 serves forward passes");
  Tensor dx = Tensor::empty({s.n, s.h, s.w, s.c}, DType::f32, device_);
  const float* x = input_.defined() ? input_.data<float>() : nullptr;
  const float* dy = grad_output.data<float>();
  const float* w = weight_->data.data<float>();
  float* dw = weight_->grad.data<float>();
  float* db = bias_ ? bias_->grad.data<float>() : nullptr;
  float* out = dx.data<float>();
  const int64_t rows = s.y_size() / s.k;
  run(
      [&] {
        const OperandView xr(x, s.x_size(), precision_), wr(w, s.w_size(), precision_);
        const OperandView dyr(dy, s.y_size(), precision_);
        kernels::conv2d_backward_data_cpu(s, dyr.get(), wr.get(), out);
        kernels::conv2d_backward_weight_cpu(s, xr.get(), dyr.get(), dw, /*beta=*/1.0f);
        if (db) {
          kernels::bias_grad_cpu(dy, db, rows, s.k, /*beta=*/1.0f);
        }
      },
      [&](cudaStream_t stream) {
        // bf16: dy converted once for both products, x from the forward's copy.
        kernels::Bf16Operands converted;
        Tensor dy_bf16;
        if (input_bf16_.defined()) {
          dy_bf16 = Tensor::empty({s.n, s.p(), s.q(), kernels::bf16_channels(s.k)}, DType::bf16,
                                  device_);
          kernels::conv2d_to_bf16(dy, rows, s.k, dy_bf16.data_ptr(), stream);
          converted = {input_bf16_.data_ptr(), dy_bf16.data_ptr()};
        }
        kernels::conv2d_backward_data(s, dy, w, out, stream, math(), converted);
        kernels::conv2d_backward_weight(s, x, dy, dw, 1.0f, stream, math(), converted);
        if (db) {
          kernels::bias_grad(dy, db, rows, s.k, 1.0f, stream);
        }
      });
  return dx;
}

std::shared_ptr<Module> Conv2d::make_empty_copy() const {
  auto copy = std::make_shared<Conv2d>(init::skip_init, in_, out_, kernel_, stride_, padding_,
                                       bias_ != nullptr);
  return copy;
}

// The weight goes out as OIHW [out, in, kh, kw] and comes in from it; the bias is the same in both.
Shape Conv2d::export_shape(const std::string& local_name, const Shape& internal) const {
  if (local_name != "weight") {
    return internal;
  }
  return {out_, in_, kernel_, kernel_};
}

Tensor Conv2d::export_tensor(const std::string& local_name, const Tensor& internal) const {
  if (local_name != "weight") {
    return internal;
  }
  const Tensor krsc = internal.cpu();
  Tensor oihw = Tensor::empty(export_shape(local_name, internal.shape()));
  kernels::krsc_to_oihw_cpu(krsc.data<float>(), oihw.data<float>(), out_, in_, kernel_, kernel_);
  return oihw;
}

Tensor Conv2d::import_tensor(const std::string& local_name, const Tensor& pytorch) const {
  if (local_name != "weight") {
    return pytorch;
  }
  const Tensor oihw = pytorch.cpu();
  Tensor krsc = Tensor::empty({out_, kernel_, kernel_, in_});
  kernels::oihw_to_krsc_cpu(oihw.data<float>(), krsc.data<float>(), out_, in_, kernel_, kernel_);
  return krsc;
}

}  // namespace cudp
