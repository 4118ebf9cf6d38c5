#include "layers/batchnorm.h"

#include "kernels/batchnorm.h"
#include "kernels/scalars.h"

namespace cudp {

BatchNorm2d::BatchNorm2d(int num_features, float eps, float momentum)
    : BatchNorm2d(init::skip_init, num_features, eps, momentum) {
  reset_parameters();
}

BatchNorm2d::BatchNorm2d(init::SkipInit, int num_features, float eps, float momentum)
    : c_(num_features), eps_(eps), momentum_(momentum) {
  CUDP_CHECK(c_ > 0, "BatchNorm2d: num_features must be positive, got ", c_);
  CUDP_CHECK(eps_ > 0.0f, "BatchNorm2d: eps must be positive, got ", eps_);
  CUDP_CHECK(momentum_ >= 0.0f && momentum_ <= 1.0f,
             "BatchNorm2d: momentum must be in [0, 1], got ", momentum_);
  weight_ = &register_parameter("weight", Tensor::empty({c_}));
  bias_ = &register_parameter("bias", Tensor::empty({c_}));
  running_mean_ = &register_buffer("running_mean", Tensor::empty({c_}));
  running_var_ = &register_buffer("running_var", Tensor::empty({c_}));
  num_batches_tracked_ = &register_buffer("num_batches_tracked", Tensor::zeros({}, DType::i64));
}

void BatchNorm2d::reset_parameters() {
  weight_->data.fill_(1.0f);
  bias_->data.zero_();
  running_mean_->zero_();
  running_var_->fill_(1.0f);
  batches_tracked_ = 0;
  num_batches_tracked_->zero_();
}

int64_t BatchNorm2d::rows_of(const Tensor& input) const {
  CUDP_CHECK(input.dim() == 4 && input.size(3) == c_ && input.dtype() == DType::f32,
             "BatchNorm2d: expected an NHWC f32 input [N, H, W, ", c_, "], got ", input.str());
  return input.numel() / c_;
}

void BatchNorm2d::write_batch_count() {
  void* dst = num_batches_tracked_->data_ptr();
  run([&] { *static_cast<int64_t*>(dst) = batches_tracked_; },
      // +1 on the device (it held batches_tracked_ - 1): no pageable copy, and a CUDA graph's
      // replays count too (kernels/scalars.h).
      [&](cudaStream_t s) { kernels::add_i64(static_cast<int64_t*>(dst), 1, s); });
}

Tensor BatchNorm2d::forward_one(const Tensor& input) {
  const int64_t rows = rows_of(input);
  Tensor y = Tensor::empty(input.shape(), DType::f32, device_);
  const float* x = input.data<float>();
  float* out = y.data<float>();
  const float* gamma = weight_->data.data<float>();
  const float* beta = bias_->data.data<float>();
  float* mean = running_mean_->data<float>();
  float* var = running_var_->data<float>();
  const int c = c_;
  const float eps = eps_, momentum = momentum_;
  saved_training_ = training_;
  input_ = input;
  if (!training_) {
    normalise_with_running_var(x, out, gamma, beta, mean, rows);
    return y;
  }
  Tensor save_mean = Tensor::empty({c_}, DType::f32, device_);
  Tensor save_invstd = Tensor::empty({c_}, DType::f32, device_);
  float* sm = save_mean.data<float>();
  float* si = save_invstd.data<float>();
  run(
      [&] {
        kernels::batchnorm_forward_train_cpu(x, out, gamma, beta, mean, var, sm, si, rows, c,
                                             momentum, eps);
      },
      [&](cudaStream_t s) {
        kernels::batchnorm_forward_train(x, out, gamma, beta, mean, var, sm, si, rows, c, momentum,
                                         eps, s);
      });
  ++batches_tracked_;
  write_batch_count();
  save_mean_ = save_mean;
  save_invstd_ = save_invstd;
  return y;
}

void BatchNorm2d::normalise_with_running_var(const float* x, float* y, const float* gamma,
                                             const float* beta, const float* mean,
                                             int64_t rows) const {
  const float* var = running_var_->data<float>();
  const int c = c_;
  const float eps = eps_;
  run([&] { kernels::batchnorm_forward_eval_cpu(x, y, gamma, beta, mean, var, rows, c, eps); },
      [&](cudaStream_t s) {
        kernels::batchnorm_forward_eval(x, y, gamma, beta, mean, var, rows, c, eps, s);
      });
}

void BatchNorm2d::parameter_gradients(const float* dy, const float* mean, const float* invstd,
                                      float* dx) {
  const int64_t rows = rows_of(input_);
  const float* x = input_.data<float>();
  const float* gamma = weight_->data.data<float>();
  float* dgamma = weight_->grad.data<float>();
  float* dbeta = bias_->grad.data<float>();
  const int c = c_;
  run(
      [&] {
        kernels::batchnorm_backward_cpu(x, dy, gamma, mean, invstd, dx, dgamma, dbeta, rows, c,
                                        1.0f);
      },
      [&](cudaStream_t s) {
        kernels::batchnorm_backward(x, dy, gamma, mean, invstd, dx, dgamma, dbeta, rows, c, 1.0f,
                                    s);
      });
}

Tensor BatchNorm2d::backward_one(const Tensor& grad_output) {
  check_shape(grad_output, input_.shape(), "BatchNorm2d: grad_output");
  Tensor dx = Tensor::empty(input_.shape(), DType::f32, device_);
  const float* dy = grad_output.data<float>();
  if (saved_training_) {
    parameter_gradients(dy, save_mean_.data<float>(), save_invstd_.data<float>(), dx.data<float>());
    return dx;
  }
  // Frozen statistics make the layer affine per channel: dx = dy * gamma * invstd, and dgamma,
  // dbeta have the training formulas' form with the running mean and invstd in place of the
  // batch's. kernels/batchnorm.h has no per-channel scale, so the evaluation kernel plays it: with
  // mean 0 and the running variance it maps a row of ones to invstd, and dy to dy * gamma * invstd.
  // The backward kernel then gives dgamma and dbeta; its dx (the batch-statistics one) is dropped.
  const Tensor zeros = Tensor::zeros({c_}, DType::f32, device_);
  const Tensor ones = Tensor::full({1, c_}, 1.0f, device_);
  Tensor invstd = Tensor::empty({c_}, DType::f32, device_);
  normalise_with_running_var(ones.data<float>(), invstd.data<float>(), nullptr, nullptr,
                             zeros.data<float>(), 1);
  Tensor unused = Tensor::empty(input_.shape(), DType::f32, device_);
  parameter_gradients(dy, running_mean_->data<float>(), invstd.data<float>(), unused.data<float>());
  normalise_with_running_var(dy, dx.data<float>(), weight_->data.data<float>(), nullptr,
                             zeros.data<float>(), rows_of(input_));
  return dx;
}

std::shared_ptr<Module> BatchNorm2d::make_empty_copy() const {
  auto copy = std::make_shared<BatchNorm2d>(init::skip_init, c_, eps_, momentum_);
  copy->batches_tracked_ = batches_tracked_;
  return copy;
}

Tensor BatchNorm2d::import_tensor(const std::string& local_name, const Tensor& pytorch) const {
  if (local_name == "num_batches_tracked") {
    batches_tracked_ = pytorch.to_vector<int64_t>().at(0);
  }
  return pytorch;
}

}  // namespace cudp
