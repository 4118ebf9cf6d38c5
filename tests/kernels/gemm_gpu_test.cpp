// GPU tests of the GEMM (kernels/gemm.h): gemm() against the CPU reference on fresh random inputs
// of odd sizes, every transpose combination, alpha/beta, padded leading dimensions and misaligned
// pointers; every kernel variant (tile height x split-K) forced through gemm_with_plan(); the
// VGG-16 classifier's products against cuBLAS; BLAS's rules on NaN in unread operands; determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "common/compare.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "engine/core/vendor_check.h"
#include "kernels/gemm.h"

namespace cudp::kernels {
namespace {

using detail::GemmPlan;
using testing::DeviceBuffer;
using testing::kPoison;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Tolerance. Every output is alpha times a sum of k products of inputs in [-1, 1). The kernel
// accumulates in fp32 (one rounding per FMA, unit roundoff u = 2^-24): step i perturbs the running
// sum by at most u·|s_i|, and for random-sign products |s_i| ~ sqrt(i)/3, so the accumulated error
// is a random walk of standard deviation ~ u·k/7. atol = 2u·(|alpha|·k + |beta|) is ~14 of those
// standard deviations (split-K only shortens the chains), so a correct kernel never trips it, while
// one wrong or missing product (|a·b| ~ 0.25 on average) exceeds it for any k up to ~10^5. rtol
// covers the few roundings of the alpha/beta epilogue.
constexpr double kRtol = 1e-5;
double gemm_atol(int k, float alpha, float beta) {
  return 2.0 * std::ldexp(1.0, -24) * (std::fabs(alpha) * k + std::fabs(beta));
}
// Against cuBLAS both sides carry such an error: the bound doubles.
double cublas_atol(int k, float alpha, float beta) {
  return 2.0 * gemm_atol(k, alpha, beta);
}

// One product C = alpha op(A) op(B) + beta C with its host operands. Buffers hold every row at its
// full leading dimension, after `offset` leading floats (offset 1 makes the pointers misaligned for
// 16-byte access). C's padding columns hold kPoison and must keep it. With beta = 0, C itself holds
// kPoison too: the kernel must write every element.
struct Problem {
  bool ta = false, tb = false;
  int m = 0, n = 0, k = 0;
  float alpha = 1.f, beta = 0.f;
  int lda = 0, ldb = 0, ldc = 0, offset = 0;
  std::vector<float> a, b, c0;

  Problem(bool ta_, bool tb_, int m_, int n_, int k_, float alpha_, float beta_, int pad,
          uint64_t seed, int offset_ = 0)
      : ta(ta_), tb(tb_), m(m_), n(n_), k(k_), alpha(alpha_), beta(beta_), offset(offset_) {
    lda = std::max(1, (ta ? m : k) + pad);
    ldb = std::max(1, (tb ? k : n) + pad);
    ldc = std::max(1, n + pad);
    a = testing::random_vector(offset + size_t(ta ? k : m) * lda, seed);
    b = testing::random_vector(offset + size_t(tb ? n : k) * ldb, seed + 1);
    c0.assign(offset + size_t(m) * ldc, kPoison);
    if (beta != 0.f) {
      const std::vector<float> values = testing::random_vector(size_t(m) * ldc, seed + 2);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) c0[offset + size_t(i) * ldc + j] = values[size_t(i) * ldc + j];
      }
    }
  }

  // The whole C buffer as the CPU reference leaves it.
  std::vector<float> cpu() const {
    std::vector<float> c = c0;
    gemm_cpu(ta, tb, m, n, k, alpha, a.data() + offset, lda, b.data() + offset, ldb, beta,
             c.data() + offset, ldc);
    return c;
  }

  // The whole C buffer after gemm() (or gemm_with_plan() when a plan is given).
  std::vector<float> gpu(const std::optional<GemmPlan>& plan = std::nullopt) const {
    DeviceBuffer<float> da(a), db(b), dc(c0);
    run(da.get(), db.get(), dc.get(), plan);
    return dc.download();
  }

  void run(const float* da, const float* db, float* dc, const std::optional<GemmPlan>& plan) const {
    if (plan) {
      detail::gemm_with_plan(*plan, ta, tb, m, n, k, alpha, da + offset, lda, db + offset, ldb,
                             beta, dc + offset, ldc, nullptr);
    } else {
      gemm(ta, tb, m, n, k, alpha, da + offset, lda, db + offset, ldb, beta, dc + offset, ldc,
           nullptr);
    }
  }
};

