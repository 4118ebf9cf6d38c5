#include "layers/conv2d.h"

#include <optional>
#include <vector>

#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "kernels/bias.h"
#include "kernels/conv2d_dense.h"
#include "kernels/elementwise.h"
#include "kernels/layout.h"
#include "kernels/matmul.h"
#include "kernels/workspace.h"

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
  weight_->backward_writes_grad = true;  // NOTE [Deferred zeroing] (layers/module.h)
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
  refresh_compute_copies();  // a flattened bf16 model's copies follow (layers/module.h)
}

Parameter& Conv2d::bias() {
  CUDP_CHECK(bias_ != nullptr, "Conv2d: built with bias=false, it has no bias");
  return *bias_;
}

kernels::Conv2dShape Conv2d::shape_for(const Tensor& input) const {
  const bool dtype_ok =
      input.dtype() == DType::f32 || (takes_bf16() && input.dtype() == DType::bf16);
  CUDP_CHECK(input.dim() == 4 && input.size(3) == in_ && dtype_ok, "Conv2d: expected an NHWC ",
             takes_bf16() ? "f32 or bf16" : "f32", " input [N, H, W, ", in_, "], got ",
             input.str());
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

namespace {

// The pass over a fused-ReLU layer's output gradient before its products: dym = dy masked by
// y > 0 with the bias gradient taken from it (y not null), or the bias gradient alone (the mask
// done already, or no ReLU). On the GPU when `stream` is given, else the CPU references.
template <typename T>
void output_grad_pass(const T* y, const T* dy, T* dym, float* db, int64_t rows, int k,
                      std::optional<cudaStream_t> stream) {
  if (y != nullptr) {
    if (stream) {
      kernels::relu_mask_bias_grad(y, dy, dym, db, rows, k, 1.0f, *stream);
    } else {
      kernels::relu_mask_bias_grad_cpu(y, dy, dym, db, rows, k, 1.0f);
    }
  } else if (db != nullptr) {
    if (stream) {
      kernels::bias_grad(dy, db, rows, k, 1.0f, *stream);
    } else {
      kernels::bias_grad_cpu(dy, db, rows, k, 1.0f);
    }
  }
}

// The backward of the ReLU before the layer on the CPU, in place: the ReLU module's own
// (kernels::relu_backward_cpu, x being that ReLU's output).
void relu_mask_cpu(const Tensor& x, Tensor& dx) {
  CUDP_CHECK(x.dtype() == dx.dtype() && x.numel() == dx.numel(),
             "Conv2d: the input mask and dx differ: ", x.str(), " and ", dx.str());
  if (dx.dtype() == DType::bf16) {
    auto* d = dx.data<__nv_bfloat16>();
    kernels::relu_backward_cpu(x.data<__nv_bfloat16>(), d, d, dx.numel());
  } else {
    kernels::relu_backward_cpu(x.data<float>(), dx.data<float>(), dx.data<float>(), dx.numel());
  }
}

}  // namespace

float* Conv2d::output_grad_sums_target() {
  // dy arrives as the next layer wrote it: without a fused ReLU (a BatchNorm after the
  // convolution), or with its mask done there. A fused ReLU masked here needs its own pass anyway.
  const bool dy_as_written = !last_relu_fused_ || output_grad_masked_;
  return device_.is_cuda() && bias_ != nullptr && dy_as_written ? bias_->grad.data<float>()
                                                                : nullptr;
}

Tensor Conv2d::forward_one(const Tensor& input) {
  const kernels::Conv2dShape s = shape_for(input);
  saved_shape_ = s;
  input_dtype_ = input.dtype();
  ran_dense_2x2_ = false;
  // The ReLU mask of the layer before: done in backward-data's epilogue on the tensor cores (bf16
  // with whole 16-byte chunks of channels; tf32 at stride 1 with C and K multiples of 4: 16-byte
  // rows of dy, dx and the mask for the typed TF32 call), or after the CPU reference.
  const bool tc_dgrad =
      (precision_ == Precision::bf16 && input.dtype() == DType::bf16 &&
       kernels::bf16_channels(s.c) == s.c && kernels::bf16_channels(s.k) == s.k) ||
      (precision_ == Precision::tf32 && s.c % 4 == 0 && s.k % 4 == 0 && s.stride_h == 1 &&
       s.stride_w == 1);
  input_grad_masked_ = mask_requested_ && input_grad_ && (device_.is_cpu() || tc_dgrad);
  if (precision_ == Precision::bf16) {
    return forward_bf16(input, s);
  }
  const bool relu = relu_fused_;
  Tensor y = Tensor::empty({s.n, s.p(), s.q(), s.k}, DType::f32, device_);
  const float* x = input.data<float>();
  const float* w = weight_->data.data<float>();
  const float* b = bias_ ? bias_->data.data<float>() : nullptr;
  float* out = y.data<float>();
  // The CPU path sees the operands as the policy's products do (tf32: truncated, OperandView).
  run(
      [&] {
        const OperandView xr(x, input.numel(), precision_),
            wr(w, weight_->data.numel(), precision_);
        kernels::conv2d_forward_cpu(s, xr.get(), wr.get(), b, out, relu);
      },
      [&](cudaStream_t stream) { kernels::conv2d_forward(s, x, w, b, out, relu, stream, math()); });
  input_ = input;
  input_bf16_ = weight_bf16_ = weight_rot_bf16_ = weight_eff_bf16_ = Tensor();
  keep_fused_relu_output(y);
  return y;
}

Tensor Conv2d::backward_one(const Tensor& grad_output) {
  const kernels::Conv2dShape& s = saved_shape_;
  check_shape(grad_output, {s.n, s.p(), s.q(), s.k}, "Conv2d: grad_output");
  if (precision_ == Precision::bf16) {
    return backward_bf16(grad_output);
  }
  CUDP_CHECK(grad_output.dtype() == DType::f32, "Conv2d: grad_output is ", grad_output.str(),
             " but the output was f32; a gradient has its value's dtype");
  // A fused ReLU: dy masked by y > 0 (bit for bit the ReLU module's backward) in the pass that
  // takes the bias gradient, unless the next layer did it (output_grad_masked_); both products
  // then read the masked dy.
  const Tensor* relu_y = fused_relu_mask();
  const bool relu = relu_y != nullptr;
  Tensor dym = relu ? Tensor::empty(grad_output.shape(), DType::f32, device_) : grad_output;
  Tensor dx = input_grad_ ? Tensor::empty({s.n, s.h, s.w, s.c}, DType::f32, device_) : Tensor();
  const float* x = input_.data<float>();
  const float* dy = dym.data<float>();
  const float* w = weight_->data.data<float>();
  float* dw = weight_->grad.data<float>();
  const float dw_beta = weight_->grad_beta();  // 0: written, not added (Deferred zeroing)
  // Not when the layer after the ReLU added it up already (the bias hand-off, Module).
  float* db = bias_ && !output_grad_summed_ ? bias_->grad.data<float>() : nullptr;
  float* out = input_grad_ ? dx.data<float>() : nullptr;
  const int64_t rows = s.y_size() / s.k;
  // fp32 and tf32. On the GPU math() picks the SIMT kernels (fp32) or the tensor cores (tf32: fp32
  // operands truncated to TF32 by the MMA, fp32 accumulation) for both products; the bias gradient
  // is a reduction of dy, fp32 under either. The CPU path runs the fp32 references on the operands
  // as the products see them (OperandView: truncated under tf32, layers/precision.h); the bias
  // gradient takes dy as it is.
  run(
      [&] {
        output_grad_pass(relu ? relu_y->data<float>() : nullptr, grad_output.data<float>(),
                         dym.data<float>(), db, rows, s.k, std::nullopt);
        const OperandView dyr(dy, dym.numel(), precision_);
        if (out) {
          const OperandView wr(w, weight_->data.numel(), precision_);
          kernels::conv2d_backward_data_cpu(s, dyr.get(), wr.get(), out);
          if (input_grad_masked_) relu_mask_cpu(input_, dx);
        }
        const OperandView xr(x, input_.numel(), precision_);
        kernels::conv2d_backward_weight_cpu(s, xr.get(), dyr.get(), dw, dw_beta);
      },
      [&](cudaStream_t stream) {
        // The bias gradient in the mask's pass where there is one, else with backward-weight.
        if (relu) {
          output_grad_pass(relu_y->data<float>(), grad_output.data<float>(), dym.data<float>(), db,
                           rows, s.k, stream);
        }
        // Backward-weight beside backward-data when both run (detail::concurrent_weight_grad).
        cuda::SideStream side(device_.index, stream, cuda::SideStream::if_free,
                              out && detail::concurrent_weight_grad(rows));
        if (out && input_grad_masked_) {
          // tf32 (forward_one's tc_dgrad): the ReLU before this layer masked in backward-data's
          // epilogue (its output, this layer's input, is the mask), and the bias hand-off's
          // column sums of the masked dx taken on the way (Module, which declines them where
          // the input came in bf16).
          kernels::ConvOperands ops{kernels::Math::TF32, dy,      w,    out,
                                    kernels::DType::F32, nullptr, false};
          ops.mask = x;
          ops.column_sums = grad_sums_into_;
          input_grad_summed_ = ops.column_sums != nullptr;
          kernels::conv2d_backward_data_tc(s, ops, stream);
        } else if (out) {
          kernels::conv2d_backward_data(s, dy, w, out, stream, math());
        }
        kernels::conv2d_backward_weight(s, x, dy, dw, dw_beta, side.get(), math(), {},
                                        relu ? nullptr : db);
        side.join();
      });
  weight_->grad_written();
  return dx;
}

namespace {

// The values of a CPU tensor as floats: bf16 widened (exact), f32 rounded to bf16 when `round` (the
// bf16 policy's operand rounding, what the GPU's conversion does).
std::vector<float> cpu_operand(const Tensor& t, bool round) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::bf16) {
    kernels::bf16_to_f32_cpu(t.data<__nv_bfloat16>(), v.data(), t.numel());
    return v;
  }
  const OperandView view(t.data<float>(), t.numel(), round ? Precision::bf16 : Precision::fp32);
  std::copy(view.get(), view.get() + t.numel(), v.begin());
  return v;
}

