#include "layers/activation.h"

#include "kernels/elementwise.h"

namespace cudp {

Tensor ReLU::forward_one(const Tensor& input) {
  CUDP_CHECK(input.dtype() == DType::f32 || input.dtype() == DType::bf16,
             "ReLU: input must be f32 or bf16, got ", input.str());
  Tensor y = inplace_ ? input : Tensor::empty(input.shape(), input.dtype(), device_);
  const int64_t n = input.numel();
  auto relu = [&]<typename T>(const T* x, T* out) {
    run([&] { kernels::relu_forward_cpu(x, out, n); },
        [&](cudaStream_t s) { kernels::relu_forward(x, out, n, s); });
  };
  if (input.dtype() == DType::bf16) {
    relu(input.data<__nv_bfloat16>(), y.data<__nv_bfloat16>());
  } else {
    relu(input.data<float>(), y.data<float>());
  }
  output_ = y;
  return y;
}

Tensor ReLU::backward_one(const Tensor& grad_output) {
  check_shape(grad_output, output_.shape(), "ReLU: grad_output");
  CUDP_CHECK(grad_output.dtype() == output_.dtype(), "ReLU: grad_output is ", grad_output.str(),
             " but the output was ", dtype_name(output_.dtype()),
             "; a gradient has its value's dtype");
  Tensor dx =
      inplace_ ? grad_output : Tensor::empty(grad_output.shape(), grad_output.dtype(), device_);
  const int64_t n = dx.numel();
  auto relu = [&]<typename T>(const T* y, const T* dy, T* out) {
    run([&] { kernels::relu_backward_cpu(y, dy, out, n); },
        [&](cudaStream_t s) { kernels::relu_backward(y, dy, out, n, s); });
  };
  if (output_.dtype() == DType::bf16) {
    relu(output_.data<__nv_bfloat16>(), grad_output.data<__nv_bfloat16>(),
         dx.data<__nv_bfloat16>());
  } else {
    relu(output_.data<float>(), grad_output.data<float>(), dx.data<float>());
  }
  return dx;
}

std::string ReLU::extra_repr() const {
  return inplace_ ? "inplace=True" : "";
}

std::shared_ptr<Module> ReLU::make_empty_copy() const {
  return std::make_shared<ReLU>(inplace_);
}

}  // namespace cudp
