// The CPU reference of kernels/matmul.h: double accumulation of the operands as stored.
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/core/error.h"
#include "kernels/conv2d_dense.h"
#include "kernels/layout.h"
#include "kernels/matmul.h"

namespace cudp::kernels {
namespace {

double load(const void* base, int64_t index, bool bf16) {
  if (bf16) {
    uint16_t bits;
    std::memcpy(&bits, static_cast<const uint16_t*>(base) + index, sizeof bits);
    const uint32_t wide = uint32_t(bits) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof value);
    return value;
  }
  return static_cast<const float*>(base)[index];
}

}  // namespace

void matmul_cpu(const MatmulProblem& p) {
  CUDP_CHECK(p.math != Math::FP32, "matmul_cpu: Math::FP32 products are gemm_cpu's");
  CUDP_CHECK(p.m >= 0 && p.n >= 0 && p.k >= 0, "matmul_cpu: negative size");
  if (p.m == 0 || p.n == 0) return;
  CUDP_CHECK(p.c != nullptr && p.ldc >= p.n, "matmul_cpu: bad C");
  CUDP_CHECK(
      p.k == 0 || (p.a != nullptr && p.b != nullptr && p.lda >= (p.a_transposed ? p.m : p.k) &&
                   p.ldb >= (p.b_transposed ? p.n : p.k)),
      "matmul_cpu: bad A or B");
  // Element (i, l) of A as m x k: at i * lda + l, or at l * lda + i when A is stored k x m.
  const int64_t a_row = p.a_transposed ? 1 : p.lda, a_col = p.a_transposed ? p.lda : 1;
  // Element (j, l) of B as n x k: at j * ldb + l, or at l * ldb + j when B is stored k x n; or, in
  // the dense 2 x 2 view, W_eff's element (row, column) of the filters (kernels/conv2d_dense.h).
  const int64_t b_row = p.b_transposed ? 1 : p.ldb, b_col = p.b_transposed ? p.ldb : 1;
  const bool dense = p.b_dense_k > 0;
  CUDP_CHECK(!dense || (p.b_dense_c > 0 && p.ldb == 9 * int64_t{p.b_dense_c} &&
                        (p.b_transposed ? p.k : p.n) == 4 * p.b_dense_k &&
                        (p.b_transposed ? p.n : p.k) == 4 * p.b_dense_c),
             "matmul_cpu: bad dense 2x2 view of B");
  const auto b_at = [&](int64_t j, int64_t l) {
    if (!dense) return j * b_row + l * b_col;
    const int64_t row = p.b_transposed ? l : j, col = p.b_transposed ? j : l;
    const int64_t pp = row / p.b_dense_k, q = col / p.b_dense_c;
    const int64_t tap = dense_2x2_tap(int(pp), int(q));
    return (row - pp * p.b_dense_k) * p.ldb + tap * p.b_dense_c + (col - q * p.b_dense_c);
  };
  const bool bf16 = p.math == Math::BF16;
  const bool c_bf16 = p.c_type == DType::BF16;
  for (int i = 0; i < p.m; ++i) {
    for (int j = 0; j < p.n; ++j) {
      double acc = 0;
      for (int l = 0; l < p.k; ++l) {
        acc += load(p.a, i * a_row + l * a_col, bf16) * load(p.b, b_at(j, l), bf16);
      }
      const int64_t at = int64_t(i) * p.ldc + j;
      double v = double(p.alpha) * acc;
      if (p.beta != 0.f) v += double(p.beta) * load(p.c, at, c_bf16);
      if (p.bias != nullptr) v += p.bias[p.bias_period > 0 ? j % p.bias_period : j];
      if (p.relu && v <= 0.0) v = 0.0;  // NaN kept, -0 to +0, as kernels/elementwise.h
      if (c_bf16) {
        static_cast<uint16_t*>(p.c)[at] = detail::f32_to_bf16_bits(static_cast<float>(v));
      } else {
        static_cast<float*>(p.c)[at] = static_cast<float>(v);
      }
    }
  }
}

}  // namespace cudp::kernels