// A CPU tensor of `dtype` holding `values` (rounded to nearest even for bf16).
Tensor cpu_tensor(const std::vector<float>& values, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  if (dtype == DType::bf16) {
    kernels::f32_to_bf16_cpu(values.data(), t.data<__nv_bfloat16>(), t.numel());
  } else {
    std::copy(values.begin(), values.end(), t.data<float>());
  }
  return t;
}

// One of the dense 2x2 form's bf16 products: C (m x n, row stride n) = A B^T, A stored m x k (or
// k x m when a_kn) and B stored n x k (or k x n when b_kn), rows without gaps (kernels/matmul.h).
kernels::MatmulProblem dense_product(int64_t m, int64_t n, int64_t k, const void* a, bool a_kn,
                                     const void* b, bool b_kn, void* c, kernels::DType c_type) {
  kernels::MatmulProblem p;
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.math = kernels::Math::BF16;
  p.a = a;
  p.lda = a_kn ? m : k;
  p.a_transposed = a_kn;
  p.b = b;
  p.ldb = b_kn ? n : k;
  p.b_transposed = b_kn;
  p.c = c;
  p.ldc = n;
  p.c_type = c_type;
  return p;
}

// B of such a product read as W_eff's view of the bf16 filters (K x 3 x 3 x C) as they are
// (MatmulProblem::b_dense_k) instead of a gathered W_eff.
void read_filters_as_w_eff(kernels::MatmulProblem& p, const kernels::Conv2dShape& s) {
  p.ldb = 9 * int64_t{s.c};
  p.b_dense_k = s.k;
  p.b_dense_c = s.c;
}

}  // namespace

