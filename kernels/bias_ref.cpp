// CPU references of bias.h.
#include <vector>

#include "engine/core/error.h"
#include "kernels/bias.h"
#include "kernels/elementwise.h"

namespace cudp::kernels {
namespace detail {

void check_bias_args(const char* op, const void* matrix, const void* bias, int64_t rows,
                     int64_t cols) {
  CUDP_CHECK(rows >= 0 && cols >= 0, op, ": rows and cols must be >= 0, got ", rows, " x ", cols);
  detail::check_elementwise(op, rows * cols, {matrix});
  detail::check_elementwise(op, cols, {bias});
}

}  // namespace detail

void bias_add_cpu(float* y, const float* bias, int64_t rows, int64_t cols) {
  detail::check_bias_args("bias_add_cpu", y, bias, rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      y[r * cols + c] += bias[c];
    }
  }
}

void bias_grad_cpu(const float* dy, float* dbias, int64_t rows, int64_t cols, float beta) {
  detail::check_bias_args("bias_grad_cpu", dy, dbias, rows, cols);
  std::vector<double> sum(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      sum[c] += dy[r * cols + c];
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    const double old = beta == 0.0f ? 0.0 : static_cast<double>(beta) * dbias[c];
    dbias[c] = static_cast<float>(old + sum[c]);
  }
}

}  // namespace cudp::kernels