::testing::Message describe(const Problem& p) {
  return ::testing::Message() << "trans_a " << p.ta << " trans_b " << p.tb << " m " << p.m << " n "
                              << p.n << " k " << p.k << " alpha " << p.alpha << " beta " << p.beta
                              << " lda " << p.lda << " ldb " << p.ldb << " ldc " << p.ldc
                              << " offset " << p.offset;
}

void expect_matches_cpu(const Problem& p, const std::optional<GemmPlan>& plan = std::nullopt) {
  EXPECT_ALL_CLOSE(p.gpu(plan), p.cpu(), kRtol, gemm_atol(p.k, p.alpha, p.beta));
}

// cuBLAS SGEMM as the oracle, with TF32 and every other shortcut off (pedantic math). cuBLAS is
// column-major: a row-major X is its column-major X^T, so row-major C = op(A) op(B) is computed as
// column-major C^T = op(B)^T op(A)^T, i.e. cuBLAS's product with the operands swapped.
class Cublas {
 public:
  Cublas() {
    CUDP_CUBLAS_CHECK(cublasCreate(&handle_));
    CUDP_CUBLAS_CHECK(cublasSetMathMode(handle_, CUBLAS_PEDANTIC_MATH));
  }
  ~Cublas() { cublasDestroy(handle_); }
  Cublas(const Cublas&) = delete;
  Cublas& operator=(const Cublas&) = delete;

  void gemm(const Problem& p, const float* da, const float* db, float* dc) {
    CUDP_CUBLAS_CHECK(cublasSgemm(
        handle_, p.tb ? CUBLAS_OP_T : CUBLAS_OP_N, p.ta ? CUBLAS_OP_T : CUBLAS_OP_N, p.n, p.m, p.k,
        &p.alpha, db + p.offset, p.ldb, da + p.offset, p.lda, &p.beta, dc + p.offset, p.ldc));
  }

 private:
  cublasHandle_t handle_ = nullptr;
};

// Runs ours and cuBLAS on the same device operands; returns {ours, cuBLAS}.
std::pair<std::vector<float>, std::vector<float>> ours_and_cublas(const Problem& p) {
  DeviceBuffer<float> da(p.a), db(p.b), ours(p.c0), theirs(p.c0);
  p.run(da.get(), db.get(), ours.get(), std::nullopt);
  Cublas cublas;
  cublas.gemm(p, da.get(), db.get(), theirs.get());
  return {ours.download(), theirs.download()};
}

constexpr int kOddSizes[] = {1, 3, 5, 7, 9, 17, 33, 127, 129};

TEST(GemmGpu, OddSizesAllTransposesMatchCpu) {
  CUDP_REQUIRE_GPU();
  uint64_t seed = 100;
  constexpr int kCount = std::size(kOddSizes);
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      for (int im = 0; im < kCount; ++im) {
        for (int in = 0; in < kCount; ++in) {
          // k walks through the sizes too, so that every size appears in every position.
          const int m = kOddSizes[im], n = kOddSizes[in], k = kOddSizes[(im + 2 * in) % kCount];
          for (const auto& [alpha, beta] : {std::pair{1.f, 0.f}, std::pair{-0.75f, 1.5f}}) {
            const int pad = (im + in) % 3;  // leading dimensions equal to or larger than the rows
            const Problem p(ta, tb, m, n, k, alpha, beta, pad, seed += 3);
            SCOPED_TRACE(describe(p));
            expect_matches_cpu(p);
          }
        }
      }
    }
  }
}

TEST(GemmGpu, EveryKernelVariantMatchesCpu) {
  CUDP_REQUIRE_GPU();
  // Shapes with partial tiles in m, n and k; k split into 1, 2, 3 and 7 chunks; both tile heights.
  const int shapes[][3] = {
      {129, 131, 77}, {65, 257, 300}, {1, 5, 1000}, {200, 64, 8}, {64, 128, 64}};
  uint64_t seed = 5000;
  for (int tile_m : {64, 128}) {
    for (int splits : {1, 2, 3, 7}) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          for (const auto& s : shapes) {
            const Problem p(ta, tb, s[0], s[1], s[2], 1.25f, splits % 2 ? 0.f : -0.5f, splits % 3,
                            seed += 3);
            const GemmPlan plan = detail::make_gemm_plan(tile_m, splits, p.k);
            SCOPED_TRACE(describe(p) << " tile_m " << tile_m << " splits " << plan.splits);
            expect_matches_cpu(p, plan);
          }
        }
      }
    }
  }
}