// The bf16 filters the tensor-core products read (K x R x S x C padded to 8 channels), and with
// `rotate` backward-data's rotated copy (C x R x S x K) from the same pass: the parameter store's
// copy, which the optimizer wrote with the master weights (layers/module.h), where it serves as it
// is (no padding, no rotation); else made from the fp32 filters here, kept until the backward.
void Conv2d::bf16_filters(const kernels::Conv2dShape& s, bool rotate, cudaStream_t stream) {
  const int cp = kernels::bf16_channels(s.c);
  if (weight_->compute.defined() && cp == s.c && !rotate) {
    weight_bf16_ = weight_->compute;
    weight_rot_bf16_ = Tensor();
    return;
  }
  std::optional<cuda::AllocationPurpose> purpose;
  purpose.emplace(detail::str("Conv2d(", in_, ", ", out_, ")'s bf16 copies of its filters"),
                  "Under bf16 the layer makes them at each forward (and the rotated filters for a "
                  "training backward) and keeps them until the backward: reduce the batch size "
                  "(--batch-size) to leave room for them.");
  weight_bf16_ = Tensor::empty({s.k, s.r, s.s, cp}, DType::bf16, device_);
  weight_rot_bf16_ = rotate ? Tensor::empty({s.c, s.r, s.s, s.k}, DType::bf16, device_) : Tensor();
  purpose.reset();
  kernels::conv2d_filters_to_bf16(weight_->data.data<float>(), s, weight_bf16_.data_ptr(),
                                  rotate ? weight_rot_bf16_.data_ptr() : nullptr, stream);
}

