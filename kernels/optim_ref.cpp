#include <cmath>

#include "engine/core/error.h"
#include "kernels/optim.h"

namespace cudp::kernels {

namespace detail {

SgdCoefficients sgd_coefficients(int64_t n, double lr, double momentum, double dampening,
                                 double weight_decay, bool nesterov, bool first_step) {
  CUDP_CHECK(n >= 0, "sgd_step: n must be >= 0, got ", n);
  CUDP_CHECK(lr >= 0, "sgd_step: Invalid learning rate: ", lr);
  CUDP_CHECK(momentum >= 0, "sgd_step: Invalid momentum value: ", momentum);
  CUDP_CHECK(weight_decay >= 0, "sgd_step: Invalid weight_decay value: ", weight_decay);
  CUDP_CHECK(!nesterov || (momentum > 0 && dampening == 0),
             "sgd_step: Nesterov momentum requires a momentum and zero dampening (momentum ",
             momentum, ", dampening ", dampening, ")");
  return {float(weight_decay), float(momentum), float(1.0 - dampening),
          float(-lr),          nesterov,        first_step};
}

AdamWCoefficients adamw_coefficients(int64_t n, double lr, double beta1, double beta2, double eps,
                                     double weight_decay, int64_t step) {
  CUDP_CHECK(n >= 0, "adamw_step: n must be >= 0, got ", n);
  CUDP_CHECK(lr >= 0, "adamw_step: Invalid learning rate: ", lr);
  CUDP_CHECK(eps >= 0, "adamw_step: Invalid epsilon value: ", eps);
  CUDP_CHECK(beta1 >= 0 && beta1 < 1, "adamw_step: Invalid beta parameter at index 0: ", beta1);
  CUDP_CHECK(beta2 >= 0 && beta2 < 1, "adamw_step: Invalid beta parameter at index 1: ", beta2);
  CUDP_CHECK(weight_decay >= 0, "adamw_step: Invalid weight_decay value: ", weight_decay);
  CUDP_CHECK(step >= 1, "adamw_step: step counts from 1, got ", step);
  // As torch/optim/adam.py (_multi_tensor_adam) computes them, in Python floats.
  const double bc1 = 1 - std::pow(beta1, double(step));
  const double bc2 = 1 - std::pow(beta2, double(step));
  AdamWCoefficients k;
  k.decays = weight_decay != 0;
  k.decay = float(1 - lr * weight_decay);
  k.w1 = float(1 - beta1);
  k.one_minus_w1 = 1.f - k.w1;
  k.beta2 = float(beta2);
  k.w2 = float(1 - beta2);
  k.bc2_sqrt = float(std::pow(bc2, 0.5));
  k.eps = float(eps);
  k.step_size = float((lr / bc1) * -1);
  return k;
}

}  // namespace detail

void sgd_step_cpu(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
                  double momentum, double dampening, double weight_decay, bool nesterov,
                  bool first_step) {
  const detail::SgdCoefficients k =
      detail::sgd_coefficients(n, lr, momentum, dampening, weight_decay, nesterov, first_step);
  CUDP_CHECK(momentum == 0 || momentum_buf || n == 0, "sgd_step: momentum ", momentum,
             " needs a momentum buffer");
  for (int64_t i = 0; i < n; ++i) {
    param[i] = detail::sgd_update(param[i], grad[i], momentum_buf ? momentum_buf + i : nullptr, k);
  }
}

void adamw_step_cpu(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  const detail::AdamWCoefficients k =
      detail::adamw_coefficients(n, lr, beta1, beta2, eps, weight_decay, step);
  for (int64_t i = 0; i < n; ++i) detail::adamw_update(param[i], grad[i], m[i], v[i], k);
}

void sum_of_squares_cpu(const float* x, int64_t n, float* out) {
  CUDP_CHECK(n >= 0, "sum_of_squares: n must be >= 0, got ", n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(x[i]);
  *out = float(sum);
}

void global_norm_cpu(const float* x, int64_t n, float* norm) {
  CUDP_CHECK(n >= 0, "global_norm: n must be >= 0, got ", n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(x[i]);
  *norm = float(std::sqrt(sum));
}

void scale_by_clip_coefficient_cpu(float* grad, int64_t n, const float* norm, float max_norm) {
  CUDP_CHECK(n >= 0, "clip_grad_norm: n must be >= 0, got ", n);
  const float coef = detail::clip_coefficient(*norm, max_norm);
  for (int64_t i = 0; i < n; ++i) grad[i] *= coef;
}

void clip_grad_norm_cpu(float* grad, int64_t n, float max_norm, float* norm) {
  global_norm_cpu(grad, n, norm);
  scale_by_clip_coefficient_cpu(grad, n, norm, max_norm);
}

}  // namespace cudp::kernels
