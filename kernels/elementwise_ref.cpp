// CPU references of elementwise.h: plain loops over the shared per-element formulas.
#include "engine/core/error.h"
#include "kernels/elementwise.h"

namespace cudp::kernels {
namespace detail {

void check_elementwise(const char* op, int64_t n, std::initializer_list<const void*> pointers) {
  CUDP_CHECK(n >= 0, op, ": n must be >= 0, got ", n);
  for (const void* p : pointers) {
    CUDP_CHECK(n == 0 || p != nullptr, op, ": a pointer is null while n = ", n);
  }
}

}  // namespace detail

void relu_forward_cpu(const float* x, float* y, int64_t n) {
  detail::check_elementwise("relu_forward_cpu", n, {x, y});
  for (int64_t i = 0; i < n; ++i) {
    y[i] = detail::relu(x[i]);
  }
}

void relu_forward_cpu(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t n) {
  detail::check_elementwise("relu_forward_cpu", n, {x, y});
  for (int64_t i = 0; i < n; ++i) {
    y[i] = __float2bfloat16_rn(detail::relu(__bfloat162float(x[i])));
  }
}

void relu_backward_cpu(const __nv_bfloat16* y, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                       int64_t n) {
  detail::check_elementwise("relu_backward_cpu", n, {y, dy, dx});
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = __float2bfloat16_rn(detail::relu_grad(__bfloat162float(y[i]), __bfloat162float(dy[i])));
  }
}

void relu_backward_cpu(const float* y, const float* dy, float* dx, int64_t n) {
  detail::check_elementwise("relu_backward_cpu", n, {y, dy, dx});
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = detail::relu_grad(y[i], dy[i]);
  }
}

void scale_cpu(float* x, float alpha, int64_t n) {
  detail::check_elementwise("scale_cpu", n, {x});
  for (int64_t i = 0; i < n; ++i) {
    x[i] = alpha * x[i];
  }
}

void axpy_cpu(float alpha, const float* x, float* y, int64_t n) {
  detail::check_elementwise("axpy_cpu", n, {x, y});
  for (int64_t i = 0; i < n; ++i) {
    y[i] = detail::axpy(alpha, x[i], y[i]);
  }
}

void add_cpu(const float* a, const float* b, float* out, int64_t n) {
  detail::check_elementwise("add_cpu", n, {a, b, out});
  for (int64_t i = 0; i < n; ++i) {
    out[i] = a[i] + b[i];
  }
}

}  // namespace cudp::kernels