// bf16 storage: y is bf16, rounded once from the fp32 accumulator after the bias and the fused
// ReLU. On the GPU x is used as it comes when it is bf16 with channels a multiple of 8 (every VGG
// layer but the first), else converted once and the copy kept for backward-weight; the weights are
// converted once per step and the copy kept for backward-data.
Tensor Conv2d::forward_bf16(const Tensor& input, const kernels::Conv2dShape& s) {
  Tensor y = Tensor::empty({s.n, s.p(), s.q(), s.k}, DType::bf16, device_);
  const float* b = bias_ ? bias_->data.data<float>() : nullptr;
  const bool relu = relu_fused_;
  if (device_.is_cpu()) {
    const std::vector<float> x = cpu_operand(input, true), w = cpu_operand(weight_->data, true);
    std::vector<float> out(static_cast<size_t>(s.y_size()));
    kernels::conv2d_forward_cpu(s, x.data(), w.data(), b, out.data(), relu);
    kernels::f32_to_bf16_cpu(out.data(), y.data<__nv_bfloat16>(), s.y_size());
    input_ = input;
    input_bf16_ = weight_bf16_ = weight_rot_bf16_ = weight_eff_bf16_ = Tensor();
  } else {
    input_ = Tensor();
    weight_eff_bf16_ = Tensor();
    run([] {},
        [&](cudaStream_t stream) {
          const int cp = kernels::bf16_channels(s.c);
          const int64_t pixels = int64_t{s.n} * s.h * s.w;
          if (input.dtype() == DType::bf16 && cp == s.c) {
            input_bf16_ = input;
          } else {
            input_bf16_ = Tensor::empty({s.n, s.h, s.w, cp}, DType::bf16, device_);
            if (input.dtype() == DType::bf16) {
              kernels::conv2d_pad_bf16(input.data_ptr(), pixels, s.c, input_bf16_.data_ptr(),
                                       stream);
            } else {
              kernels::conv2d_to_bf16(input.data<float>(), pixels, s.c, input_bf16_.data_ptr(),
                                      stream);
            }
          }
          if (kernels::detail::conv_dense_2x2() && kernels::conv2d_dense_2x2_applies(s)) {
            forward_dense_2x2(s, y, stream);
            return;
          }
          // The rotated filters of backward-data come from the same pass, when a backward that
          // runs it on tensor cores will follow (training, an input gradient wanted, stride 1, no
          // channel padding) and does not read these filters as they are (K a multiple of 64,
          // every VGG layer's backward-data: kernels/conv2d.h).
          const bool rotate = training_ && input_grad_ && cp == s.c &&
                              kernels::bf16_channels(s.k) == s.k && s.stride_h == 1 &&
                              s.stride_w == 1 && s.pad_h <= s.r - 1 && s.pad_w <= s.s - 1 &&
                              !kernels::conv2d_backward_data_reads_filters_as_they_are(s);
          bf16_filters(s, rotate, stream);
          kernels::Conv2dShape padded = s;
          padded.c = cp;
          kernels::ConvOperands ops{kernels::Math::BF16,
                                    input_bf16_.data_ptr(),
                                    weight_bf16_.data_ptr(),
                                    y.data_ptr(),
                                    kernels::DType::BF16,
                                    b,
                                    relu};
          ops.live_channels = s.c;  // the channels past it are the padding's zeros
          kernels::conv2d_forward_tc(padded, ops, stream);
        });
  }
  keep_fused_relu_output(y);
  return y;
}

