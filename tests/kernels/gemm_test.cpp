// Host tests of the GEMM (kernels/gemm.h) that need no GPU: the CPU reference against hand-computed
// values and an independent triple loop, the argument checks of gemm_cpu() and gemm(), and the
// plans (tile height, split-K) that gemm() would choose.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/expect_error.h"
#include "engine/core/error.h"
#include "kernels/gemm.h"

namespace cudp::kernels {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The textbook definition, written independently of gemm_cpu: every element of C (with its padding
// copied from c0) as a double.
std::vector<double> naive_gemm(bool ta, bool tb, int m, int n, int k, float alpha,
                               const std::vector<float>& a, int lda, const std::vector<float>& b,
                               int ldb, float beta, const std::vector<float>& c0, int ldc) {
  std::vector<double> c(c0.begin(), c0.end());
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int p = 0; p < k; ++p) {
        const double av = ta ? a[size_t(p) * lda + i] : a[size_t(i) * lda + p];
        const double bv = tb ? b[size_t(j) * ldb + p] : b[size_t(p) * ldb + j];
        sum += av * bv;
      }
      const double old = c0[size_t(i) * ldc + j];
      c[size_t(i) * ldc + j] = double(alpha) * sum + (beta == 0.f ? 0.0 : double(beta) * old);
    }
  }
  return c;
}

struct HandCase {
  bool ta, tb;
  std::vector<float> expected;  // op(A) * op(B) for A = [1 2; 3 4], B = [5 6; 7 8]
};

TEST(GemmCpu, HandComputed2x2AllTransposes) {
  const std::vector<float> a = {1, 2, 3, 4}, b = {5, 6, 7, 8};
  const HandCase cases[] = {{false, false, {19, 22, 43, 50}},
                            {true, false, {26, 30, 38, 44}},
                            {false, true, {17, 23, 39, 53}},
                            {true, true, {23, 31, 34, 46}}};
  for (const HandCase& hc : cases) {
    SCOPED_TRACE(::testing::Message() << "trans_a " << hc.ta << " trans_b " << hc.tb);
    std::vector<float> c(4, kNaN);
    gemm_cpu(hc.ta, hc.tb, 2, 2, 2, 1.f, a.data(), 2, b.data(), 2, 0.f, c.data(), 2);
    EXPECT_EQ(c, hc.expected);
    // alpha = 2, beta = -1 on C = 1: 2 * product - 1.
    std::vector<float> c2(4, 1.f), expected2;
    for (float e : hc.expected) expected2.push_back(2.f * e - 1.f);
    gemm_cpu(hc.ta, hc.tb, 2, 2, 2, 2.f, a.data(), 2, b.data(), 2, -1.f, c2.data(), 2);
    EXPECT_EQ(c2, expected2);
  }
}

TEST(GemmCpu, HandComputedRectangularWithLeadingDims) {
  // [1 2 3] (lda 4, a padding value that must be ignored) x [1 2; 3 4; 5 6] (ldb 3) = [22 28].
  const std::vector<float> a = {1, 2, 3, 99};
  const std::vector<float> b = {1, 2, 99, 3, 4, 99, 5, 6};
  std::vector<float> c = {kNaN, kNaN, 7.f};  // ldc 3: the third element is padding
  gemm_cpu(false, false, 1, 2, 3, 1.f, a.data(), 4, b.data(), 3, 0.f, c.data(), 3);
  EXPECT_EQ(c, (std::vector<float>{22.f, 28.f, 7.f}));
}

TEST(GemmCpu, MatchesNaiveOnRandomTinyCases) {
  const int dims[][3] = {{1, 1, 1}, {2, 3, 4}, {5, 1, 3}, {3, 7, 1}, {4, 4, 9}, {7, 5, 2}};
  const float scalars[][2] = {{1.f, 0.f}, {-0.5f, 0.75f}, {2.f, 1.f}};
  uint64_t seed = 11;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      for (const auto& d : dims) {
        for (const auto& s : scalars) {
          for (int pad : {0, 2}) {
            const int m = d[0], n = d[1], k = d[2];
            SCOPED_TRACE(::testing::Message()
                         << "ta " << ta << " tb " << tb << " m " << m << " n " << n << " k " << k
                         << " alpha " << s[0] << " beta " << s[1] << " pad " << pad);
            const int lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
            const auto a = testing::random_vector(size_t(ta ? k : m) * lda, seed++);
            const auto b = testing::random_vector(size_t(tb ? n : k) * ldb, seed++);
            const auto c0 = testing::random_vector(size_t(m) * ldc, seed++);
            std::vector<float> c = c0;
            gemm_cpu(ta, tb, m, n, k, s[0], a.data(), lda, b.data(), ldb, s[1], c.data(), ldc);
            // Same double arithmetic as the naive loop, then one rounding to fp32: within half an
            // ulp.
            EXPECT_ALL_CLOSE(c, naive_gemm(ta, tb, m, n, k, s[0], a, lda, b, ldb, s[1], c0, ldc),
                             1e-7, 1e-30);
          }
        }
      }
    }
  }
}

