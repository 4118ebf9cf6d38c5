#include <cmath>
#include <cstring>
#include <vector>

#include "engine/core/error.h"
#include "kernels/batchnorm.h"
#include "kernels/elementwise.h"
#include "kernels/layout.h"

namespace cudp::kernels {

namespace detail {

void check_batchnorm(const char* op, int64_t rows, int c, bool training) {
  CUDP_CHECK(c >= 1, op, ": channels must be >= 1, got ", c);
  CUDP_CHECK(rows >= 0, op, ": rows (N*H*W) must be >= 0, got ", rows);
  CUDP_CHECK(!training || rows > 1, op,
             ": expected more than 1 value per channel when training, got rows (N*H*W) = ", rows);
}

}  // namespace detail

namespace {

double load(double v) {
  return v;
}
double load(float v) {
  return double(v);
}
double load(__nv_bfloat16 v) {
  const uint32_t wide = uint32_t(static_cast<__nv_bfloat16_raw>(v).x) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return double(f);
}

// v rounded once to T. For bf16, v goes to float rounded to odd (toward zero, then the last bit
// set when inexact), then to bf16 to nearest even: with 16 more bits in float than in bf16 this is
// the correctly rounded bf16 of v, with no double rounding.
template <typename T>
T store(double v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    float f = float(v);
    if (std::isfinite(f) && double(f) != v) {
      if (std::fabs(double(f)) > std::fabs(v)) f = std::nextafter(f, 0.0f);
      uint32_t u;
      std::memcpy(&u, &f, sizeof u);
      u |= 1u;
      std::memcpy(&f, &u, sizeof f);
    }
    __nv_bfloat16_raw raw;
    raw.x = detail::f32_to_bf16_bits(f);
    return raw;
  } else {
    return T(v);
  }
}

// The stored output of a forward: the value rounded to T, then the fused ReLU's clamp (the order
// does not matter, see kernels/batchnorm.h; this is the unfused layers' order).
template <typename T>
T output(double v, BnActivation act) {
  const T y = store<T>(v);
  if (act == BnActivation::none) return y;
  if constexpr (std::is_same_v<T, double>) {
    return y <= 0.0 ? 0.0 : y;  // detail::relu's rule, in double
  } else {
    return store<T>(double(detail::relu(float(load(y)))));
  }
}

// The gradient reaching the normalisation: dy masked by the fused ReLU's output, if any (detail::
// relu_grad's rule: zero where the output is <= 0).
template <typename T>
double masked(const T* dy, const T* relu_output, int64_t i) {
  if (relu_output && load(relu_output[i]) <= 0.0) return 0.0;
  return load(dy[i]);
}

}  // namespace

template <typename T>
void batchnorm_forward_train_cpu(const T* x, std::type_identity_t<T>* y, const BnParam<T>* gamma,
                                 const BnParam<T>* beta, BnParam<T>* running_mean,
                                 BnParam<T>* running_var, BnParam<T>* save_mean,
                                 BnParam<T>* save_invstd, int64_t rows, int c, BnParam<T> momentum,
                                 BnParam<T> eps, BnActivation act) {
  using P = BnParam<T>;
  detail::check_batchnorm("batchnorm_forward_train", rows, c, true);
  // Two passes in double: the mean, then the squared deviations from it.
  std::vector<double> mean(c, 0.0), m2(c, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) mean[ch] += load(x[r * c + ch]);
  }
  for (int ch = 0; ch < c; ++ch) mean[ch] /= double(rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double d = load(x[r * c + ch]) - mean[ch];
      m2[ch] += d * d;
    }
  }
  std::vector<double> scale(c), shift(c);
  for (int ch = 0; ch < c; ++ch) {
    const double var = m2[ch] / double(rows);
    const double invstd = 1.0 / std::sqrt(var + double(eps));
    scale[ch] = (gamma ? double(gamma[ch]) : 1.0) * invstd;
    shift[ch] = beta ? double(beta[ch]) : 0.0;
    if (save_mean) save_mean[ch] = P(mean[ch]);
    if (save_invstd) save_invstd[ch] = P(invstd);
    const double m = double(momentum);
    if (running_mean) running_mean[ch] = P((1 - m) * double(running_mean[ch]) + m * mean[ch]);
    if (running_var) {
      running_var[ch] = P((1 - m) * double(running_var[ch]) + m * m2[ch] / double(rows - 1));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      y[r * c + ch] = output<T>((load(x[r * c + ch]) - mean[ch]) * scale[ch] + shift[ch], act);
    }
  }
}

template <typename T>
void batchnorm_forward_eval_cpu(const T* x, std::type_identity_t<T>* y, const BnParam<T>* gamma,
                                const BnParam<T>* beta, const BnParam<T>* running_mean,
                                const BnParam<T>* running_var, int64_t rows, int c, BnParam<T> eps,
                                BnActivation act) {
  detail::check_batchnorm("batchnorm_forward_eval", rows, c, false);
  CUDP_CHECK(running_mean && running_var,
             "batchnorm_forward_eval: needs running_mean and running_var");
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double invstd = 1.0 / std::sqrt(double(running_var[ch]) + double(eps));
      const double g = gamma ? double(gamma[ch]) : 1.0, b = beta ? double(beta[ch]) : 0.0;
      y[r * c + ch] =
          output<T>((load(x[r * c + ch]) - double(running_mean[ch])) * invstd * g + b, act);
    }
  }
}

