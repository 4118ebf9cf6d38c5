#include "layers/linear.h"

#include <limits>

#include "kernels/bias.h"
#include "kernels/gemm.h"

namespace cudp {

namespace {

// The GEMM launchers take int extents.
int gemm_extent(int64_t n, const char* what) {
  CUDP_CHECK(n <= std::numeric_limits<int>::max(), "Linear: ", what, " = ", n,
             " is too large for one GEMM");
  return static_cast<int>(n);
}

}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, uint64_t seed)
    : Linear(init::skip_init, in_features, out_features, bias) {
  reset_parameters(seed);
}

Linear::Linear(init::SkipInit, int64_t in_features, int64_t out_features, bool bias)
    : in_(in_features), out_(out_features) {
  CUDP_CHECK(in_ > 0 && out_ > 0, "Linear: features must be positive, got in ", in_, ", out ",
             out_);
  gemm_extent(in_, "in_features");
  gemm_extent(out_, "out_features");
  weight_ = &register_parameter("weight", Tensor::empty({out_, in_}));
  if (bias) {
    bias_ = &register_parameter("bias", Tensor::empty({out_}));
  }
}

void Linear::reset_parameters(uint64_t seed) {
  weight_->data.normal_(0.0f, 0.01f, init::derive_seed(seed, "weight"));
  if (bias_) {
    bias_->data.zero_();
  }
}

Parameter& Linear::bias() {
  CUDP_CHECK(bias_ != nullptr, "Linear: built with bias=false, it has no bias");
  return *bias_;
}

Tensor Linear::forward_one(const Tensor& input) {
  CUDP_CHECK(input.dim() >= 1 && input.size(-1) == in_ && input.dtype() == DType::f32,
             "Linear: expected an f32 input [*, ", in_, "], got ", input.str());
  Shape out_shape = input.shape();
  out_shape.back() = out_;
  Tensor y = Tensor::empty(out_shape, DType::f32, device_);
  const int rows = gemm_extent(input.numel() / in_, "the number of rows");
  const int n = static_cast<int>(out_), k = static_cast<int>(in_);
  const float* x = input.data<float>();
  const float* w = weight_->data.data<float>();
  const float* b = bias_ ? bias_->data.data<float>() : nullptr;
  float* out = y.data<float>();
  run(
      [&] {
        const OperandView xr(x, int64_t{rows} * k, precision_), wr(w, int64_t{n} * k, precision_);
        kernels::gemm_cpu(false, true, rows, n, k, 1.0f, xr.get(), k, wr.get(), k, 0.0f, out, n);
        if (b) {
          kernels::bias_add_cpu(out, b, rows, n);
        }
      },
      [&](cudaStream_t s) {
        kernels::gemm(false, true, rows, n, k, 1.0f, x, k, w, k, 0.0f, out, n, s, math());
        if (b) {
          kernels::bias_add(out, b, rows, n, s);
        }
      });
  input_ = input;
  return y;
}

Tensor Linear::backward_one(const Tensor& grad_output) {
  Shape expected = input_.shape();
  expected.back() = out_;
  check_shape(grad_output, expected, "Linear: grad_output");
  Tensor dx = Tensor::empty(input_.shape(), DType::f32, device_);
  const int rows = static_cast<int>(input_.numel() / in_);
  const int n = static_cast<int>(out_), k = static_cast<int>(in_);
  const float* x = input_.data<float>();
  const float* dy = grad_output.data<float>();
  const float* w = weight_->data.data<float>();
  float* dw = weight_->grad.data<float>();
  float* db = bias_ ? bias_->grad.data<float>() : nullptr;
  float* out = dx.data<float>();
  run(
      [&] {
        const OperandView xr(x, int64_t{rows} * k, precision_), wr(w, int64_t{n} * k, precision_);
        const OperandView dyr(dy, int64_t{rows} * n, precision_);
        kernels::gemm_cpu(false, false, rows, k, n, 1.0f, dyr.get(), n, wr.get(), k, 0.0f, out, k);
        kernels::gemm_cpu(true, false, n, k, rows, 1.0f, dyr.get(), n, xr.get(), k, 1.0f, dw, k);
        if (db) {
          kernels::bias_grad_cpu(dy, db, rows, n, 1.0f);
        }
      },
      [&](cudaStream_t s) {
        kernels::gemm(false, false, rows, k, n, 1.0f, dy, n, w, k, 0.0f, out, k, s, math());
        kernels::gemm(true, false, n, k, rows, 1.0f, dy, n, x, k, 1.0f, dw, k, s, math());
        if (db) {
          kernels::bias_grad(dy, db, rows, n, 1.0f, s);
        }
      });
  return dx;
}

std::shared_ptr<Module> Linear::make_empty_copy() const {
  auto copy = std::make_shared<Linear>(init::skip_init, in_, out_, bias_ != nullptr);
  return copy;
}

}  // namespace cudp