// The gradient of a bf16 output is bf16. Fused ReLU: dy masked by y > 0 and the bias gradient taken
// in one pass; then backward-data (dx in the input's dtype) and backward-weight (fp32, accumulated)
// on the masked bf16 dy.
Tensor Conv2d::backward_bf16(const Tensor& grad_output) {
  const kernels::Conv2dShape& s = saved_shape_;
  CUDP_CHECK(grad_output.dtype() == DType::bf16, "Conv2d: grad_output is ", grad_output.str(),
             " but the output was bf16 (the bf16 precision policy); a gradient has its value's "
             "dtype");
  const Tensor* relu_y = fused_relu_mask();
  const bool relu = relu_y != nullptr;
  const int64_t rows = s.y_size() / s.k;
  float* dw = weight_->grad.data<float>();
  const float dw_beta = weight_->grad_beta();  // 0: written, not added (Deferred zeroing)
  // Not when the layer after the ReLU added it up already (the bias hand-off, Module).
  float* db = bias_ && !output_grad_summed_ ? bias_->grad.data<float>() : nullptr;
  Tensor dym = relu ? Tensor::empty(grad_output.shape(), DType::bf16, device_) : grad_output;
  Tensor dx = input_grad_ ? Tensor::empty({s.n, s.h, s.w, s.c}, input_dtype_, device_) : Tensor();
  if (device_.is_cpu()) {
    output_grad_pass(relu ? relu_y->data<__nv_bfloat16>() : nullptr,
                     grad_output.data<__nv_bfloat16>(), dym.data<__nv_bfloat16>(), db, rows, s.k,
                     std::nullopt);
    const std::vector<float> g = cpu_operand(dym, true), x = cpu_operand(input_, true),
                             w = cpu_operand(weight_->data, true);
    kernels::conv2d_backward_weight_cpu(s, x.data(), g.data(), dw, dw_beta);
    weight_->grad_written();
    if (!input_grad_) return dx;
    std::vector<float> out(static_cast<size_t>(s.x_size()));
    kernels::conv2d_backward_data_cpu(s, g.data(), w.data(), out.data());
    Tensor dxt = cpu_tensor(out, dx.shape(), input_dtype_);
    if (input_grad_masked_) relu_mask_cpu(input_, dxt);
    return dxt;
  }
  run([] {},
      [&](cudaStream_t stream) {
        // The bias gradient in the mask's pass where there is one, else taken by backward-weight
        // from the dy tiles it loads (no pass of its own; kernels/conv2d.h).
        if (relu) {
          output_grad_pass(relu_y->data<__nv_bfloat16>(), grad_output.data<__nv_bfloat16>(),
                           dym.data<__nv_bfloat16>(), db, rows, s.k, stream);
        }
        if (ran_dense_2x2_) {  // the forward took the dense 2x2 form
          backward_dense_2x2(dym, dx, relu ? nullptr : db, stream);
          return;
        }
        const int cp = kernels::bf16_channels(s.c), kp = kernels::bf16_channels(s.k);
        Tensor dyp = dym;
        if (kp != s.k) {
          dyp = Tensor::empty({s.n, s.p(), s.q(), kp}, DType::bf16, device_);
          kernels::conv2d_pad_bf16(dym.data_ptr(), rows, s.k, dyp.data_ptr(), stream);
        }
        const kernels::Bf16Operands converted{input_bf16_.data_ptr(), dyp.data_ptr()};
        // Backward-weight beside backward-data when both run (detail::concurrent_weight_grad).
        cuda::SideStream side(device_.index, stream, cuda::SideStream::if_free,
                              input_grad_ && detail::concurrent_weight_grad(rows));
        if (!input_grad_) {
          // The model's input needs no gradient: backward-data is skipped.
        } else if (cp == s.c && kp == s.k) {
          const bool rotated = weight_rot_bf16_.defined();
          kernels::ConvOperands ops{
              kernels::Math::BF16,
              dyp.data_ptr(),
              rotated ? weight_rot_bf16_.data_ptr() : weight_bf16_.data_ptr(),
              dx.data_ptr(),
              input_dtype_ == DType::bf16 ? kernels::DType::BF16 : kernels::DType::F32,
              nullptr,
              false};
          // The ReLU before this layer: its mask in the epilogue (input_bf16_ is the input).
          ops.mask = input_grad_masked_ ? input_bf16_.data_ptr() : nullptr;
          // The bias hand-off (Module): the column sums of dx, the layer before's bias gradient,
          // in the epilogue.
          ops.column_sums = input_grad_masked_ ? grad_sums_into_ : nullptr;
          input_grad_summed_ = ops.column_sums != nullptr;
          if (rotated) {
            kernels::conv2d_backward_data_tc_rotated(s, ops, stream);
          } else {
            kernels::conv2d_backward_data_tc(s, ops, stream);
          }
        } else {
          // Padded channels (VGG's first layer): the float launcher, fp32 dx of C channels.
          Tensor dxf = input_dtype_ == DType::f32
                           ? dx
                           : Tensor::empty({s.n, s.h, s.w, s.c}, DType::f32, device_);
          kernels::conv2d_backward_data(s, nullptr, weight_->data.data<float>(), dxf.data<float>(),
                                        stream, kernels::Math::BF16, converted);
          if (input_dtype_ == DType::bf16) {
            kernels::f32_to_bf16(dxf.data<float>(), dx.data<__nv_bfloat16>(), dx.numel(), stream);
          }
        }
        kernels::conv2d_backward_weight(s, nullptr, nullptr, dw, dw_beta, side.get(),
                                        kernels::Math::BF16, converted, relu ? nullptr : db);
        side.join();
      });
  weight_->grad_written();
  return dx;
}

