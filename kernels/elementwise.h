// Element-wise fp32 kernels: ReLU forward and backward, scale, axpy, add, and zero_ranges.
//
// These are pure bandwidth: one pass over memory, a handful of flops per element. The CUDA versions
// move 16 bytes per load and store (float4) whenever the pointers allow it (all of them with the
// same offset from a 16-byte boundary: a scalar head up to that boundary, float4 in the middle, a
// scalar tail), and fall back to one float at a time otherwise; either way grid-stride loops cover
// any n. n == 0 is a no-op; n < 0 or a null pointer with n > 0 throws ValueError.
//
// Aliasing: every output may alias an input of the same element (y == x in relu_forward, dx == dy
// in relu_backward, out == a or b in add), because each element is read and then written by the
// same thread. Partial overlaps (y == x + 1) are not supported.
//
// The per-element formulas live in detail:: below, shared by the kernels and the CPU references, so
// that both give the same bits: one IEEE operation each (axpy is one fused multiply-add).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "kernels/common.h"

namespace cudp::kernels {

// y = max(x, 0), with NaN propagated (as torch.relu does) and -0 mapped to +0. y may alias x.
void relu_forward(const float* x, float* y, int64_t n, cudaStream_t stream);
void relu_forward_cpu(const float* x, float* y, int64_t n);

// dx = dy where y > 0, else 0, with y the *output* of relu_forward (not its input): y > 0 exactly
// where x > 0, and taking y lets the forward run in place (x overwritten) and its backward still
// work. A NaN in y passes dy through (PyTorch's threshold_backward does the same). dx may alias dy.
void relu_backward(const float* y, const float* dy, float* dx, int64_t n, cudaStream_t stream);
void relu_backward_cpu(const float* y, const float* dy, float* dx, int64_t n);

// x *= alpha, in place.
// bf16 storage (the bf16 precision policy): the same ops on bf16 values, exact (the result is one
// of the inputs or 0). dx may alias dy and y may alias x, as above.
void relu_forward(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t n, cudaStream_t stream);
void relu_forward_cpu(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t n);
void relu_backward(const __nv_bfloat16* y, const __nv_bfloat16* dy, __nv_bfloat16* dx, int64_t n,
                   cudaStream_t stream);
void relu_backward_cpu(const __nv_bfloat16* y, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                       int64_t n);

void scale(float* x, float alpha, int64_t n, cudaStream_t stream);
void scale_cpu(float* x, float alpha, int64_t n);

// y += alpha * x, as one fused multiply-add per element (fmaf(alpha, x, y)).
void axpy(float alpha, const float* x, float* y, int64_t n, cudaStream_t stream);
void axpy_cpu(float alpha, const float* x, float* y, int64_t n);

// out = a + b. out may alias a or b.
void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream);
void add_cpu(const float* a, const float* b, float* out, int64_t n);

// Elements [begin, end) of a buffer, in floats.
struct FloatRange {
  int64_t begin = 0, end = 0;
};

// base[i] = 0 for every i in the ranges: a flat gradient buffer's pieces that a deferred
// zero_grad writes (layers/module.h, NOTE [Deferred zeroing]), in one launch where a memset per
// piece would take one each. Ranges may be empty; each must have 0 <= begin <= end, or it throws
// ValueError naming the range. Ranges that overlap are zeroed alike.
void zero_ranges(float* base, const FloatRange* ranges, int64_t count, cudaStream_t stream);
void zero_ranges_cpu(float* base, const FloatRange* ranges, int64_t count);

// A tensor's floats, for flag_non_finite.
struct FloatSpan {
  const float* data = nullptr;
  int64_t size = 0;
};

// flags[i] = 1 where spans[i] holds a NaN or an infinity; the other flags are left as they were
// (the caller zeroes them first). One launch per 64 spans: a model's state checked at once (a
// trainer's checkpoint, layers/checkpoint.h) instead of a copy to the host to look at. A span
// with size > 0 needs data; a negative size throws ValueError naming the span.
void flag_non_finite(const FloatSpan* spans, int64_t count, int* flags, cudaStream_t stream);
void flag_non_finite_cpu(const FloatSpan* spans, int64_t count, int* flags);

namespace detail {

CUDP_HD inline float relu(float x) {
  return x <= 0.0f ? 0.0f : x;
}  // NaN: the comparison is false
CUDP_HD inline float relu_grad(float y, float dy) {
  return y <= 0.0f ? 0.0f : dy;
}
CUDP_HD inline float axpy(float alpha, float x, float y) {
  return fmaf(alpha, x, y);
}

// How an element-wise pass over n elements of several arrays splits for 4-element vector access
// (float4, or 4 bf16 in 8 bytes): `head` scalar elements until every array sits on a 4-element
// boundary at the same element, then `vectors` groups of 4, then the rest (< 4) as scalars. Arrays
// are given as (address of element 0, element size in bytes). Where they cannot reach a boundary
// together (different offsets, or an address not a multiple of its element size), head == n and
// vectors == 0: the whole pass is scalar. Shared by the element-wise launchers of kernels/.
struct VectorSplit {
  int64_t head;
  int64_t vectors;
};

inline VectorSplit vector_split(int64_t n,
                                std::initializer_list<std::pair<const void*, int>> arrays) {
  int64_t head = 0;
  bool first = true;
  for (const auto& [pointer, size] : arrays) {
    const auto address = reinterpret_cast<uintptr_t>(pointer);
    const uintptr_t width = 4u * static_cast<uintptr_t>(size);
    if (address % static_cast<uintptr_t>(size) != 0) {
      return {n, 0};
    }
    const auto h = static_cast<int64_t>((width - address % width) % width) / size;
    if (!first && h != head) {
      return {n, 0};
    }
    head = h;
    first = false;
  }
  head = std::min(head, n);
  return {head, (n - head) / 4};
}

// The argument checks every launcher and CPU reference of elementwise.h, bias.h, dropout.h and
// layout.h makes: n >= 0, and no null pointer unless n == 0. Throws ValueError naming `op`.
void check_elementwise(const char* op, int64_t n, std::initializer_list<const void*> pointers);
// zero_ranges' checks (above), for its launcher and its reference.
void check_zero_ranges(const char* op, const float* base, const FloatRange* ranges, int64_t count);
// flag_non_finite's checks.
void check_spans(const char* op, const FloatSpan* spans, int64_t count, const int* flags);

}  // namespace detail
}  // namespace cudp::kernels