TEST(GemmCpu, BetaZeroIgnoresNaNInC) {
  const auto a = testing::random_vector(3 * 4, 1), b = testing::random_vector(4 * 5, 2);
  std::vector<float> c(3 * 5, kNaN);
  gemm_cpu(false, false, 3, 5, 4, 1.5f, a.data(), 4, b.data(), 5, 0.f, c.data(), 5);
  const std::vector<float> zeros(c.size(), 0.f);
  EXPECT_ALL_CLOSE(c, naive_gemm(false, false, 3, 5, 4, 1.5f, a, 4, b, 5, 0.f, zeros, 5), 1e-7,
                   1e-30);
}

TEST(GemmCpu, AlphaZeroReadsNeitherAnorB) {
  const std::vector<float> a(3 * 4, kNaN), b(4 * 5, kNaN);
  const auto c0 = testing::random_vector(3 * 5, 3);
  std::vector<float> c = c0;
  gemm_cpu(false, false, 3, 5, 4, 0.f, a.data(), 4, b.data(), 5, 0.5f, c.data(), 5);
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i], 0.5f * c0[i]) << "at " << i;
}

TEST(GemmCpu, KZeroScalesC) {
  const auto c0 = testing::random_vector(2 * 3, 4);
  std::vector<float> c = c0;
  gemm_cpu(false, false, 2, 3, 0, 1.f, nullptr, 1, nullptr, 3, -2.f, c.data(), 3);
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i], -2.f * c0[i]) << "at " << i;
}

TEST(GemmCpu, EmptyOutputTouchesNothing) {
  std::vector<float> c = {1.f, 2.f};
  gemm_cpu(false, false, 0, 2, 3, 1.f, nullptr, 3, nullptr, 2, 0.f, c.data(), 2);
  gemm_cpu(false, false, 2, 0, 3, 1.f, nullptr, 3, nullptr, 1, 0.f, c.data(), 1);
  EXPECT_EQ(c, (std::vector<float>{1.f, 2.f}));
}

TEST(GemmCpu, ArgumentErrorsThrowValueError) {
  std::vector<float> a(64, 1.f), b(64, 1.f), c(64, 0.f);
  const float* A = a.data();
  const float* B = b.data();
  float* C = c.data();
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, -1, 2, 2, 1.f, A, 2, B, 2, 0.f, C, 2),
                     "gemm: m must be >= 0, got -1");
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, 2, -3, 2, 1.f, A, 2, B, 2, 0.f, C, 2),
                     "gemm: n must be >= 0, got -3");
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, 2, 2, -4, 1.f, A, 2, B, 2, 0.f, C, 2),
                     "gemm: k must be >= 0, got -4");
  // A is m x k (lda >= k) or, transposed, k x m (lda >= m).
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, 2, 3, 5, 1.f, A, 4, B, 3, 0.f, C, 3),
                     "gemm: lda = 4 is smaller than the rows of A (A is stored m x k, k = 5)");
  EXPECT_VALUE_ERROR(
      gemm_cpu(true, false, 6, 3, 2, 1.f, A, 5, B, 3, 0.f, C, 3),
      "gemm: lda = 5 is smaller than the rows of A (A is stored k x m with trans_a, m = 6)");
  // B is k x n (ldb >= n) or, transposed, n x k (ldb >= k).
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, 2, 3, 5, 1.f, A, 5, B, 2, 0.f, C, 3),
                     "gemm: ldb = 2 is smaller than the rows of B (B is stored k x n, n = 3)");
  EXPECT_VALUE_ERROR(
      gemm_cpu(false, true, 2, 3, 5, 1.f, A, 5, B, 4, 0.f, C, 3),
      "gemm: ldb = 4 is smaller than the rows of B (B is stored n x k with trans_b, k = 5)");
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, 2, 3, 5, 1.f, A, 5, B, 3, 0.f, C, 2),
                     "gemm: ldc = 2 is smaller than the rows of C (n = 3)");
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, 2, 3, 0, 1.f, A, 0, B, 3, 0.f, C, 3),
                     "gemm: lda = 0");  // at least 1 even when k == 0 (the BLAS rule)
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, 2, 3, 5, 1.f, nullptr, 5, B, 3, 0.f, C, 3),
                     "gemm: A is null");
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, 2, 3, 5, 1.f, A, 5, nullptr, 3, 0.f, C, 3),
                     "gemm: B is null");
  EXPECT_VALUE_ERROR(gemm_cpu(false, false, 2, 3, 5, 1.f, A, 5, B, 3, 0.f, nullptr, 3),
                     "gemm: C is null");
}

// Tensor-core math (TF32, BF16) needs an sm_90 GPU: without one, gemm() says so and what to use
// instead, before touching memory. (With one, tests/kernels/matmul_gpu_test.cpp runs it.)
TEST(Gemm, TensorCoreMathWithoutAnSm90GpuSaysWhatToUse) {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0) {
      GTEST_SKIP() << "an sm_90 GPU is present: the GPU tests cover tensor-core math";
    }
  }
  cudaGetLastError();
  std::vector<float> a(4, 1.f), b(4, 1.f), c(4, 0.f);
  for (const Math math : {Math::TF32, Math::BF16}) {
    try {
      gemm(false, false, 2, 2, 2, 1.f, a.data(), 2, b.data(), 2, 0.f, c.data(), 2, nullptr, math);
      ADD_FAILURE() << "no error for math " << math_name(math);
    } catch (const ValueError& e) {
      EXPECT_NE(e.message().find("needs an sm_90 GPU"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("use Math::FP32"), std::string::npos) << e.message();
    }
  }
}