TEST(GemmGpu, VectorAndScalarLoadPathsMatchCpu) {
  CUDP_REQUIRE_GPU();
  uint64_t seed = 9000;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      // Aligned pointers and leading dimensions that are multiples of 4: 16-byte loads and stores.
      // Then leading dimensions that are not, then misaligned pointers: the element-wise path.
      for (const auto& [pad, offset] :
           {std::pair{0, 0}, std::pair{4, 0}, std::pair{1, 0}, std::pair{0, 1}, std::pair{3, 1}}) {
        for (const float beta : {0.f, 1.f}) {
          const Problem p(ta, tb, 256, 384, 264, 1.f, beta, pad, seed += 3, offset);
          SCOPED_TRACE(describe(p));
          expect_matches_cpu(p);
          expect_matches_cpu(p, detail::make_gemm_plan(64, 3, p.k));  // split-K too
        }
      }
    }
  }
}

TEST(GemmGpu, BetaZeroDoesNotReadC) {
  CUDP_REQUIRE_GPU();
  // C full of NaN: any read of it with beta == 0 would leave NaN in the result.
  for (const std::optional<GemmPlan>& plan :
       {std::optional<GemmPlan>{}, std::optional{detail::make_gemm_plan(128, 1, 300)},
        std::optional{detail::make_gemm_plan(64, 5, 300)}}) {
    for (int ta = 0; ta < 2; ++ta) {
      Problem p(ta, true, 70, 130, 300, 1.f, 0.f, 2, 77);
      std::fill(p.c0.begin(), p.c0.end(), kNaN);
      std::vector<float> expected = p.cpu();
      std::vector<float> actual = p.gpu(plan);
      // Compare the written elements only: the padding keeps its NaN.
      for (int i = 0; i < p.m; ++i) {
        for (int j = p.n; j < p.ldc; ++j) {
          const size_t at = size_t(i) * p.ldc + j;
          EXPECT_TRUE(std::isnan(actual[at])) << "padding written at row " << i << " column " << j;
          expected[at] = actual[at] = 0.f;
        }
      }
      SCOPED_TRACE(describe(p) << (plan ? " forced plan" : " default plan"));
      EXPECT_ALL_CLOSE(actual, expected, kRtol, gemm_atol(p.k, p.alpha, p.beta));
    }
  }
}

TEST(GemmGpu, AlphaZeroDoesNotReadAOrB) {
  CUDP_REQUIRE_GPU();
  Problem p(false, false, 65, 129, 4000, 0.f, 0.5f, 0, 78);  // a shape that would split k
  std::fill(p.a.begin(), p.a.end(), kNaN);
  std::fill(p.b.begin(), p.b.end(), kNaN);
  const std::vector<float> actual = p.gpu();
  for (size_t i = 0; i < actual.size(); ++i) ASSERT_EQ(actual[i], 0.5f * p.c0[i]) << "at " << i;
}

TEST(GemmGpu, KZeroScalesC) {
  CUDP_REQUIRE_GPU();
  for (const float beta : {0.f, -2.f}) {
    const Problem p(false, false, 33, 17, 0, 1.f, beta, 1, 79);
    const std::vector<float> actual = p.gpu();
    const std::vector<float> expected = p.cpu();
    for (size_t i = 0; i < actual.size(); ++i) ASSERT_EQ(actual[i], expected[i]) << "at " << i;
  }
}

TEST(GemmGpu, MatchesCublasOnLargeOddShapes) {
  CUDP_REQUIRE_GPU();
  uint64_t seed = 300;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      for (const auto& s : {std::array{1021, 1027, 1031}, std::array{1024, 1024, 1024}}) {
        const Problem p(ta, tb, s[0], s[1], s[2], 1.5f, -0.5f, 0, seed += 3);
        SCOPED_TRACE(describe(p));
        const auto [ours, theirs] = ours_and_cublas(p);
        EXPECT_ALL_CLOSE(ours, theirs, 2 * kRtol, cublas_atol(p.k, p.alpha, p.beta));
      }
    }
  }
}

// The products of VGG-16's classifier at batch 64 (Linear 25088->4096, 4096->4096, 4096->1000):
// forward Y = X W^T, backward-data dX = dY W, backward-weight dW += dY^T X.
struct LinearProduct {
  const char* what;
  bool ta, tb;
  int m, n, k;
  float beta;
};

