#include "layers/flatten.h"

#include "kernels/layout.h"

namespace cudp {

namespace {

// Whether the NHWC -> NCHW transpose is a no-op for this input (2-D, or 1x1 spatial).
bool already_flat(const Shape& s) {
  return s.size() == 2 || (s[1] == 1 && s[2] == 1);
}

// Features per sample: the product of every dimension after the batch.
int64_t features_of(const Shape& s) {
  return shape_numel(Shape(s.begin() + 1, s.end()));
}

// The transpose in the input's dtype: f32, or bf16 under the bf16 policy (the elements moved as
// they are, so Flatten changes no value and the Linear after it takes the bf16 activations).
template <bool kToNchw>
Tensor transposed(const Tensor& x, const Shape& out_shape, int64_t n, int64_t c, int64_t h,
                  int64_t w) {
  Tensor y = Tensor::empty(out_shape, x.dtype(), x.device());
  const auto go = [&](const auto* src, auto* dst) {
    on_device(
        x.device(),
        [&] {
          if constexpr (kToNchw) {
            kernels::nhwc_to_nchw_cpu(src, dst, n, c, h, w);
          } else {
            kernels::nchw_to_nhwc_cpu(src, dst, n, c, h, w);
          }
        },
        [&](cudaStream_t s) {
          if constexpr (kToNchw) {
            kernels::nhwc_to_nchw(src, dst, n, c, h, w, s);
          } else {
            kernels::nchw_to_nhwc(src, dst, n, c, h, w, s);
          }
        });
  };
  if (x.dtype() == DType::bf16) {
    go(x.data<__nv_bfloat16>(), y.data<__nv_bfloat16>());
  } else {
    go(x.data<float>(), y.data<float>());
  }
  return y;
}

}  // namespace

Tensor Flatten::forward_one(const Tensor& input) {
  CUDP_CHECK(
      (input.dim() == 4 || input.dim() == 2) &&
          (input.dtype() == DType::f32 || input.dtype() == DType::bf16),
      "Flatten: expected an NHWC f32 or bf16 input [N, H, W, C] (or an already flat [N, F]), "
      "got ",
      input.str());
  input_shape_ = input.shape();
  input_dtype_ = input.dtype();
  const int64_t n = input.size(0);
  if (already_flat(input_shape_)) {
    return input.view({n, features_of(input_shape_)});
  }
  const int64_t h = input.size(1), w = input.size(2), c = input.size(3);
  return transposed<true>(input, {n, c * h * w}, n, c, h, w);
}

Tensor Flatten::backward_one(const Tensor& grad_output) {
  const int64_t n = input_shape_[0];
  check_shape(grad_output, {n, features_of(input_shape_)}, "Flatten: grad_output");
  CUDP_CHECK(grad_output.dtype() == input_dtype_, "Flatten: grad_output is ", grad_output.str(),
             " but the input was ", dtype_name(input_dtype_), "; a gradient has its value's dtype");
  if (already_flat(input_shape_)) {
    return grad_output.view(input_shape_);
  }
  const int64_t h = input_shape_[1], w = input_shape_[2], c = input_shape_[3];
  return transposed<false>(grad_output, input_shape_, n, c, h, w);
}

std::string Flatten::extra_repr() const {
  return "start_dim=1, end_dim=-1";
}

std::shared_ptr<Module> Flatten::make_empty_copy() const {
  return std::make_shared<Flatten>();
}

}  // namespace cudp