TEST(Gemm, ChecksArgumentsBeforeLaunching) {
  std::vector<float> a(16, 1.f), b(16, 1.f), c(16, 0.f);
  EXPECT_VALUE_ERROR(
      gemm(false, false, 2, -1, 2, 1.f, a.data(), 2, b.data(), 2, 0.f, c.data(), 2, nullptr),
      "gemm: n must be >= 0, got -1");
  EXPECT_VALUE_ERROR(
      gemm(false, true, 2, 2, 3, 1.f, a.data(), 3, b.data(), 2, 0.f, c.data(), 2, nullptr),
      "gemm: ldb = 2 is smaller than the rows of B");
}

TEST(GemmPlan, MakePlanNormalisesChunks) {
  for (int tile_m : {64, 128}) {
    for (int k : {0, 1, 7, 8, 9, 63, 64, 65, 100, 1000, 4096, 25088}) {
      for (int splits = 1; splits <= 40; ++splits) {
        const detail::GemmPlan plan = detail::make_gemm_plan(tile_m, splits, k);
        SCOPED_TRACE(::testing::Message()
                     << "tile_m " << tile_m << " k " << k << " splits " << splits << " -> "
                     << plan.splits << " x " << plan.k_chunk);
        EXPECT_EQ(plan.tile_m, tile_m);
        EXPECT_GE(plan.splits, 1);
        EXPECT_LE(plan.splits, splits);
        EXPECT_GE(int64_t(plan.splits) * plan.k_chunk, k);  // every k is covered
        if (plan.splits > 1) {
          EXPECT_EQ(plan.k_chunk % 8, 0);                         // chunks start 16-byte aligned
          EXPECT_LT(int64_t(plan.splits - 1) * plan.k_chunk, k);  // no split is empty
        }
      }
    }
  }
  EXPECT_VALUE_ERROR(detail::make_gemm_plan(32, 1, 8), "tile_m must be 64 or 128, got 32");
  EXPECT_VALUE_ERROR(detail::make_gemm_plan(64, 0, 8), "splits must be >= 1, got 0");
}

TEST(GemmPlan, LargeSquareProductsNeitherSplitNorShrink) {
  for (int size : {4096, 8192}) {
    const detail::GemmPlan plan = detail::plan_gemm(size, size, size, 132);
    EXPECT_EQ(plan.tile_m, 128) << size;
    EXPECT_EQ(plan.splits, 1) << size;
  }
  // Weight gradients of the VGG classifier (k = batch = 64): plenty of tiles, nothing to split.
  EXPECT_EQ(detail::plan_gemm(4096, 25088, 64, 132).splits, 1);
  EXPECT_EQ(detail::plan_gemm(4096, 4096, 64, 132).splits, 1);
}

TEST(GemmPlan, BatchSixtyFourLinearProductsFillTheGpu) {
  // m = 64 (the batch): 64-row tiles waste nothing, and split-K gives every SM work.
  const int sms = 132;
  const int shapes[][3] = {
      {64, 4096, 25088}, {64, 4096, 4096}, {64, 1000, 4096}, {64, 25088, 4096}, {64, 4096, 1000}};
  for (const auto& s : shapes) {
    const detail::GemmPlan plan = detail::plan_gemm(s[0], s[1], s[2], sms);
    SCOPED_TRACE(::testing::Message()
                 << s[0] << " x " << s[1] << " x " << s[2] << " -> tile " << plan.tile_m << ", "
                 << plan.splits << " x " << plan.k_chunk);
    EXPECT_EQ(plan.tile_m, 64);
    const int64_t blocks = int64_t((s[1] + 127) / 128) * plan.splits;
    EXPECT_GE(blocks, sms);
    EXPECT_EQ(plan.k_chunk, detail::make_gemm_plan(plan.tile_m, plan.splits, s[2]).k_chunk);
  }
}

TEST(GemmPlan, IsAPureFunctionOfTheShape) {
  for (int m : {1, 64, 129, 1000}) {
    for (int k : {0, 5, 64, 3000}) {
      const detail::GemmPlan a = detail::plan_gemm(m, 300, k, 132);
      const detail::GemmPlan b = detail::plan_gemm(m, 300, k, 132);
      EXPECT_EQ(a.tile_m, b.tile_m);
      EXPECT_EQ(a.splits, b.splits);
      EXPECT_EQ(a.k_chunk, b.k_chunk);
      EXPECT_EQ(a.splits, detail::make_gemm_plan(a.tile_m, a.splits, k).splits);  // normalised
    }
  }
}

}  // namespace
}  // namespace cudp::kernels