// The dense form (kernels/conv2d_dense.h): y = x W_eff^T + bias_eff with the fused ReLU, one
// product on the NHWC tensors as they are. W_eff is read as a view of the bf16 filters (the
// parameter store's copy where there is one, else the fp32 filters rounded by a pass) and the
// bias by period K where the view applies (K a multiple of 256, C of 64); else W_eff and bias_eff
// are gathered. Either stays for backward-data.
void Conv2d::forward_dense_2x2(const kernels::Conv2dShape& s, Tensor& y, cudaStream_t stream) {
  const int64_t outputs = 4 * int64_t{s.k}, inputs = 4 * int64_t{s.c};  // features per image
  const bool view =
      kernels::detail::conv_dense_2x2_view() && kernels::conv2d_dense_2x2_view_applies(s);
  weight_bf16_ = weight_rot_bf16_ = weight_eff_bf16_ = Tensor();
  ran_dense_2x2_ = true;
  const float* b = bias_ ? bias_->data.data<float>() : nullptr;
  Tensor bias_eff;  // read by the product alone (its stream-ordered free follows the launch)
  kernels::MatmulProblem p;
  if (view) {
    bf16_filters(s, false, stream);  // C is a multiple of 64: no padding
    p = dense_product(s.n, outputs, inputs, input_bf16_.data_ptr(), false, weight_bf16_.data_ptr(),
                      false, y.data_ptr(), kernels::DType::BF16);
    read_filters_as_w_eff(p, s);
    p.bias = b;
    p.bias_period = b ? s.k : 0;
  } else {
    {
      const cuda::AllocationPurpose purpose(
          detail::str("Conv2d(", in_, ", ", out_, ")'s dense 2x2 filters"),
          "Under bf16 a 3x3 layer on a 2x2 image makes them (bf16) at each forward and keeps them "
          "until the backward: reduce the batch size (--batch-size) to leave room for them.");
      weight_eff_bf16_ = Tensor::empty({outputs, inputs}, DType::bf16, device_);
      if (bias_) bias_eff = Tensor::empty({outputs}, DType::f32, device_);
    }
    float* b_eff = bias_ ? bias_eff.data<float>() : nullptr;
    auto* w_eff = weight_eff_bf16_.data<__nv_bfloat16>();
    if (weight_->compute.defined()) {
      kernels::conv2d_dense_2x2_filters(weight_->compute.data<__nv_bfloat16>(), s, w_eff, b, b_eff,
                                        stream);
    } else {
      kernels::conv2d_dense_2x2_filters(weight_->data.data<float>(), s, w_eff, b, b_eff, stream);
    }
    p = dense_product(s.n, outputs, inputs, input_bf16_.data_ptr(), false, w_eff, false,
                      y.data_ptr(), kernels::DType::BF16);
    p.bias = b_eff;
  }
  p.relu = relu_fused_;
  kernels::detail::conv_dense_2x2_matmul(p, stream);
}

