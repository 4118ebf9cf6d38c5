#include <cmath>
#include <vector>

#include "engine/core/error.h"
#include "kernels/batchnorm.h"

namespace cudp::kernels {

namespace detail {

void check_batchnorm(const char* op, int64_t rows, int c, bool training) {
  CUDP_CHECK(c >= 1, op, ": channels must be >= 1, got ", c);
  CUDP_CHECK(rows >= 0, op, ": rows (N*H*W) must be >= 0, got ", rows);
  CUDP_CHECK(!training || rows > 1, op,
             ": expected more than 1 value per channel when training, got rows (N*H*W) = ", rows);
}

}  // namespace detail

template <typename T>
void batchnorm_forward_train_cpu(const T* x, std::type_identity_t<T>* y,
                                 const std::type_identity_t<T>* gamma,
                                 const std::type_identity_t<T>* beta,
                                 std::type_identity_t<T>* running_mean,
                                 std::type_identity_t<T>* running_var,
                                 std::type_identity_t<T>* save_mean,
                                 std::type_identity_t<T>* save_invstd, int64_t rows, int c,
                                 std::type_identity_t<T> momentum, std::type_identity_t<T> eps) {
  detail::check_batchnorm("batchnorm_forward_train", rows, c, true);
  // Two passes in double: the mean, then the squared deviations from it.
  std::vector<double> mean(c, 0.0), m2(c, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) mean[ch] += double(x[r * c + ch]);
  }
  for (int ch = 0; ch < c; ++ch) mean[ch] /= double(rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double d = double(x[r * c + ch]) - mean[ch];
      m2[ch] += d * d;
    }
  }
  std::vector<double> scale(c), shift(c);
  for (int ch = 0; ch < c; ++ch) {
    const double var = m2[ch] / double(rows);
    const double invstd = 1.0 / std::sqrt(var + double(eps));
    scale[ch] = (gamma ? double(gamma[ch]) : 1.0) * invstd;
    shift[ch] = beta ? double(beta[ch]) : 0.0;
    if (save_mean) save_mean[ch] = T(mean[ch]);
    if (save_invstd) save_invstd[ch] = T(invstd);
    const double m = double(momentum);
    if (running_mean) running_mean[ch] = T((1 - m) * double(running_mean[ch]) + m * mean[ch]);
    if (running_var) {
      running_var[ch] = T((1 - m) * double(running_var[ch]) + m * m2[ch] / double(rows - 1));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      y[r * c + ch] = T((double(x[r * c + ch]) - mean[ch]) * scale[ch] + shift[ch]);
    }
  }
}

template <typename T>
void batchnorm_forward_eval_cpu(const T* x, std::type_identity_t<T>* y,
                                const std::type_identity_t<T>* gamma,
                                const std::type_identity_t<T>* beta,
                                const std::type_identity_t<T>* running_mean,
                                const std::type_identity_t<T>* running_var, int64_t rows, int c,
                                std::type_identity_t<T> eps) {
  detail::check_batchnorm("batchnorm_forward_eval", rows, c, false);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double invstd = 1.0 / std::sqrt(double(running_var[ch]) + double(eps));
      const double g = gamma ? double(gamma[ch]) : 1.0, b = beta ? double(beta[ch]) : 0.0;
      y[r * c + ch] = T((double(x[r * c + ch]) - double(running_mean[ch])) * invstd * g + b);
    }
  }
}

template <typename T>
void batchnorm_backward_cpu(const T* x, const std::type_identity_t<T>* dy,
                            const std::type_identity_t<T>* gamma,
                            const std::type_identity_t<T>* save_mean,
                            const std::type_identity_t<T>* save_invstd, std::type_identity_t<T>* dx,
                            std::type_identity_t<T>* dgamma, std::type_identity_t<T>* dbeta,
                            int64_t rows, int c, std::type_identity_t<T> beta_accumulate) {
  detail::check_batchnorm("batchnorm_backward", rows, c, true);
  // With xhat = (x - mean) * invstd and M = rows:
  //   dbeta = sum dy, dgamma = sum dy * xhat,
  //   dx = gamma * invstd * (dy - dbeta / M - xhat * dgamma / M).
  std::vector<double> sum_dy(c, 0.0), sum_dy_xmu(c, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double g = double(dy[r * c + ch]);
      sum_dy[ch] += g;
      sum_dy_xmu[ch] += g * (double(x[r * c + ch]) - double(save_mean[ch]));
    }
  }
  const double m = double(rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < c; ++ch) {
      const double invstd = double(save_invstd[ch]);
      const double xhat = (double(x[r * c + ch]) - double(save_mean[ch])) * invstd;
      const double k = (gamma ? double(gamma[ch]) : 1.0) * invstd;
      dx[r * c + ch] =
          T(k * (double(dy[r * c + ch]) - sum_dy[ch] / m - xhat * sum_dy_xmu[ch] * invstd / m));
    }
  }
  for (int ch = 0; ch < c; ++ch) {
    const double grad_gamma = sum_dy_xmu[ch] * double(save_invstd[ch]);
    const double grad_beta = sum_dy[ch];
    const double a = double(beta_accumulate);
    if (dgamma) dgamma[ch] = T(a == 0 ? grad_gamma : a * double(dgamma[ch]) + grad_gamma);
    if (dbeta) dbeta[ch] = T(a == 0 ? grad_beta : a * double(dbeta[ch]) + grad_beta);
  }
}

#define CUDP_BATCHNORM_INSTANTIATE(T)                                                            \
  template void batchnorm_forward_train_cpu<T>(const T*, T*, const T*, const T*, T*, T*, T*, T*, \
                                               int64_t, int, T, T);                              \
  template void batchnorm_forward_eval_cpu<T>(const T*, T*, const T*, const T*, const T*,        \
                                              const T*, int64_t, int, T);                        \
  template void batchnorm_backward_cpu<T>(const T*, const T*, const T*, const T*, const T*, T*,  \
                                          T*, T*, int64_t, int, T);
CUDP_BATCHNORM_INSTANTIATE(float)
CUDP_BATCHNORM_INSTANTIATE(double)
#undef CUDP_BATCHNORM_INSTANTIATE

}  // namespace cudp::kernels
