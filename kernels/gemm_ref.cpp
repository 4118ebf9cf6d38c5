// The CPU reference of gemm() (kernels/gemm.h) and the argument checks both paths share.
//
// The reference accumulates in double and rounds once, so it is the tests' oracle. Its innermost
// loop runs over contiguous memory for either layout of B (a row update when B is stored k x n, a
// dot product when B is stored n x k), which keeps the VGG-sized references of the GPU tests to
// seconds.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/core/error.h"
#include "kernels/gemm.h"

namespace cudp::kernels {
namespace detail {

void check_gemm_args(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* A,
                     int lda, const float* B, int ldb, float* C, int ldc) {
  CUDP_CHECK(m >= 0, "gemm: m must be >= 0, got ", m);
  CUDP_CHECK(n >= 0, "gemm: n must be >= 0, got ", n);
  CUDP_CHECK(k >= 0, "gemm: k must be >= 0, got ", k);
  // BLAS convention: a leading dimension is at least the stored row length, and at least 1.
  const int a_row = trans_a ? m : k;
  CUDP_CHECK(lda >= std::max(1, a_row), "gemm: lda = ", lda, " is smaller than the rows of A (",
             trans_a ? "A is stored k x m with trans_a, m = " : "A is stored m x k, k = ", a_row,
             ")");
  const int b_row = trans_b ? k : n;
  CUDP_CHECK(ldb >= std::max(1, b_row), "gemm: ldb = ", ldb, " is smaller than the rows of B (",
             trans_b ? "B is stored n x k with trans_b, k = " : "B is stored k x n, n = ", b_row,
             ")");
  CUDP_CHECK(ldc >= std::max(1, n), "gemm: ldc = ", ldc, " is smaller than the rows of C (n = ", n,
             ")");
  if (m > 0 && n > 0) {
    CUDP_CHECK(C != nullptr, "gemm: C is null for a ", m, " x ", n, " output");
    if (k > 0 && alpha != 0.f) {
      CUDP_CHECK(A != nullptr, "gemm: A is null for a ", m, " x ", k, " operand");
      CUDP_CHECK(B != nullptr, "gemm: B is null for a ", k, " x ", n, " operand");
    }
  }
}

}  // namespace detail

void gemm_cpu(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* A, int lda,
              const float* B, int ldb, float beta, float* C, int ldc) {
  detail::check_gemm_args(trans_a, trans_b, m, n, k, alpha, A, lda, B, ldb, C, ldc);
  if (m == 0 || n == 0) return;                // nothing to write, and A or B may be null
  const bool product = k > 0 && alpha != 0.f;  // BLAS: alpha == 0 reads neither A nor B
  std::vector<double> a_row(static_cast<size_t>(k));
  std::vector<double> acc(static_cast<size_t>(n));
  for (int i = 0; i < m; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0);
    if (product) {
      for (int p = 0; p < k; ++p) {
        a_row[p] =
            trans_a ? A[static_cast<int64_t>(p) * lda + i] : A[static_cast<int64_t>(i) * lda + p];
      }
      if (!trans_b) {
        for (int p = 0; p < k; ++p) {
          const float* b = B + static_cast<int64_t>(p) * ldb;
          const double a = a_row[p];
          for (int j = 0; j < n; ++j) acc[j] += a * b[j];
        }
      } else {
        for (int j = 0; j < n; ++j) {
          const float* b = B + static_cast<int64_t>(j) * ldb;
          double sum = 0.0;
          for (int p = 0; p < k; ++p) sum += a_row[p] * b[p];
          acc[j] = sum;
        }
      }
    }
    float* c = C + static_cast<int64_t>(i) * ldc;
    for (int j = 0; j < n; ++j) {
      const double scaled = static_cast<double>(alpha) * acc[j];
      c[j] = static_cast<float>(beta == 0.f ? scaled : scaled + static_cast<double>(beta) * c[j]);
    }
  }
}

}  // namespace cudp::kernels