std::vector<LinearProduct> vgg_classifier_products() {
  std::vector<LinearProduct> products;
  for (const auto& [in, out] :
       {std::pair{25088, 4096}, std::pair{4096, 4096}, std::pair{4096, 1000}}) {
    products.push_back({"forward", false, true, 64, out, in, 0.f});
    products.push_back({"backward-data", false, false, 64, in, out, 0.f});
    products.push_back({"backward-weight", true, false, out, in, 64, 1.f});
  }
  return products;
}

TEST(GemmGpu, VggClassifierShapesMatchCublasAndCpu) {
  CUDP_REQUIRE_GPU();
  uint64_t seed = 400;
  for (const LinearProduct& lp : vgg_classifier_products()) {
    const Problem p(lp.ta, lp.tb, lp.m, lp.n, lp.k, 1.f, lp.beta, 0, seed += 3);
    SCOPED_TRACE(::testing::Message() << lp.what << ": " << describe(p));
    const auto [ours, theirs] = ours_and_cublas(p);
    EXPECT_ALL_CLOSE(ours, theirs, 2 * kRtol, cublas_atol(p.k, p.alpha, p.beta));
    // The CPU reference on a sample of rows (the first, the last, both sides of the tile boundaries
    // at 64 and 128, and a few more): the full reference would take minutes at k = 25088.
    std::vector<float> ours_rows, cpu_rows;
    for (const int i : {0, 1, 63, 64, 127, 128, p.m / 2 + 1, p.m - 1}) {
      if (i >= p.m) continue;
      std::vector<float> row(p.c0.begin() + size_t(i) * p.ldc,
                             p.c0.begin() + size_t(i + 1) * p.ldc);
      const float* a_row = p.ta ? p.a.data() + i : p.a.data() + size_t(i) * p.lda;
      gemm_cpu(p.ta, p.tb, 1, p.n, p.k, p.alpha, a_row, p.lda, p.b.data(), p.ldb, p.beta,
               row.data(), p.ldc);
      cpu_rows.insert(cpu_rows.end(), row.begin(), row.end());
      ours_rows.insert(ours_rows.end(), ours.begin() + size_t(i) * p.ldc,
                       ours.begin() + size_t(i + 1) * p.ldc);
    }
    EXPECT_ALL_CLOSE(ours_rows, cpu_rows, kRtol, gemm_atol(p.k, p.alpha, p.beta));
  }
}

TEST(GemmGpu, ResultsAreBitwiseDeterministic) {
  CUDP_REQUIRE_GPU();
  // Split-K among them: the first classifier layer's forward at batch 64.
  const Problem problems[] = {Problem(false, true, 64, 4096, 25088, 1.f, 0.f, 0, 500),
                              Problem(false, false, 1024, 1024, 1024, 1.f, 0.5f, 0, 501),
                              Problem(true, true, 127, 129, 3001, -1.f, 0.f, 3, 502)};
  for (const Problem& p : problems) {
    SCOPED_TRACE(describe(p));
    DeviceBuffer<float> da(p.a), db(p.b), dc(p.c0);
    std::vector<std::vector<float>> runs;
    for (int run = 0; run < 3; ++run) {
      dc.upload(p.c0);
      p.run(da.get(), db.get(), dc.get(), std::nullopt);
      runs.push_back(dc.download());
    }
    for (int run = 1; run < 3; ++run) {
      EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[run].data(), runs[0].size() * sizeof(float)))
          << "run " << run << " differs from run 0";
    }
  }
}

TEST(GemmGpu, RunsOnANonDefaultStream) {
  CUDP_REQUIRE_GPU();
  const Problem p(false, true, 64, 1000, 4096, 1.f, 0.f, 0,
                  600);  // split-K: workspace on the stream
  DeviceBuffer<float> da(p.a), db(p.b), dc(p.c0);
  // A non-blocking stream does not wait for the legacy stream's uploads: finish them first.
  CUDP_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t stream = nullptr;
  CUDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  gemm(p.ta, p.tb, p.m, p.n, p.k, p.alpha, da.get(), p.lda, db.get(), p.ldb, p.beta, dc.get(),
       p.ldc, stream);
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDP_CUDA_CHECK(cudaStreamDestroy(stream));
  EXPECT_ALL_CLOSE(dc.download(), p.cpu(), kRtol, gemm_atol(p.k, p.alpha, p.beta));
}

}  // namespace
}  // namespace cudp::kernels
