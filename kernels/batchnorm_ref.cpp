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

// ---- split passes (kernels/batchnorm.h, "Split passes") -----------------------------------------

template <typename T>
void batchnorm_local_stats_cpu(const T* x, int64_t rows, int c, float* summary) {
  CUDP_CHECK(c >= 1 && rows >= 1, "batchnorm_local_stats: needs rows >= 1 and c >= 1, got rows ",
             rows, " and c ", c);
  // Two passes in double over d = x - K, K = x[row 0].
  std::vector<double> mean(c, 0.0), m2(c, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) mean[ch] += load(x[r * c + ch]) - load(x[ch]);
  }
  for (int ch = 0; ch < c; ++ch) mean[ch] /= double(rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double d = (load(x[r * c + ch]) - load(x[ch])) - mean[ch];
      m2[ch] += d * d;
    }
  }
  summary[0] = float(rows);
  for (int ch = 0; ch < c; ++ch) {
    summary[1 + ch] = float(load(x[ch]));  // exact: x is float or bf16
    summary[1 + c + ch] = float(mean[ch]);
    summary[1 + 2 * c + ch] = float(m2[ch]);
  }
}

void batchnorm_merge_stats_cpu(const float* summaries, int parts, int c, const float* gamma,
                               const float* beta, float* running_mean, float* running_var,
                               float* save_mean, float* save_invstd, float momentum, float eps,
                               double* coef) {
  CUDP_CHECK(c >= 1 && parts >= 1, "batchnorm_merge_stats: needs parts >= 1 and c >= 1, got ",
             parts, " and ", c);
  const int64_t size = batchnorm_summary_size(c);
  double total = 0.0;
  for (int p = 0; p < parts; ++p) total += double(summaries[p * size]);
  CUDP_CHECK(total > 1.0,
             "batchnorm_merge_stats: expected more than 1 value per channel when training, got ",
             total, " rows over all ", parts, " participants");
  for (int ch = 0; ch < c; ++ch) {
    const double k0 = double(summaries[1 + ch]);
    double n = 0.0, mean = 0.0, m2 = 0.0;
    for (int p = 0; p < parts; ++p) {  // Chan's merge, in slot order
      const float* s = summaries + p * size;
      const double n_b = double(s[0]);
      if (n_b == 0.0) continue;
      const double mean_b = (double(s[1 + ch]) - k0) + double(s[1 + c + ch]);
      const double delta = mean_b - mean, sum = n + n_b;
      m2 += double(s[1 + 2 * c + ch]) + delta * delta * n * n_b / sum;
      mean += delta * n_b / sum;
      n = sum;
    }
    const double var = m2 / n;
    const double invstd = 1.0 / std::sqrt(var + double(eps));
    if (save_mean) save_mean[ch] = float(k0 + mean);
    if (save_invstd) save_invstd[ch] = float(invstd);
    const double m = double(momentum);
    if (running_mean) {
      running_mean[ch] = float((1 - m) * double(running_mean[ch]) + m * (k0 + mean));
    }
    if (running_var) running_var[ch] = float((1 - m) * double(running_var[ch]) + m * m2 / (n - 1));
    coef[ch] = k0;
    coef[c + ch] = mean;
    coef[2 * c + ch] = (gamma ? double(gamma[ch]) : 1.0) * invstd;
    coef[3 * c + ch] = beta ? double(beta[ch]) : 0.0;
  }
}

template <typename T>
void batchnorm_apply_cpu(const T* x, std::type_identity_t<T>* y, const double* coef, int64_t rows,
                         int c, BnActivation act) {
  detail::check_batchnorm("batchnorm_apply", rows, c, false);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double d = (load(x[r * c + ch]) - coef[ch]) - coef[c + ch];
      y[r * c + ch] = output<T>(d * coef[2 * c + ch] + coef[3 * c + ch], act);
    }
  }
}

template <typename T>
void batchnorm_backward_local_cpu(const T* x, const std::type_identity_t<T>* dy,
                                  const std::type_identity_t<T>* relu_output,
                                  const float* save_mean, const float* save_invstd, int64_t rows,
                                  int c, float* sums, float* dgamma, float* dbeta,
                                  float beta_accumulate) {
  detail::check_batchnorm("batchnorm_backward_local", rows, c, false);
  std::vector<double> sum_dy(c, 0.0), sum_dy_xmu(c, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double g = masked(dy, relu_output, r * c + ch);
      sum_dy[ch] += g;
      sum_dy_xmu[ch] += g * (load(x[r * c + ch]) - double(save_mean[ch]));
    }
  }
  const double a = double(beta_accumulate);
  for (int ch = 0; ch < c; ++ch) {
    sums[ch] = float(sum_dy[ch]);
    sums[c + ch] = float(sum_dy_xmu[ch]);
    const double grad_gamma = sum_dy_xmu[ch] * double(save_invstd[ch]);
    if (dgamma) dgamma[ch] = float(a == 0 ? grad_gamma : a * double(dgamma[ch]) + grad_gamma);
    if (dbeta) dbeta[ch] = float(a == 0 ? sum_dy[ch] : a * double(dbeta[ch]) + sum_dy[ch]);
  }
  sums[2 * c] = float(rows);
}

template <typename T>
void batchnorm_backward_global_cpu(const T* x, const std::type_identity_t<T>* dy,
                                   const std::type_identity_t<T>* relu_output, const float* gamma,
                                   const float* save_mean, const float* save_invstd,
                                   const float* sums, std::type_identity_t<T>* dx, int64_t rows,
                                   int c) {
  detail::check_batchnorm("batchnorm_backward_global", rows, c, false);
  const double m = double(sums[2 * c]);
  CUDP_CHECK(m > 1.0, "batchnorm_backward_global: the summed rows must be more than 1, got ", m);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double invstd = double(save_invstd[ch]);
      const double k = (gamma ? double(gamma[ch]) : 1.0) * invstd;
      const double g = masked(dy, relu_output, r * c + ch);
      const double xhat = (load(x[r * c + ch]) - double(save_mean[ch])) * invstd;
      dx[r * c + ch] =
          store<T>(k * (g - double(sums[ch]) / m - xhat * double(sums[c + ch]) * invstd / m));
    }
  }
}

#define CUDP_BATCHNORM_SPLIT_INSTANTIATE(T)                                                      \
  template void batchnorm_local_stats_cpu<T>(const T*, int64_t, int, float*);                    \
  template void batchnorm_apply_cpu<T>(const T*, T*, const double*, int64_t, int, BnActivation); \
  template void batchnorm_backward_local_cpu<T>(const T*, const T*, const T*, const float*,      \
                                                const float*, int64_t, int, float*, float*,      \
                                                float*, float);                                  \
  template void batchnorm_backward_global_cpu<T>(const T*, const T*, const T*, const float*,     \
                                                 const float*, const float*, const float*, T*,   \
                                                 int64_t, int);
CUDP_BATCHNORM_SPLIT_INSTANTIATE(float)
CUDP_BATCHNORM_SPLIT_INSTANTIATE(__nv_bfloat16)
#undef CUDP_BATCHNORM_SPLIT_INSTANTIATE

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