// dx = dy W_eff (the ReLU before this layer masked in the epilogue when asked; no column sums: the
// layer before takes its bias gradient itself, input_grad_summed_ stays false), and beside it
// dW_eff = dy^T x into an fp32 workspace, folded into dW; db (the bias gradient when no mask pass
// took it) by a column sum of dy, whose last launch may be queued.
void Conv2d::backward_dense_2x2(const Tensor& dy, const Tensor& dx, float* db,
                                cudaStream_t stream) {
  const kernels::Conv2dShape& s = saved_shape_;
  const int64_t outputs = 4 * int64_t{s.k}, inputs = 4 * int64_t{s.c};
  cuda::SideStream side(device_.index, stream, cuda::SideStream::if_free,
                        dx.defined() && detail::concurrent_weight_grad(4 * int64_t{s.n}));
  if (dx.defined()) {
    const bool view = !weight_eff_bf16_.defined();  // W_eff as a view of the bf16 filters
    kernels::MatmulProblem p = dense_product(
        s.n, inputs, outputs, dy.data_ptr(), false,
        view ? weight_bf16_.data_ptr() : weight_eff_bf16_.data_ptr(), true, dx.data_ptr(),
        input_dtype_ == DType::bf16 ? kernels::DType::BF16 : kernels::DType::F32);
    if (view) read_filters_as_w_eff(p, s);
    p.mask = input_grad_masked_ ? input_bf16_.data_ptr() : nullptr;
    kernels::detail::conv_dense_2x2_matmul(p, stream);
  }
  if (db != nullptr) {
    kernels::detail::bias_grad_deferrable(dy.data<__nv_bfloat16>(), db, 4 * int64_t{s.n}, s.k, 1.f,
                                          stream);
  }
  {
    kernels::Workspace dw_eff(static_cast<size_t>(outputs * inputs) * sizeof(float), side.get(),
                              "the dense 2x2 layer's weight gradient before its fold");
    kernels::matmul(dense_product(outputs, inputs, s.n, dy.data_ptr(), true, input_bf16_.data_ptr(),
                                  true, dw_eff.get(), kernels::DType::F32),
                    side.get());
    kernels::conv2d_dense_2x2_fold(dw_eff.get(), s, weight_->grad.data<float>(),
                                   weight_->grad_beta(), side.get());
  }
  side.join();
}

std::string Conv2d::extra_repr() const {
  std::string text = detail::str(in_, ", ", out_, ", kernel_size=(", kernel_, ", ", kernel_,
                                 "), stride=(", stride_, ", ", stride_, ")");
  if (padding_ != 0) text += detail::str(", padding=(", padding_, ", ", padding_, ")");
  if (bias_ == nullptr) text += ", bias=False";
  return text;
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
