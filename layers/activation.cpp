#include "layers/activation.h"

#include "kernels/elementwise.h"

namespace cudp {

Tensor ReLU::forward_one(const Tensor& input) {
  CUDP_CHECK(input.dtype() == DType::f32, "ReLU: input must be f32, got ", input.str());
  Tensor y = inplace_ ? input : Tensor::empty(input.shape(), DType::f32, device_);
  const float* x = input.data<float>();
  float* out = y.data<float>();
  const int64_t n = input.numel();
  run([&] { kernels::relu_forward_cpu(x, out, n); },
      [&](cudaStream_t s) { kernels::relu_forward(x, out, n, s); });
  output_ = y;
  return y;
}

Tensor ReLU::backward_one(const Tensor& grad_output) {
  check_shape(grad_output, output_.shape(), "ReLU: grad_output");
  Tensor dx = inplace_ ? grad_output : Tensor::empty(grad_output.shape(), DType::f32, device_);
  const float* y = output_.data<float>();
  const float* dy = grad_output.data<float>();
  float* out = dx.data<float>();
  const int64_t n = dx.numel();
  run([&] { kernels::relu_backward_cpu(y, dy, out, n); },
      [&](cudaStream_t s) { kernels::relu_backward(y, dy, out, n, s); });
  return dx;
}

std::shared_ptr<Module> ReLU::make_empty_copy() const {
  return std::make_shared<ReLU>(inplace_);
}

}  // namespace cudp
