#include "layers/linear.h"

#include <limits>

#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "kernels/bias.h"
#include "kernels/conv2d.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/layout.h"
#include "kernels/matmul.h"

namespace cudp {

namespace {

constexpr const char* kBf16Advice =
    "Under bf16 the layer makes it at each forward and keeps it until the backward: reduce the "
    "batch size (--batch-size) to leave room for it.";

// The GEMM launchers take int extents.
int gemm_extent(int64_t n, const char* what) {
  CUDP_CHECK(n <= std::numeric_limits<int>::max(), "Linear: ", what, " = ", n,
             " is too large for one GEMM");
  return static_cast<int>(n);
}

// The layouts of bf16_product's operands: a (m x k) and b (n x k) row-major, c = a b^T (forward);
// b stored k x n, c = a b (backward-data reads the weight as it is); both stored k-major-last,
// c += a^T b (backward-weight reads dy and x as they are).
enum class Operands { kForward, kBStoredKN, kBothStoredK };

// c (m x n, row-major, of c_type) = the product of bf16 row-major a and b on tensor cores, laid
// out as `operands` says, (+ bias) (+ beta c: the weight gradient's accumulation) (max 0: a fused
// ReLU).
// `lda`: a's row stride when its rows are padded (0: m or k, as stored without padding).
void bf16_product(int m, int n, int k, const Tensor& a, const Tensor& b, void* c,
                  kernels::DType c_type, const float* bias, cudaStream_t stream,
                  Operands operands = Operands::kForward, float beta = 0.f, bool relu = false,
                  int64_t lda = 0) {
  const bool a_t = operands == Operands::kBothStoredK;
  const bool b_t = operands != Operands::kForward;
  kernels::MatmulProblem p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.math = kernels::Math::BF16;
  p.a = a.data_ptr();
  p.lda = lda > 0 ? lda : a_t ? m : k;
  p.a_transposed = a_t;
  p.b = b.data_ptr();
  p.ldb = b_t ? n : k;
  p.b_transposed = b_t;
  p.beta = beta;
  p.c = c;
  p.ldc = n;
  p.c_type = c_type;
  p.bias = bias;
  p.relu = relu;
  kernels::matmul(p, stream);
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
  weight_->backward_writes_grad = true;  // NOTE [Deferred zeroing] (layers/module.h)
  if (bias) {
    bias_ = &register_parameter("bias", Tensor::empty({out_}));
    bias_->backward_writes_grad = true;
  }
}

void Linear::reset_parameters(uint64_t seed) {
  weight_->data.normal_(0.0f, 0.01f, init::derive_seed(seed, "weight"));
  if (bias_) {
    bias_->data.zero_();
  }
  refresh_compute_copies();  // a flattened bf16 model's copies follow (layers/module.h)
}

Parameter& Linear::bias() {
  CUDP_CHECK(bias_ != nullptr, "Linear: built with bias=false, it has no bias");
  return *bias_;
}

// Under bf16 on the GPU the products whose operands TMA can read as they are (rows of 16 bytes)
// run on bf16 copies made once per forward: x as it comes (or converted), W, and dy converted
// once in backward (by the fused ReLU's mask pass where there is one; with its rows padded to a
// multiple of 8 where out_features is not one). Each product reads them as they are stored
// (kernels/matmul.h): forward y = x W^T (+ bias in the epilogue), backward-data dx = dy W (W as B
// stored k x n: no W^T copy), backward-weight dW += dy^T x (both stored k x m / k x n). Layers
// whose in_features is not a multiple of 8 take the float launchers, which round the same operands
// the same way.
bool Linear::direct_bf16(int64_t k) const {
  return device_.is_cuda() && precision_ == Precision::bf16 && k % 8 == 0;
}

Tensor Linear::forward_one(const Tensor& input) {
  const bool dtype_ok =
      input.dtype() == DType::f32 || (takes_bf16() && input.dtype() == DType::bf16);
  CUDP_CHECK(input.dim() >= 1 && input.size(-1) == in_ && dtype_ok, "Linear: expected an ",
             takes_bf16() ? "f32 or bf16" : "f32", " input [*, ", in_, "], got ", input.str());
  Shape out_shape = input.shape();
  out_shape.back() = out_;
  Tensor y = Tensor::empty(out_shape, DType::f32, device_);
  const int rows = gemm_extent(input.numel() / in_, "the number of rows");
  const int n = static_cast<int>(out_), k = static_cast<int>(in_);
  const float* b = bias_ ? bias_->data.data<float>() : nullptr;
  float* out = y.data<float>();
  input_dtype_ = input.dtype();
  weight_bf16_ = input_bf16_ = Tensor();
  const bool relu = relu_fused_;
  keep_fused_relu_output(y);
  if (direct_bf16(in_)) {
    run([] {},
        [&](cudaStream_t s) {
          input_bf16_ = convert(input, DType::bf16);
          if (weight_->compute.defined()) {
            // The parameter store's copy, which the optimizer wrote with the master weight
            // (layers/module.h): no pass here.
            weight_bf16_ = weight_->compute;
          } else {
            {
              const cuda::AllocationPurpose purpose(
                  detail::str("Linear(", in_, ", ", out_, ")'s bf16 copy of its weight"),
                  kBf16Advice);
              weight_bf16_ = Tensor::empty({out_, in_}, DType::bf16, device_);
            }
            kernels::f32_to_bf16(weight_->data.data<float>(), weight_bf16_.data<__nv_bfloat16>(),
                                 out_ * in_, s);
          }
          bf16_product(rows, n, k, input_bf16_, weight_bf16_, out, kernels::DType::F32, b, s,
                       Operands::kForward, 0.f, relu);
        });
    // Backward reads the bf16 copy (dy's rows padded where out_features is not a multiple of 8).
    input_ = Tensor();
    return y;
  }
  input_ = convert(input, DType::f32);  // bf16 values widened exactly
  const float* x = input_.data<float>();
  const float* w = weight_->data.data<float>();
  run(
      [&] {
        const OperandView xr(x, int64_t{rows} * k, precision_), wr(w, int64_t{n} * k, precision_);
        kernels::gemm_cpu(false, true, rows, n, k, 1.0f, xr.get(), k, wr.get(), k, 0.0f, out, n);
        if (b) {
          kernels::bias_add_cpu(out, b, rows, n);
        }
        if (relu) kernels::relu_forward_cpu(out, out, int64_t{rows} * n);
      },
      [&](cudaStream_t s) {
        kernels::gemm(false, true, rows, n, k, 1.0f, x, k, w, k, 0.0f, out, n, s, math());
        if (b) {
          kernels::bias_add(out, b, rows, n, s);
        }
        if (relu) kernels::relu_forward(out, out, int64_t{rows} * n, s);
      });
  return y;
}

Tensor Linear::backward_one(const Tensor& grad_output) {
  const Tensor& saved = input_bf16_.defined() ? input_bf16_ : input_;
  Shape expected = saved.shape();
  expected.back() = out_;
  check_shape(grad_output, expected, "Linear: grad_output");
  CUDP_CHECK(grad_output.dtype() == DType::f32, "Linear: grad_output is ", grad_output.str(),
             " but the output was f32; a gradient has its value's dtype");
  const int rows = static_cast<int>(saved.numel() / in_);
  const int n = static_cast<int>(out_), k = static_cast<int>(in_);
  // A fused ReLU: dy masked by y > 0 (bit for bit the ReLU module's backward), the bias gradient
  // taken in the same pass; every product below reads the masked dy.
  const Tensor* relu_y = fused_relu_mask();  // never handed on: Linear keeps its own mask
  const bool relu = relu_y != nullptr;
  const float* w = weight_->data.data<float>();
  float* dw = weight_->grad.data<float>();
  float* db = bias_ ? bias_->grad.data<float>() : nullptr;
  // 0: written, not added (NOTE [Deferred zeroing], layers/module.h).
  const float dw_beta = weight_->grad_beta();
  const float db_beta = bias_ ? bias_->grad_beta() : 1.f;
  // Backward-data on the forward's bf16 weight (read as B stored k x n) and backward-weight on the
  // bf16 copies of dy and x as they are stored. dy's bf16 rows are 16-byte multiples: out_features
  // as they are, or padded with zeros to a multiple of 8 (a classifier's 10 classes), which the
  // products read as a longer row stride (the padding columns are never read: k, or m, stays
  // out_features).
  const bool direct = weight_bf16_.defined() && input_bf16_.defined();
  const int64_t dy_cols = direct && !direct_bf16(out_) ? kernels::bf16_channels(n) : out_;
  const bool direct_dx = input_grad_ && direct;
  const bool direct_dw = direct;
  // fp32 operands for the float launchers (x widened from its bf16 copy when it was kept so).
  const Tensor x32 = input_.defined() ? input_
                     : direct_dw      ? Tensor()
                                      : convert(input_bf16_, DType::f32);
  const float* x = x32.defined() ? x32.data<float>() : nullptr;
  // The masked dy in fp32, where something takes it so: the CPU path, the float launchers, the
  // padded bf16 copy. With both products on bf16 rows of out_features the mask's pass writes the
  // bf16 copy itself.
  const bool bf16_mask = relu && device_.is_cuda() && direct && dy_cols == out_;
  const Tensor dym =
      relu && !bf16_mask ? Tensor::empty(grad_output.shape(), DType::f32, device_) : grad_output;
  const float* dy = dym.data<float>();
  Tensor dx;
  if (input_grad_) {
    dx = Tensor::empty(saved.shape(), direct_dx ? input_dtype_ : DType::f32, device_);
  }
  float* out = input_grad_ && !direct_dx ? dx.data<float>() : nullptr;
  run(
      [&] {
        if (relu) {
          kernels::relu_mask_bias_grad_cpu(relu_y->data<float>(), grad_output.data<float>(),
                                           dym.data<float>(), db, rows, n, db_beta);
        }
        const OperandView xr(x, int64_t{rows} * k, precision_), wr(w, int64_t{n} * k, precision_);
        const OperandView dyr(dy, int64_t{rows} * n, precision_);
        if (out) {
          kernels::gemm_cpu(false, false, rows, k, n, 1.0f, dyr.get(), n, wr.get(), k, 0.0f, out,
                            k);
        }
        kernels::gemm_cpu(true, false, n, k, rows, 1.0f, dyr.get(), n, xr.get(), k, dw_beta, dw, k);
        if (db && !relu) {
          kernels::bias_grad_cpu(dy, db, rows, n, db_beta);
        }
      },
      [&](cudaStream_t s) {
        // The bias gradient of a fused ReLU's pass is a parameter's gradient that nothing in the
        // backward reads: its last stage may wait for the backward's end (kernels/bias.h, NOTE
        // [Deferred bias gradients]).
        Tensor dy_bf16;
        if (bf16_mask) {
          dy_bf16 = Tensor::empty(grad_output.shape(), DType::bf16, device_);
          kernels::detail::relu_mask_bias_grad_deferrable(
              relu_y->data<float>(), grad_output.data<float>(), dy_bf16.data<__nv_bfloat16>(), db,
              rows, n, db_beta, s);
        } else {
          if (relu) {
            kernels::detail::relu_mask_bias_grad_deferrable(
                relu_y->data<float>(), grad_output.data<float>(), dym.data<float>(), db, rows, n,
                db_beta, s);
          }
          if (direct && dy_cols != out_) {
            dy_bf16 = Tensor::empty({rows, dy_cols}, DType::bf16, device_);
            kernels::conv2d_to_bf16(dy, rows, n, dy_bf16.data_ptr(), s);  // zero padding
          } else if (direct) {
            dy_bf16 = convert(dym, DType::bf16);
          }
        }
        // Backward-weight (and the bias gradient) beside backward-data when both run
        // (detail::concurrent_weight_grad).
        cuda::SideStream side(device_.index, s, cuda::SideStream::if_free,
                              input_grad_ && detail::concurrent_weight_grad(rows));
        const cudaStream_t ws = side.get();
        if (direct_dx) {
          bf16_product(rows, k, n, dy_bf16, weight_bf16_, dx.data_ptr(),
                       input_dtype_ == DType::bf16 ? kernels::DType::BF16 : kernels::DType::F32,
                       nullptr, s, Operands::kBStoredKN, 0.f, false, dy_cols);
        } else if (out) {
          kernels::gemm(false, false, rows, k, n, 1.0f, dy, n, w, k, 0.0f, out, k, s, math());
        }
        if (direct_dw) {  // dW += dy^T x
          bf16_product(n, k, rows, dy_bf16, input_bf16_, dw, kernels::DType::F32, nullptr, ws,
                       Operands::kBothStoredK, dw_beta, false, dy_cols);
        } else {
          kernels::gemm(true, false, n, k, rows, 1.0f, dy, n, x, k, dw_beta, dw, k, ws, math());
        }
        if (db && !relu) {
          kernels::bias_grad(dy, db, rows, n, db_beta, ws);
        }
        side.join();
      });
  weight_->grad_written();
  if (bias_) bias_->grad_written();
  // The gradient of a bf16 input is bf16 (one rounding of the fp32 result, as the direct path).
  if (dx.defined() && dx.dtype() != input_dtype_) dx = convert(dx, input_dtype_);
  return dx;
}

std::string Linear::extra_repr() const {
  return detail::str("in_features=", in_, ", out_features=", out_,
                     ", bias=", py_bool(bias_ != nullptr));
}

std::shared_ptr<Module> Linear::make_empty_copy() const {
  auto copy = std::make_shared<Linear>(init::skip_init, in_, out_, bias_ != nullptr);
  return copy;
}

}  // namespace cudp
