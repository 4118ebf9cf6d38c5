// CPU references of bias.h.
#include <vector>

#include "engine/core/error.h"
#include "kernels/bias.h"
#include "kernels/elementwise.h"
#include "kernels/layout.h"

namespace cudp::kernels {
namespace detail {

void check_bias_args(const char* op, const void* matrix, const void* bias, int64_t rows,
                     int64_t cols) {
  CUDP_CHECK(rows >= 0 && cols >= 0, op, ": rows and cols must be >= 0, got ", rows, " x ", cols);
  detail::check_elementwise(op, rows * cols, {matrix});
  detail::check_elementwise(op, cols, {bias});
}

void check_relu_mask_args(const char* op, const void* y, const void* dy, const void* dy_masked,
                          const void* dbias, int64_t rows, int64_t cols) {
  CUDP_CHECK(rows >= 0 && cols >= 0, op, ": rows and cols must be >= 0, got ", rows, " x ", cols);
  detail::check_elementwise(op, rows * cols, {y, dy, dy_masked});
  if (dbias != nullptr) {
    detail::check_elementwise(op, cols, {dbias});
  }
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

namespace {

float as_float(float x) {
  return x;
}
float as_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T>
T from_float(float x);
template <>
float from_float<float>(float x) {
  return x;
}
template <>
__nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
void column_sums(const T* dy, float* dbias, int64_t rows, int64_t cols, float beta) {
  std::vector<double> sum(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      sum[c] += as_float(dy[r * cols + c]);
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    const double old = beta == 0.0f ? 0.0 : static_cast<double>(beta) * dbias[c];
    dbias[c] = static_cast<float>(old + sum[c]);
  }
}

}  // namespace

void bias_grad_cpu(const float* dy, float* dbias, int64_t rows, int64_t cols, float beta) {
  detail::check_bias_args("bias_grad_cpu", dy, dbias, rows, cols);
  column_sums(dy, dbias, rows, cols, beta);
}

void bias_grad_cpu(const __nv_bfloat16* dy, float* dbias, int64_t rows, int64_t cols, float beta) {
  detail::check_bias_args("bias_grad_cpu", dy, dbias, rows, cols);
  column_sums(dy, dbias, rows, cols, beta);
}

template <typename T>
void relu_mask_bias_grad_cpu(const T* y, const T* dy, T* dy_masked, float* dbias, int64_t rows,
                             int64_t cols, float beta) {
  detail::check_relu_mask_args("relu_mask_bias_grad_cpu", y, dy, dy_masked, dbias, rows, cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    dy_masked[i] = from_float<T>(detail::relu_grad(as_float(y[i]), as_float(dy[i])));
  }
  if (dbias != nullptr) {
    column_sums(dy_masked, dbias, rows, cols, beta);
  }
}

void relu_mask_bias_grad_cpu(const float* y, const float* dy, __nv_bfloat16* dy_masked,
                             float* dbias, int64_t rows, int64_t cols, float beta) {
  detail::check_relu_mask_args("relu_mask_bias_grad_cpu", y, dy, dy_masked, dbias, rows, cols);
  std::vector<float> masked(static_cast<size_t>(rows * cols));
  relu_mask_bias_grad_cpu(y, dy, masked.data(), dbias, rows, cols, beta);  // sums the fp32 values
  f32_to_bf16_cpu(masked.data(), dy_masked, rows * cols);
}

template void relu_mask_bias_grad_cpu<float>(const float*, const float*, float*, float*, int64_t,
                                             int64_t, float);
template void relu_mask_bias_grad_cpu<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*,
                                                     __nv_bfloat16*, float*, int64_t, int64_t,
                                                     float);

}  // namespace cudp::kernels
