#include <cmath>

#include "engine/core/error.h"
#include "kernels/layout.h"
#include "kernels/optim.h"

namespace cudp::kernels {

namespace detail {

SgdCoefficients sgd_coefficients(int64_t n, double lr, double momentum, double dampening,
                                 double weight_decay, bool nesterov, bool first_step,
                                 const char* who) {
  CUDP_CHECK(n >= 0, who, ": n must be >= 0, got ", n);
  CUDP_CHECK(lr >= 0, who, ": Invalid learning rate: ", lr);
  CUDP_CHECK(momentum >= 0, who, ": Invalid momentum value: ", momentum);
  CUDP_CHECK(weight_decay >= 0, who, ": Invalid weight_decay value: ", weight_decay);
  CUDP_CHECK(!nesterov || (momentum > 0 && dampening == 0), who,
             ": Nesterov momentum requires a momentum and zero dampening (momentum ", momentum,
             ", dampening ", dampening, ")");
  return {float(weight_decay), float(momentum), float(1.0 - dampening),
          float(-lr),          nesterov,        first_step};
}

AdamWCoefficients adamw_coefficients(int64_t n, double lr, double beta1, double beta2, double eps,
                                     double weight_decay, int64_t step, const char* who) {
  CUDP_CHECK(n >= 0, who, ": n must be >= 0, got ", n);
  CUDP_CHECK(lr >= 0, who, ": Invalid learning rate: ", lr);
  CUDP_CHECK(eps >= 0, who, ": Invalid epsilon value: ", eps);
  CUDP_CHECK(beta1 >= 0 && beta1 < 1, who, ": Invalid beta parameter at index 0: ", beta1);
  CUDP_CHECK(beta2 >= 0 && beta2 < 1, who, ": Invalid beta parameter at index 1: ", beta2);
  CUDP_CHECK(weight_decay >= 0, who, ": Invalid weight_decay value: ", weight_decay);
  CUDP_CHECK(step >= 1, who, ": step counts from 1, got ", step);
  AdamWCoefficients k;
  k.decays = weight_decay != 0;
  k.decay = float(1 - lr * weight_decay);
  k.w1 = float(1 - beta1);
  k.one_minus_w1 = 1.f - k.w1;
  k.beta2 = float(beta2);
  k.w2 = float(1 - beta2);
  k.eps = float(eps);
  k.lr_given = lr;
  k.beta1_given = beta1;
  k.beta2_given = beta2;
  set_bias_corrections(k, step);
  return k;
}

}  // namespace detail

void sgd_step_cpu(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
                  double momentum, double dampening, double weight_decay, bool nesterov,
                  bool first_step) {
  sgd_step_cpu(param, grad, momentum_buf, n, lr, momentum, dampening, weight_decay, nesterov,
               first_step ? 0 : 1, StepGate{});
}

void sgd_step_cpu(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
                  double momentum, double dampening, double weight_decay, bool nesterov,
                  int64_t momentum_steps, const StepGate& gate, __nv_bfloat16* compute,
                  float* grad_norm) {
  detail::SgdCoefficients k =
      detail::sgd_coefficients(n, lr, momentum, dampening, weight_decay, nesterov, false);
  CUDP_CHECK(momentum == 0 || momentum_buf || n == 0, "sgd_step: momentum ", momentum,
             " needs a momentum buffer");
  CUDP_CHECK(momentum_steps >= 0, "sgd_step: momentum_steps must be >= 0, got ", momentum_steps);
  if (grad_norm != nullptr) global_norm_cpu(grad, n, grad_norm);  // skipped or not
  if (detail::skipped(gate)) return;
  k.first_step = detail::steps_taken(momentum_steps, gate) == 0;
  for (int64_t i = 0; i < n; ++i) {
    param[i] = detail::sgd_update(param[i], grad[i], momentum_buf ? momentum_buf + i : nullptr, k);
  }
  if (compute != nullptr) f32_to_bf16_cpu(param, compute, n);
}

void adamw_step_cpu(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  adamw_step_cpu(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, StepGate{});
}

void adamw_step_cpu(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    const StepGate& gate, __nv_bfloat16* compute, float* grad_norm) {
  detail::AdamWCoefficients k =
      detail::adamw_coefficients(n, lr, beta1, beta2, eps, weight_decay, step);
  if (grad_norm != nullptr) global_norm_cpu(grad, n, grad_norm);  // skipped or not
  if (detail::skipped(gate)) return;
  const int64_t taken = detail::steps_taken(step, gate);
  CUDP_CHECK(taken >= 1, "adamw_step: step ", step, " less the skipped steps is ", taken,
             "; the skipped count does not belong to this optimizer's steps");
  if (taken != step) detail::set_bias_corrections(k, taken);
  for (int64_t i = 0; i < n; ++i) detail::adamw_update(param[i], grad[i], m[i], v[i], k);
  if (compute != nullptr) f32_to_bf16_cpu(param, compute, n);
}

void count_skipped_step_cpu(const int32_t* skip, int64_t* counts, bool advances_state) {
  if (*skip == 0) return;
  counts[0] += 1;
  if (advances_state) counts[1] += 1;
}

void nonfinite_flag_cpu(const float* a, const float* b, int32_t* flag) {
  *flag = !std::isfinite(*a) || (b != nullptr && !std::isfinite(*b)) ? 1 : 0;
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