namespace {

// Both backwards: with xhat = (x - mean) * invstd and M = rows,
//   dbeta = sum dy, dgamma = sum dy * xhat,
//   dx = gamma * invstd * (dy - dbeta / M - xhat * dgamma / M)   (batch statistics)
//   dx = gamma * invstd * dy                                     (frozen statistics)
// with dy masked by the fused ReLU's output first.
template <typename T>
void backward_cpu(const T* x, const T* dy, const T* relu_output, const BnParam<T>* gamma,
                  const std::vector<double>& mean, const std::vector<double>& invstd, T* dx,
                  BnParam<T>* dgamma, BnParam<T>* dbeta, int64_t rows, int c, bool frozen,
                  double beta_accumulate) {
  using P = BnParam<T>;
  std::vector<double> sum_dy(c, 0.0), sum_dy_xmu(c, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double g = masked(dy, relu_output, r * c + ch);
      sum_dy[ch] += g;
      sum_dy_xmu[ch] += g * (load(x[r * c + ch]) - mean[ch]);
    }
  }
  const double m = double(rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double k = (gamma ? double(gamma[ch]) : 1.0) * invstd[ch];
      const double g = masked(dy, relu_output, r * c + ch);
      if (frozen) {
        dx[r * c + ch] = store<T>(k * g);
      } else {
        const double xhat = (load(x[r * c + ch]) - mean[ch]) * invstd[ch];
        dx[r * c + ch] =
            store<T>(k * (g - sum_dy[ch] / m - xhat * sum_dy_xmu[ch] * invstd[ch] / m));
      }
    }
  }
  for (int ch = 0; ch < c; ++ch) {
    const double grad_gamma = sum_dy_xmu[ch] * invstd[ch];
    const double grad_beta = sum_dy[ch];
    const double a = beta_accumulate;
    if (dgamma) dgamma[ch] = P(a == 0 ? grad_gamma : a * double(dgamma[ch]) + grad_gamma);
    if (dbeta) dbeta[ch] = P(a == 0 ? grad_beta : a * double(dbeta[ch]) + grad_beta);
  }
}

}  // namespace

template <typename T>
void batchnorm_backward_cpu(const T* x, const std::type_identity_t<T>* dy,
                            const std::type_identity_t<T>* relu_output, const BnParam<T>* gamma,
                            const BnParam<T>* save_mean, const BnParam<T>* save_invstd,
                            std::type_identity_t<T>* dx, BnParam<T>* dgamma, BnParam<T>* dbeta,
                            int64_t rows, int c, BnParam<T> beta_accumulate) {
  detail::check_batchnorm("batchnorm_backward", rows, c, true);
  CUDP_CHECK(save_mean && save_invstd,
             "batchnorm_backward: needs save_mean and save_invstd from the training forward");
  const std::vector<double> mean(save_mean, save_mean + c), invstd(save_invstd, save_invstd + c);
  backward_cpu(x, dy, relu_output, gamma, mean, invstd, dx, dgamma, dbeta, rows, c, false,
               double(beta_accumulate));
}

template <typename T>
void batchnorm_backward_eval_cpu(const T* x, const std::type_identity_t<T>* dy,
                                 const std::type_identity_t<T>* relu_output,
                                 const BnParam<T>* gamma, const BnParam<T>* running_mean,
                                 const BnParam<T>* running_var, std::type_identity_t<T>* dx,
                                 BnParam<T>* dgamma, BnParam<T>* dbeta, int64_t rows, int c,
                                 BnParam<T> eps, BnParam<T> beta_accumulate) {
  detail::check_batchnorm("batchnorm_backward_eval", rows, c, false);
  CUDP_CHECK(running_mean && running_var,
             "batchnorm_backward_eval: needs running_mean and running_var");
  std::vector<double> mean(running_mean, running_mean + c), invstd(c);
  for (int ch = 0; ch < c; ++ch)
    invstd[ch] = 1.0 / std::sqrt(double(running_var[ch]) + double(eps));
  backward_cpu(x, dy, relu_output, gamma, mean, invstd, dx, dgamma, dbeta, rows, c, true,
               double(beta_accumulate));
}

#define CUDP_BATCHNORM_INSTANTIATE(T)                                                             \
  template void batchnorm_forward_train_cpu<T>(                                                   \
      const T*, T*, const BnParam<T>*, const BnParam<T>*, BnParam<T>*, BnParam<T>*, BnParam<T>*,  \
      BnParam<T>*, int64_t, int, BnParam<T>, BnParam<T>, BnActivation);                           \
  template void batchnorm_forward_eval_cpu<T>(const T*, T*, const BnParam<T>*, const BnParam<T>*, \
                                              const BnParam<T>*, const BnParam<T>*, int64_t, int, \
                                              BnParam<T>, BnActivation);                          \
  template void batchnorm_backward_cpu<T>(const T*, const T*, const T*, const BnParam<T>*,        \
                                          const BnParam<T>*, const BnParam<T>*, T*, BnParam<T>*,  \
                                          BnParam<T>*, int64_t, int, BnParam<T>);                 \
  template void batchnorm_backward_eval_cpu<T>(                                                   \
      const T*, const T*, const T*, const BnParam<T>*, const BnParam<T>*, const BnParam<T>*, T*,  \
      BnParam<T>*, BnParam<T>*, int64_t, int, BnParam<T>, BnParam<T>);
CUDP_BATCHNORM_INSTANTIATE(float)
CUDP_BATCHNORM_INSTANTIATE(double)
CUDP_BATCHNORM_INSTANTIATE(__nv_bfloat16)
#undef CUDP_BATCHNORM_INSTANTIATE

}  // namespace cudp::kernels
