// CPU references of elementwise.h: plain loops over the shared per-element formulas.
#include <algorithm>
#include <cmath>

#include "engine/core/error.h"
#include "kernels/elementwise.h"

namespace cudp::kernels {
namespace detail {

void check_zero_ranges(const char* op, const float* base, const FloatRange* ranges, int64_t count) {
  CUDP_CHECK(count >= 0, op, ": count must be >= 0, got ", count);
  CUDP_CHECK(count == 0 || ranges != nullptr, op, ": the ranges are null while count = ", count);
  bool any = false;
  for (int64_t r = 0; r < count; ++r) {
    CUDP_CHECK(ranges[r].begin >= 0 && ranges[r].begin <= ranges[r].end, op, ": range ", r, " [",
               ranges[r].begin, ", ", ranges[r].end, ") is not 0 <= begin <= end");
    any = any || ranges[r].end > ranges[r].begin;
  }
  CUDP_CHECK(!any || base != nullptr, op, ": the buffer is null while a range is not empty");
}

void check_spans(const char* op, const FloatSpan* spans, int64_t count, const int* flags) {
  CUDP_CHECK(count >= 0, op, ": count must be >= 0, got ", count);
  CUDP_CHECK(count == 0 || (spans != nullptr && flags != nullptr), op,
             ": the spans or the flags are null while count = ", count);
  for (int64_t i = 0; i < count; ++i) {
    CUDP_CHECK(spans[i].size >= 0, op, ": span ", i, " has size ", spans[i].size,
               "; sizes must be >= 0");
    CUDP_CHECK(spans[i].size == 0 || spans[i].data != nullptr, op, ": span ", i,
               " is null with size ", spans[i].size);
  }
}

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

void zero_ranges_cpu(float* base, const FloatRange* ranges, int64_t count) {
  detail::check_zero_ranges("zero_ranges_cpu", base, ranges, count);
  for (int64_t r = 0; r < count; ++r) {
    std::fill(base + ranges[r].begin, base + ranges[r].end, 0.0f);
  }
}

void flag_non_finite_cpu(const FloatSpan* spans, int64_t count, int* flags) {
  detail::check_spans("flag_non_finite_cpu", spans, count, flags);
  for (int64_t i = 0; i < count; ++i) {
    const float* v = spans[i].data;
    if (!std::all_of(v, v + spans[i].size, [](float x) { return std::isfinite(x); })) flags[i] = 1;
  }
}

}  // namespace cudp::kernels
