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

}  // namespace

Tensor Flatten::forward_one(const Tensor& input) {
  CUDP_CHECK((input.dim() == 4 || input.dim() == 2) && input.dtype() == DType::f32,
             "Flatten: expected an NHWC f32 input [N, H, W, C] (or an already flat [N, F]), got ",
             input.str());
  input_shape_ = input.shape();
  const int64_t n = input.size(0);
  if (already_flat(input_shape_)) {
    return input.view({n, features_of(input_shape_)});
  }
  const int64_t h = input.size(1), w = input.size(2), c = input.size(3);
  Tensor y = Tensor::empty({n, c * h * w}, DType::f32, device_);
  const float* x = input.data<float>();
  float* out = y.data<float>();
  run([&] { kernels::nhwc_to_nchw_cpu(x, out, n, c, h, w); },
      [&](cudaStream_t s) { kernels::nhwc_to_nchw(x, out, n, c, h, w, s); });
  return y;
}

Tensor Flatten::backward_one(const Tensor& grad_output) {
  const int64_t n = input_shape_[0];
  check_shape(grad_output, {n, features_of(input_shape_)}, "Flatten: grad_output");
  if (already_flat(input_shape_)) {
    return grad_output.view(input_shape_);
  }
  const int64_t h = input_shape_[1], w = input_shape_[2], c = input_shape_[3];
  Tensor dx = Tensor::empty(input_shape_, DType::f32, device_);
  const float* dy = grad_output.data<float>();
  float* out = dx.data<float>();
  run([&] { kernels::nchw_to_nhwc_cpu(dy, out, n, c, h, w); },
      [&](cudaStream_t s) { kernels::nchw_to_nhwc(dy, out, n, c, h, w, s); });
  return dx;
}

std::string Flatten::extra_repr() const {
  return "start_dim=1, end_dim=-1";
}

std::shared_ptr<Module> Flatten::make_empty_copy() const {
  return std::make_shared<Flatten>();
}

}  // namespace cudp
