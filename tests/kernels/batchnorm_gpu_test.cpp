// GPU tests of batch normalisation: training forward (with running statistics), evaluation and
// backward against the CPU reference and against cuDNN (CUDNN_BATCHNORM_SPATIAL, NHWC), numerical
// stability with a large mean, the accumulate semantics, and bitwise determinism; bf16 storage
// against the double reference rounded to bf16, the fused ReLU against ReLU's own kernels bit for
// bit, and the backward of an evaluation forward.
#include <cuda_runtime.h>  // before device_buffer.h: cudaMalloc(T**) for DeviceBuffer<T>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/compare.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "engine/core/vendor_check.h"
#include "kernels/batchnorm.h"
#include "tests/kernels/batchnorm_testing.h"

namespace cudp::kernels {
namespace {

using testing::DeviceBuffer;
using testing_bn::bitwise_equal;
using testing_bn::floats;
using testing_bn::stored;
constexpr float kEps = 1e-5f, kMomentum = 0.1f;

struct BnCase {
  int n, h, w, c;
  int64_t rows() const { return int64_t(n) * h * w; }
  size_t size() const { return size_t(rows()) * c; }
};

::testing::Message describe(const BnCase& k) {
  return ::testing::Message() << k.n << "x" << k.h << "x" << k.w << "x" << k.c;
}

// Channels with different means (|mean| <= `offset`) and spreads (0.5 .. 2): x = mean_c + s_c * u.
std::vector<float> bn_input(const BnCase& k, uint64_t seed, float offset) {
  const std::vector<float> u = testing::random_vector(k.size(), seed);
  const std::vector<float> mean = testing::random_vector(k.c, seed + 1, -offset, offset);
  const std::vector<float> spread = testing::random_vector(k.c, seed + 2, 0.5f, 2.f);
  std::vector<float> x(k.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = mean[i % k.c] + spread[i % k.c] * u[i];
  return x;
}

// max over channels of sum_r |v[r, ch]| * |w[r, ch]| (w empty: 1): the scale of a reduction's
// rounding error.
double max_channel_abs_sum(const std::vector<float>& v, int c, const std::vector<float>& w = {}) {
  std::vector<double> sums(c, 0.0);
  for (size_t i = 0; i < v.size(); ++i)
    sums[i % c] += std::fabs(v[i]) * (w.empty() ? 1.0 : std::fabs(w[i]));
  return *std::max_element(sums.begin(), sums.end());
}

// The scale of the terms of dx = k * (dy - a - (x - mean) * b), k = gamma * invstd, a = mean of
// dy, b = invstd^2 * mean of dy * (x - mean), per channel: |k| * (max |dy| + |a| + max |x - mean| *
// |b|), the largest over channels (gamma empty: 1). An fp32 evaluation of dx errs by a few ulps of
// these terms (and of the fp32 sums in a and b, relative to the same terms), whatever dx itself is:
// where dy is close to affine in x within a channel, dx is a small residue of much larger terms,
// and a tolerance relative to max |dx| would ask for accuracy that no fp32 formula (cuDNN's
// included) has. Elsewhere this scale is about max |dx|, so it costs no strictness there.
double dx_term_scale(const std::vector<float>& x, const std::vector<float>& dy,
                     const std::vector<float>& gamma, const std::vector<float>& mean,
                     const std::vector<float>& invstd, int c) {
  const size_t rows = x.size() / size_t(c);
  std::vector<double> sum_dy(c, 0.0), sum_dy_xmu(c, 0.0), max_dy(c, 0.0), max_xmu(c, 0.0);
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t ch = i % size_t(c);
    const double xmu = double(x[i]) - double(mean[ch]);
    sum_dy[ch] += dy[i];
    sum_dy_xmu[ch] += double(dy[i]) * xmu;
    max_dy[ch] = std::max(max_dy[ch], double(std::fabs(dy[i])));
    max_xmu[ch] = std::max(max_xmu[ch], std::fabs(xmu));
  }
  double scale = 0;
  for (int ch = 0; ch < c; ++ch) {
    const double s = invstd[ch], k = std::fabs((gamma.empty() ? 1.0 : double(gamma[ch])) * s);
    const double a = sum_dy[ch] / double(rows), b = sum_dy_xmu[ch] * s * s / double(rows);
    scale = std::max(scale, k * (max_dy[ch] + std::fabs(a) + max_xmu[ch] * std::fabs(b)));
  }
  return scale;
}

// The tests of training forwards and backwards run on both paths (kernels/batchnorm.h): OneLaunch,
// where the layers of at most kBatchnormClusterElements values take the cluster kernels and larger
// ones the multi-pass kernels; MultiPass (the default for now), the multi-pass kernels at every
// size.
class BatchNormPathGpu : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { detail::set_batchnorm_cluster(GetParam()); }
  void TearDown() override { detail::set_batchnorm_cluster(was_on_); }

 private:
  const bool was_on_ = detail::batchnorm_cluster();
};

INSTANTIATE_TEST_SUITE_P(Paths, BatchNormPathGpu, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "OneLaunch" : "MultiPass";
                         });

bool gpu_has_clusters() {
  int device = 0, clusters = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, device));
  return clusters != 0;
}

// The one-launch path on while it lives, then as it was.
struct OneLaunchOn {
  OneLaunchOn() { detail::set_batchnorm_cluster(true); }
  ~OneLaunchOn() { detail::set_batchnorm_cluster(was_on); }
  const bool was_on = detail::batchnorm_cluster();
};

// Which layers take one launch: VGG-16-BN's at 32 x 32 and batch 256 from conv3 on (conv3 and
// conv4 are the largest, exactly kBatchnormClusterElements values), not conv1 and conv2, nor a
// few channels over many rows, none with the cluster path off. The OneLaunch tests below run the
// cluster kernels where this says so.
TEST(BatchNormGpu, LayersUpToTheLimitTakeOneLaunch) {
  CUDP_REQUIRE_GPU();
  if (!gpu_has_clusters()) GTEST_SKIP() << "this GPU has no thread-block clusters (sm_90 has)";
  const OneLaunchOn one_launch;
  EXPECT_TRUE(detail::batchnorm_one_launch(256 * 16 * 16, 128));
  EXPECT_TRUE(detail::batchnorm_one_launch(256 * 8 * 8, 256));
  EXPECT_TRUE(detail::batchnorm_one_launch(256 * 2 * 2, 512));
  EXPECT_TRUE(detail::batchnorm_one_launch(3 * 7 * 7, 5));
  EXPECT_FALSE(detail::batchnorm_one_launch(256 * 32 * 32, 64));
  EXPECT_FALSE(detail::batchnorm_one_launch(kBatchnormClusterElements + 1, 1));
  EXPECT_FALSE(detail::batchnorm_one_launch(kBatchnormClusterFewChannels / 4 + 1, 4));
  EXPECT_TRUE(detail::batchnorm_one_launch(kBatchnormClusterFewChannels / 4, 4));
  detail::set_batchnorm_cluster(false);
  EXPECT_FALSE(detail::batchnorm_one_launch(256 * 2 * 2, 512));
}

// ---- the one-launch kernels' order, emulated on the host ----------------------------------------
//
// The one-launch kernels' bits depend on the shape alone (kernels/batchnorm.cu), so their order
// of operations can be pinned: each thread's fp32 walk over rows q * per_block + ty, q * per_block
// + ty + 8 * per_block, ... (block rank q, per_block threads along the rows), the block's fixed
// tree over ty (halves of the next power of two), then the cluster's 8 blocks merged in rank
// order. The values below use no product and sum the compiler may contract into one operation:
// adds, IEEE divisions, and explicit fmaf, which std::fma rounds as the GPU does. So a merge in
// another order (the blocks' arrival, say) changes the bits these tests compare.

int pow2_at_least(int v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

// A value per thread (thread(q, ty)), merged over each block's tree and then over the ranks.
template <typename S, typename Thread, typename Merge>
S in_cluster_order(int per_block, Thread&& thread, Merge&& merge) {
  constexpr int kRanks = 8;
  S total{};
  for (int q = 0; q < kRanks; ++q) {
    std::vector<S> t(per_block);
    for (int ty = 0; ty < per_block; ++ty) t[ty] = thread(q, ty);
    for (int half = pow2_at_least(per_block) / 2; half > 0; half /= 2) {
      for (int ty = 0; ty < half && ty + half < per_block; ++ty) merge(t[ty], t[ty + half]);
    }
    merge(total, t[0]);
  }
  return total;
}

// Calls f(row) for a thread's rows, in its order.
template <typename F>
void thread_rows(int64_t rows, int per_block, int q, int ty, F&& f) {
  for (int64_t r = int64_t(q) * per_block + ty; r < rows; r += 8 * int64_t(per_block)) f(r);
}

// The saved mean: K = x[0, ch]; a thread's count and mean of x - K; Chan's merge of counts and
// means (whose mean does not depend on M2); K + the merged mean.
std::vector<float> one_launch_saved_mean(const std::vector<float>& x, int64_t rows, int c,
                                         int per_block) {
  struct CountMean {
    float n = 0.f, mean = 0.f;
  };
  const auto merge = [](CountMean& a, const CountMean& b) {
    if (b.n == 0.f) return;
    const float total = a.n + b.n;
    const float delta = b.mean - a.mean;
    const float frac = b.n / total;
    a.mean = std::fma(delta, frac, a.mean);
    a.n = total;
  };
  std::vector<float> mean(c);
  for (int ch = 0; ch < c; ++ch) {
    const float k = x[size_t(ch)];
    const CountMean m = in_cluster_order<CountMean>(
        per_block,
        [&](int q, int ty) {
          float sum = 0.f;
          int64_t n = 0;
          thread_rows(rows, per_block, q, ty, [&](int64_t r) {
            sum += x[size_t(r * c + ch)] - k;
            ++n;
          });
          return CountMean{float(n), n > 0 ? sum / float(n) : 0.f};
        },
        merge);
    mean[size_t(ch)] = k + m.mean;
  }
  return mean;
}

// dbeta = the sum of dy, dgamma = invstd * the sum of fmaf(dy, x - mean, .), each in the order.
void one_launch_dgamma_dbeta(const std::vector<float>& x, const std::vector<float>& dy,
                             const std::vector<float>& mean, const std::vector<float>& invstd,
                             int64_t rows, int c, int per_block, std::vector<float>& dgamma,
                             std::vector<float>& dbeta) {
  struct Sums {
    float dy = 0.f, dy_xmu = 0.f;
  };
  const auto add = [](Sums& a, const Sums& b) {
    a.dy += b.dy;
    a.dy_xmu += b.dy_xmu;
  };
  dgamma.assign(size_t(c), 0.f);
  dbeta.assign(size_t(c), 0.f);
  for (int ch = 0; ch < c; ++ch) {
    const Sums s = in_cluster_order<Sums>(
        per_block,
        [&](int q, int ty) {
          Sums t;
          thread_rows(rows, per_block, q, ty, [&](int64_t r) {
            const float g = dy[size_t(r * c + ch)];
            t.dy += g;
            t.dy_xmu = std::fma(g, x[size_t(r * c + ch)] - mean[size_t(ch)], t.dy_xmu);
          });
          return t;
        },
        add);
    dbeta[size_t(ch)] = s.dy;
    dgamma[size_t(ch)] = s.dy_xmu * invstd[size_t(ch)];
  }
}

template <typename T>
void expect_one_launch_order(const BnCase& k, uint64_t seed) {
  const int bytes = int(sizeof(T)), vector = 16 / bytes;
  const int per_block = detail::batchnorm_cluster_rows_per_block(
      k.rows(), k.c, k.c % vector == 0 ? vector : 1, bytes);
  ASSERT_GT(per_block, 0) << "the shape takes the multi-pass kernels";
  // Values exact in T, so that the host reads what the kernels read.
  const auto exact = [](std::vector<float> v) {
    return std::is_same_v<T, float> ? v : testing_bn::bf16_exact(v);
  };
  const std::vector<float> xf = exact(bn_input(k, seed, 2.f));
  const std::vector<float> dyf = exact(testing::random_vector(k.size(), seed + 1));
  const std::vector<float> gamma = testing::random_vector(k.c, seed + 2, 0.5f, 1.5f);
  const DeviceBuffer<T> x(stored<T>(xf)), dy(stored<T>(dyf));
  DeviceBuffer<T> y(k.size()), dx(k.size());
  DeviceBuffer<float> g(gamma), b(std::vector<float>(k.c, 0.f)), rm(std::vector<float>(k.c, 0.f)),
      rv(std::vector<float>(k.c, 1.f)), mean(k.c), invstd(k.c), dgamma(k.c), dbeta(k.c);
  batchnorm_forward_train(x.get(), y.get(), g.get(), b.get(), rm.get(), rv.get(), mean.get(),
                          invstd.get(), k.rows(), k.c, kMomentum, kEps, BnActivation::none,
                          nullptr);
  const std::vector<float> gpu_mean = mean.download(), gpu_invstd = invstd.download();
  EXPECT_TRUE(bitwise_equal(gpu_mean, one_launch_saved_mean(xf, k.rows(), k.c, per_block)))
      << "the saved mean";
  batchnorm_backward(x.get(), dy.get(), nullptr, g.get(), mean.get(), invstd.get(), dx.get(),
                     dgamma.get(), dbeta.get(), k.rows(), k.c, 0.f, nullptr);
  std::vector<float> want_dgamma, want_dbeta;
  one_launch_dgamma_dbeta(xf, dyf, gpu_mean, gpu_invstd, k.rows(), k.c, per_block, want_dgamma,
                          want_dbeta);
  EXPECT_TRUE(bitwise_equal(dbeta.download(), want_dbeta)) << "dbeta";
  EXPECT_TRUE(bitwise_equal(dgamma.download(), want_dgamma)) << "dgamma";
}

TEST(BatchNormGpu, OneLaunchMergesInRankOrderBitForBit) {
  CUDP_REQUIRE_GPU();
  if (!gpu_has_clusters()) GTEST_SKIP() << "this GPU has no thread-block clusters (sm_90 has)";
  const OneLaunchOn one_launch;
  // Several rows a thread; one lane of scalars; one row a thread over 4 lanes (conv11-13);
  // the largest layer of one launch (conv3); few rows, wide blocks; a block of one row of threads.
  for (const BnCase& k :
       {BnCase{256, 8, 8, 256}, BnCase{3, 7, 7, 5}, BnCase{256, 2, 2, 512},
        BnCase{256, 16, 16, 128}, BnCase{8, 1, 1, 16384}, BnCase{2, 1, 1, 15361}}) {
    SCOPED_TRACE(describe(k));
    {
      SCOPED_TRACE("fp32");
      expect_one_launch_order<float>(k, 211 + k.c);
    }
    {
      SCOPED_TRACE("bf16");
      expect_one_launch_order<__nv_bfloat16>(k, 221 + k.c);
    }
  }
}

// Everything one training step of a BN layer touches, on the GPU.
struct BnGpu {
  DeviceBuffer<float> x, y, gamma, beta, running_mean, running_var, save_mean, save_invstd, dy, dx,
      dgamma, dbeta;
  BnGpu(const BnCase& k, const std::vector<float>& x_host, const std::vector<float>& gamma_host,
        const std::vector<float>& beta_host, const std::vector<float>& rm,
        const std::vector<float>& rv, const std::vector<float>& dy_host)
      : x(x_host),
        y(k.size()),
        gamma(gamma_host),
        beta(beta_host),
        running_mean(rm),
        running_var(rv),
        save_mean(k.c),
        save_invstd(k.c),
        dy(dy_host),
        dx(k.size()),
        dgamma(k.c),
        dbeta(k.c) {
    for (auto* b : {&y, &save_mean, &save_invstd, &dx, &dgamma, &dbeta}) b->fill(testing::kPoison);
  }
};

const BnCase kCases[] = {
    {3, 7, 7, 5},        // scalar path, lanes 5 x 51 rows
    {3, 9, 9, 8},        // float4, 2 lanes
    {3, 7, 7, 3},        // a first layer's channel count
    {2, 9, 9, 192},      // 48 vectors: two groups of 24 lanes
    {2, 3, 3, 513},      // scalar, 17 groups of 31 lanes
    {5, 7, 7, 64},       // float4, one group of 16 lanes
    {4, 56, 56, 256},    // VGG: float4, two groups of 32 lanes
    {16, 112, 112, 64},  // 200,704 rows: long per-channel reductions
    {2, 1, 1, 15361},    // scalar, 2 rows of many channels: one launch's widest blocks
};

TEST_P(BatchNormPathGpu, TrainingForwardAndBackwardMatchCpu) {
  CUDP_REQUIRE_GPU();
  for (const BnCase& k : kCases) {
    SCOPED_TRACE(describe(k));
    const std::vector<float> x = bn_input(k, 101 + k.c, 2.f);
    const std::vector<float> gamma = testing::random_vector(k.c, 102, 0.5f, 1.5f);
    const std::vector<float> beta = testing::random_vector(k.c, 103);
    const std::vector<float> rm0 = testing::random_vector(k.c, 104);
    const std::vector<float> rv0 = testing::random_vector(k.c, 105, 0.5f, 2.f);
    // For k.c == 5 the seeds coincide (101 + 5 == 106): dy is bn_input's u, an exact affine
    // function of x per channel, so dx is only the eps / (var + eps) residue (< 1e-4) of its terms:
    // kept as the cancellation case (see dx_term_scale).
    const std::vector<float> dy = testing::random_vector(k.size(), 106);
    BnGpu g(k, x, gamma, beta, rm0, rv0, dy);
    batchnorm_forward_train(g.x.get(), g.y.get(), g.gamma.get(), g.beta.get(), g.running_mean.get(),
                            g.running_var.get(), g.save_mean.get(), g.save_invstd.get(), k.rows(),
                            k.c, kMomentum, kEps, BnActivation::none, nullptr);

    std::vector<float> y(k.size()), rm = rm0, rv = rv0, mean(k.c), invstd(k.c);
    batchnorm_forward_train_cpu(x.data(), y.data(), gamma.data(), beta.data(), rm.data(), rv.data(),
                                mean.data(), invstd.data(), k.rows(), k.c, kMomentum, kEps);
    // The GPU's statistics are within ~1e-6 relative of the exact ones (fp32 sums of x - K, Chan
    // merges), the saved mean within ~ulp(|mean| <= 2) = 2.4e-7 more for its final rounding; y,
    // |y| <= 4, is computed from x - K with gamma * invstd <= 5: a few ulps, well under 2e-5.
    EXPECT_ALL_CLOSE(g.save_mean.download(), mean, 1e-6, 2e-6);
    EXPECT_ALL_CLOSE(g.save_invstd.download(), invstd, 1e-5, 0);
    EXPECT_ALL_CLOSE(g.y.download(), y, 1e-5, 2e-5);
    EXPECT_ALL_CLOSE(g.running_mean.download(), rm, 1e-5, 1e-6);
    EXPECT_ALL_CLOSE(g.running_var.download(), rv, 1e-5, 1e-6);

    // Backward from the GPU's saved statistics, on both sides.
    const std::vector<float> gpu_mean = g.save_mean.download(),
                             gpu_invstd = g.save_invstd.download();
    batchnorm_backward(g.x.get(), g.dy.get(), nullptr, g.gamma.get(), g.save_mean.get(),
                       g.save_invstd.get(), g.dx.get(), g.dgamma.get(), g.dbeta.get(), k.rows(),
                       k.c, 0.f, nullptr);
    std::vector<float> dx(k.size()), dgamma(k.c), dbeta(k.c);
    batchnorm_backward_cpu(x.data(), dy.data(), nullptr, gamma.data(), gpu_mean.data(),
                           gpu_invstd.data(), dx.data(), dgamma.data(), dbeta.data(), k.rows(), k.c,
                           0.f);
    // dx = k * (dy - a - (x - mean) * b): a few roundings of its largest terms, not of dx, which
    // may cancel (4e-6 ~ 34 fp32 epsilons; the kernel errs by <= 2e-7 of them in every case here).
    EXPECT_ALL_CLOSE(g.dx.download(), dx, 1e-5,
                     4e-6 * dx_term_scale(x, dy, gamma, gpu_mean, gpu_invstd, k.c));
    // dbeta = sum dy and dgamma = invstd * sum dy * (x - mean) over the rows, in fp32: an error of
    // a few roundings at the magnitude of sum |term| (what pairwise-like summation guarantees).
    std::vector<float> xhat(k.size());
    for (size_t i = 0; i < xhat.size(); ++i)
      xhat[i] = (x[i] - gpu_mean[i % k.c]) * gpu_invstd[i % k.c];
    EXPECT_ALL_CLOSE(g.dbeta.download(), dbeta, 1e-5, 2e-7 * max_channel_abs_sum(dy, k.c));
    EXPECT_ALL_CLOSE(g.dgamma.download(), dgamma, 1e-5, 2e-7 * max_channel_abs_sum(dy, k.c, xhat));
  }
}

TEST(BatchNormGpu, EvalMatchesCpu) {
  CUDP_REQUIRE_GPU();
  for (const BnCase& k : kCases) {
    SCOPED_TRACE(describe(k));
    const std::vector<float> x = bn_input(k, 111 + k.c, 2.f);
    const std::vector<float> gamma = testing::random_vector(k.c, 112, 0.5f, 1.5f);
    const std::vector<float> beta = testing::random_vector(k.c, 113);
    const std::vector<float> rm = testing::random_vector(k.c, 114, -2.f, 2.f);
    const std::vector<float> rv = testing::random_vector(k.c, 115, 0.25f, 4.f);
    const DeviceBuffer<float> xg(x), gg(gamma), bg(beta), rmg(rm), rvg(rv);
    DeviceBuffer<float> yg(k.size()), yg_plain(k.size());
    yg.fill(testing::kPoison);
    yg_plain.fill(testing::kPoison);
    batchnorm_forward_eval(xg.get(), yg.get(), gg.get(), bg.get(), rmg.get(), rvg.get(), k.rows(),
                           k.c, kEps, BnActivation::none, nullptr);
    batchnorm_forward_eval(xg.get(), yg_plain.get(), nullptr, nullptr, rmg.get(), rvg.get(),
                           k.rows(), k.c, kEps, BnActivation::none, nullptr);
    std::vector<float> y(k.size()), y_plain(k.size());
    batchnorm_forward_eval_cpu(x.data(), y.data(), gamma.data(), beta.data(), rm.data(), rv.data(),
                               k.rows(), k.c, kEps);
    batchnorm_forward_eval_cpu<float>(x.data(), y_plain.data(), nullptr, nullptr, rm.data(),
                                      rv.data(), k.rows(), k.c, kEps);
    // One fp32 formula per element on values below ~10: a few ulps.
    EXPECT_ALL_CLOSE(yg.download(), y, 1e-5, 1e-5);
    EXPECT_ALL_CLOSE(yg_plain.download(), y_plain, 1e-5, 1e-5);
  }
}

TEST_P(BatchNormPathGpu, LargeMeanIsNumericallyStable) {
  CUDP_REQUIRE_GPU();
  // Means near +-1000 with spreads 0.5 .. 2: E[x^2] - E[x]^2 in fp32 would lose the variance to
  // cancellation (an error of ~ulp(1e6) = 0.06 on variances of ~0.1 .. 1.3), and even a mean
  // accumulated near 1000 carries errors of ulp(1000) = 6e-5, i.e. 2e-4 of a standard deviation.
  // The kernels work on x - K (K a sample of the channel, exact by Sterbenz here), so the
  // statistics and y are as accurate as for mean 0: the same tolerances as
  // TrainingForwardAndBackwardMatchCpu, except the saved mean, which is rounded once near 1000
  // (1e-4 ~ 1.6 ulp(1000)).
  const BnCase k{8, 28, 28, 64};
  std::vector<float> x = bn_input(k, 121, 1.f);
  for (size_t i = 0; i < x.size(); ++i) x[i] += (i % k.c) % 2 ? 1000.f : -1000.f;
  const DeviceBuffer<float> xg(x);
  DeviceBuffer<float> yg(k.size()), mg(k.c), ig(k.c);
  yg.fill(testing::kPoison);
  batchnorm_forward_train(xg.get(), yg.get(), nullptr, nullptr, nullptr, nullptr, mg.get(),
                          ig.get(), k.rows(), k.c, kMomentum, kEps, BnActivation::none, nullptr);
  std::vector<float> y(k.size()), mean(k.c), invstd(k.c);
  batchnorm_forward_train_cpu<float>(x.data(), y.data(), nullptr, nullptr, nullptr, nullptr,
                                     mean.data(), invstd.data(), k.rows(), k.c, kMomentum, kEps);
  EXPECT_ALL_CLOSE(ig.download(), invstd, 1e-5, 0);
  EXPECT_ALL_CLOSE(mg.download(), mean, 0, 1e-4);
  EXPECT_ALL_CLOSE(yg.download(), y, 1e-5, 2e-5);
}

TEST_P(BatchNormPathGpu, AccumulateSemanticsAndOptionalPointers) {
  CUDP_REQUIRE_GPU();
  const BnCase k{3, 7, 7, 12};
  const std::vector<float> x = bn_input(k, 131, 1.f);
  const std::vector<float> dy = testing::random_vector(k.size(), 132);
  const std::vector<float> gamma = testing::random_vector(k.c, 133, 0.5f, 1.5f);
  const DeviceBuffer<float> xg(x), dyg(dy), gg(gamma);
  DeviceBuffer<float> yg(k.size()), mg(k.c), ig(k.c), dxg(k.size()), dgg(k.c), dbg(k.c);
  // Forward with no affine and no running statistics.
  yg.fill(testing::kPoison);
  batchnorm_forward_train(xg.get(), yg.get(), nullptr, nullptr, nullptr, nullptr, mg.get(),
                          ig.get(), k.rows(), k.c, kMomentum, kEps, BnActivation::none, nullptr);
  std::vector<float> y(k.size()), mean(k.c), invstd(k.c);
  batchnorm_forward_train_cpu<float>(x.data(), y.data(), nullptr, nullptr, nullptr, nullptr,
                                     mean.data(), invstd.data(), k.rows(), k.c, kMomentum, kEps);
  EXPECT_ALL_CLOSE(yg.download(), y, 1e-5, 2e-5);  // as in TrainingForwardAndBackwardMatchCpu
  const std::vector<float> gm = mg.download(), gi = ig.download();

  // beta 0 never reads the old gradients: NaN there must not survive.
  dgg.fill(std::numeric_limits<float>::quiet_NaN());
  dbg.fill(std::numeric_limits<float>::quiet_NaN());
  batchnorm_backward(xg.get(), dyg.get(), nullptr, gg.get(), mg.get(), ig.get(), dxg.get(),
                     dgg.get(), dbg.get(), k.rows(), k.c, 0.f, nullptr);
  std::vector<float> dx(k.size()), dgamma(k.c), dbeta(k.c);
  batchnorm_backward_cpu(x.data(), dy.data(), nullptr, gamma.data(), gm.data(), gi.data(),
                         dx.data(), dgamma.data(), dbeta.data(), k.rows(), k.c, 0.f);
  // Sums of 147 terms below 3 in magnitude: 1e-5 absolute is ~10 roundings at that scale.
  EXPECT_ALL_CLOSE(dgg.download(), dgamma, 1e-5, 1e-5);
  EXPECT_ALL_CLOSE(dbg.download(), dbeta, 1e-5, 1e-5);

  // beta 1: accumulate onto the previous values (a second micro-batch).
  std::vector<float> old_g = testing::random_vector(k.c, 134),
                     old_b = testing::random_vector(k.c, 135);
  dgg.upload(old_g);
  dbg.upload(old_b);
  batchnorm_backward(xg.get(), dyg.get(), nullptr, gg.get(), mg.get(), ig.get(), dxg.get(),
                     dgg.get(), dbg.get(), k.rows(), k.c, 1.f, nullptr);
  batchnorm_backward_cpu(x.data(), dy.data(), nullptr, gamma.data(), gm.data(), gi.data(),
                         dx.data(), old_g.data(), old_b.data(), k.rows(), k.c, 1.f);
  EXPECT_ALL_CLOSE(dgg.download(), old_g, 1e-5, 1e-5);
  EXPECT_ALL_CLOSE(dbg.download(), old_b, 1e-5, 1e-5);

  // No parameter gradients at all (affine=False): dx still written, gamma taken as 1.
  dxg.fill(testing::kPoison);
  batchnorm_backward(xg.get(), dyg.get(), nullptr, nullptr, mg.get(), ig.get(), dxg.get(), nullptr,
                     nullptr, k.rows(), k.c, 0.f, nullptr);
  batchnorm_backward_cpu<float>(x.data(), dy.data(), nullptr, nullptr, gm.data(), gi.data(),
                                dx.data(), nullptr, nullptr, k.rows(), k.c, 0.f);
  EXPECT_ALL_CLOSE(dxg.download(), dx, 1e-5, 4e-6 * dx_term_scale(x, dy, {}, gm, gi, k.c));
}

TEST_P(BatchNormPathGpu, ReductionsAreBitwiseDeterministic) {
  CUDP_REQUIRE_GPU();
  for (const BnCase& k : {BnCase{4, 56, 56, 256}, BnCase{3, 7, 7, 5}, BnCase{16, 112, 112, 64}}) {
    SCOPED_TRACE(describe(k));
    const std::vector<float> x = bn_input(k, 141, 2.f), dy = testing::random_vector(k.size(), 142);
    const std::vector<float> gamma = testing::random_vector(k.c, 143, 0.5f, 1.5f);
    const std::vector<float> beta = testing::random_vector(k.c, 144);
    const std::vector<float> rm = testing::random_vector(k.c, 145), rv(k.c, 1.f);
    std::vector<std::vector<float>> first;
    for (int run = 0; run < 2; ++run) {
      BnGpu g(k, x, gamma, beta, rm, rv, dy);
      batchnorm_forward_train(g.x.get(), g.y.get(), g.gamma.get(), g.beta.get(),
                              g.running_mean.get(), g.running_var.get(), g.save_mean.get(),
                              g.save_invstd.get(), k.rows(), k.c, kMomentum, kEps,
                              BnActivation::none, nullptr);
      batchnorm_backward(g.x.get(), g.dy.get(), nullptr, g.gamma.get(), g.save_mean.get(),
                         g.save_invstd.get(), g.dx.get(), g.dgamma.get(), g.dbeta.get(), k.rows(),
                         k.c, 0.f, nullptr);
      std::vector<std::vector<float>> out;
      for (auto* b : {&g.y, &g.running_mean, &g.running_var, &g.save_mean, &g.save_invstd, &g.dx,
                      &g.dgamma, &g.dbeta}) {
        out.push_back(b->download());
      }
      if (run == 0) {
        first = out;
      } else {
        for (size_t i = 0; i < out.size(); ++i)
          EXPECT_TRUE(bitwise_equal(out[i], first[i])) << "output " << i;
      }
    }
  }
}

// ---- against cuDNN ------------------------------------------------------------------------------

struct Cudnn {
  cudnnHandle_t handle = nullptr;
  Cudnn() { CUDP_CUDNN_CHECK(cudnnCreate(&handle)); }
  ~Cudnn() { cudnnDestroy(handle); }
};

struct TensorDesc {
  cudnnTensorDescriptor_t desc = nullptr;
  TensorDesc() { CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&desc)); }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(desc); }
};

TEST_P(BatchNormPathGpu, MatchesCudnnSpatialNhwc) {
  CUDP_REQUIRE_GPU();
  Cudnn cudnn;
  for (const BnCase& k :
       {BnCase{3, 7, 7, 5}, BnCase{3, 9, 9, 8}, BnCase{4, 56, 56, 256}, BnCase{16, 112, 112, 64}}) {
    SCOPED_TRACE(describe(k));
    TensorDesc x_desc, bn_desc;
    CUDP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(x_desc.desc, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT,
                                                k.n, k.c, k.h, k.w));
    CUDP_CUDNN_CHECK(
        cudnnDeriveBNTensorDescriptor(bn_desc.desc, x_desc.desc, CUDNN_BATCHNORM_SPATIAL));
    const std::vector<float> x = bn_input(k, 151 + k.c, 2.f);
    const std::vector<float> gamma = testing::random_vector(k.c, 152, 0.5f, 1.5f);
    const std::vector<float> beta = testing::random_vector(k.c, 153);
    const std::vector<float> rm0 = testing::random_vector(k.c, 154);
    const std::vector<float> rv0 = testing::random_vector(k.c, 155, 0.5f, 2.f);
    // k.c == 5: dy is bn_input's u (151 + 5 == 156), the cancellation case, as in
    // TrainingForwardAndBackwardMatchCpu.
    const std::vector<float> dy = testing::random_vector(k.size(), 156);
    BnGpu ours(k, x, gamma, beta, rm0, rv0, dy), ref(k, x, gamma, beta, rm0, rv0, dy);

    batchnorm_forward_train(ours.x.get(), ours.y.get(), ours.gamma.get(), ours.beta.get(),
                            ours.running_mean.get(), ours.running_var.get(), ours.save_mean.get(),
                            ours.save_invstd.get(), k.rows(), k.c, kMomentum, kEps,
                            BnActivation::none, nullptr);
    batchnorm_backward(ours.x.get(), ours.dy.get(), nullptr, ours.gamma.get(), ours.save_mean.get(),
                       ours.save_invstd.get(), ours.dx.get(), ours.dgamma.get(), ours.dbeta.get(),
                       k.rows(), k.c, 0.f, nullptr);
    // cuDNN: exponentialAverageFactor is PyTorch's momentum, and its running variance is the
    // unbiased one, as PyTorch's (which calls this very function).
    const float one = 1.f, zero = 0.f;
    CUDP_CUDNN_CHECK(cudnnBatchNormalizationForwardTraining(
        cudnn.handle, CUDNN_BATCHNORM_SPATIAL, &one, &zero, x_desc.desc, ref.x.get(), x_desc.desc,
        ref.y.get(), bn_desc.desc, ref.gamma.get(), ref.beta.get(), double(kMomentum),
        ref.running_mean.get(), ref.running_var.get(), double(kEps), ref.save_mean.get(),
        ref.save_invstd.get()));
    CUDP_CUDNN_CHECK(cudnnBatchNormalizationBackward(
        cudnn.handle, CUDNN_BATCHNORM_SPATIAL, &one, &zero, &one, &zero, x_desc.desc, ref.x.get(),
        x_desc.desc, ref.dy.get(), x_desc.desc, ref.dx.get(), bn_desc.desc, ref.gamma.get(),
        ref.dgamma.get(), ref.dbeta.get(), double(kEps), ref.save_mean.get(),
        ref.save_invstd.get()));

    // Two fp32 implementations, each within the CPU test's bounds of the exact values: twice those.
    EXPECT_ALL_CLOSE(ours.save_mean.download(), ref.save_mean.download(), 2e-6, 4e-6);
    EXPECT_ALL_CLOSE(ours.save_invstd.download(), ref.save_invstd.download(), 2e-5, 0);
    EXPECT_ALL_CLOSE(ours.y.download(), ref.y.download(), 2e-5, 4e-5);
    EXPECT_ALL_CLOSE(ours.running_mean.download(), ref.running_mean.download(), 2e-5, 2e-6);
    EXPECT_ALL_CLOSE(ours.running_var.download(), ref.running_var.download(), 2e-5, 2e-6);
    const std::vector<float> m = ref.save_mean.download(), s = ref.save_invstd.download();
    EXPECT_ALL_CLOSE(ours.dx.download(), ref.dx.download(), 2e-5,
                     8e-6 * dx_term_scale(x, dy, gamma, m, s, k.c));
    std::vector<float> xhat(k.size());
    for (size_t i = 0; i < xhat.size(); ++i) xhat[i] = (x[i] - m[i % k.c]) * s[i % k.c];
    EXPECT_ALL_CLOSE(ours.dbeta.download(), ref.dbeta.download(), 2e-5,
                     4e-7 * max_channel_abs_sum(dy, k.c));
    EXPECT_ALL_CLOSE(ours.dgamma.download(), ref.dgamma.download(), 2e-5,
                     4e-7 * max_channel_abs_sum(dy, k.c, xhat));

    // Evaluation with the running statistics both sides now hold (ours).
    DeviceBuffer<float> y_eval(k.size()), y_eval_ref(k.size());
    y_eval.fill(testing::kPoison);
    batchnorm_forward_eval(ours.x.get(), y_eval.get(), ours.gamma.get(), ours.beta.get(),
                           ours.running_mean.get(), ours.running_var.get(), k.rows(), k.c, kEps,
                           BnActivation::none, nullptr);
    CUDP_CUDNN_CHECK(cudnnBatchNormalizationForwardInference(
        cudnn.handle, CUDNN_BATCHNORM_SPATIAL, &one, &zero, x_desc.desc, ours.x.get(), x_desc.desc,
        y_eval_ref.get(), bn_desc.desc, ours.gamma.get(), ours.beta.get(), ours.running_mean.get(),
        ours.running_var.get(), double(kEps)));
    EXPECT_ALL_CLOSE(y_eval.download(), y_eval_ref.download(), 2e-5, 2e-5);
  }
}

TEST(BatchNormGpu, BadArgumentsThrowBeforeLaunching) {
  CUDP_REQUIRE_GPU();
  DeviceBuffer<float> b(64);
  float* p = b.get();
  EXPECT_THROW(batchnorm_forward_train(p, p, p, p, p, p, p, p, 1, 4, 0.1f, 1e-5f,
                                       BnActivation::none, nullptr),
               ValueError);
  EXPECT_THROW(
      batchnorm_forward_eval(p, p, p, p, nullptr, p, 4, 4, 1e-5f, BnActivation::none, nullptr),
      ValueError);
  EXPECT_THROW(batchnorm_backward(p, p, nullptr, p, nullptr, p, p, p, p, 4, 4, 0.f, nullptr),
               ValueError);
  EXPECT_THROW(batchnorm_backward(p, p, nullptr, p, p, p, p, p, p, 4, 0, 0.f, nullptr), ValueError);
}

// ---- bf16 storage, fused ReLU, evaluation backward ---------------------------------------------

// bf16 outputs against the CPU reference in bf16 (the double result rounded once to nearest): the
// GPU rounds an fp32 value that lies within the fp32 tests' bounds (above) of the exact one, and
// two roundings to nearest of values that close land at most one bf16 ulp apart (<= 2^-7 of the
// value: bf16 keeps 8 significant bits) plus their distance. So rtol = 2^-7 plus the fp32 bounds'
// relative part (1e-5), rounded up to 8e-3, and atol = the fp32 bound's absolute part.
constexpr double kBf16Rtol = 8e-3;

const BnCase kBf16Cases[] = {
    {3, 7, 7, 5},        // scalar path
    {2, 5, 7, 12},       // c % 8 != 0: scalar bf16 path (float4 in fp32)
    {3, 7, 7, 24},       // 8 bf16 per lane, 3 lanes, 147 rows (not a multiple of a block)
    {2, 9, 9, 264},      // 33 vectors: two groups
    {5, 7, 7, 64},       // VGG's first width
    {4, 56, 56, 256},    // VGG: one group of 32 lanes
    {16, 112, 112, 64},  // long per-channel reductions
    {256, 16, 16, 128},  // VGG-16-BN's conv3 at 32 x 32: the largest layer of one launch
    {256, 2, 2, 512},    // its conv11 to conv13
    {8, 1, 1, 16384},    // few rows of many channels: one launch's widest blocks (shared memory)
    {2, 1, 1, 15361},    // the same, scalar: as many lanes as a block has threads
};

TEST_P(BatchNormPathGpu, Bf16TrainingMatchesTheDoubleReference) {
  CUDP_REQUIRE_GPU();
  using bf16 = __nv_bfloat16;
  for (const BnCase& k : kBf16Cases) {
    for (const BnActivation act : {BnActivation::none, BnActivation::relu}) {
      SCOPED_TRACE(describe(k) << (act == BnActivation::relu ? " relu" : ""));
      const std::vector<float> xf = testing_bn::bf16_exact(bn_input(k, 161 + k.c, 2.f));
      const std::vector<float> dyf =
          testing_bn::bf16_exact(testing::random_vector(k.size(), 162 + k.c));
      const std::vector<float> gamma = testing::random_vector(k.c, 163, 0.5f, 1.5f);
      const std::vector<float> beta = testing::random_vector(k.c, 164, -0.5f, 0.5f);
      const std::vector<float> rm0 = testing::random_vector(k.c, 165);
      const std::vector<float> rv0 = testing::random_vector(k.c, 166, 0.5f, 2.f);
      const std::vector<bf16> x = stored<bf16>(xf), dy = stored<bf16>(dyf);
      const DeviceBuffer<bf16> xg(x), dyg(dy);
      DeviceBuffer<bf16> yg(k.size()), dxg(k.size());
      DeviceBuffer<float> gg(gamma), bg(beta), rmg(rm0), rvg(rv0), mg(k.c), ig(k.c), dgg(k.c),
          dbg(k.c);
      yg.fill(__float2bfloat16_rn(testing::kPoison));
      dxg.fill(__float2bfloat16_rn(testing::kPoison));
      for (auto* b : {&mg, &ig, &dgg, &dbg}) b->fill(testing::kPoison);
      batchnorm_forward_train(xg.get(), yg.get(), gg.get(), bg.get(), rmg.get(), rvg.get(),
                              mg.get(), ig.get(), k.rows(), k.c, kMomentum, kEps, act, nullptr);
      std::vector<bf16> y(k.size());
      std::vector<float> rm = rm0, rv = rv0, mean(k.c), invstd(k.c);
      batchnorm_forward_train_cpu(x.data(), y.data(), gamma.data(), beta.data(), rm.data(),
                                  rv.data(), mean.data(), invstd.data(), k.rows(), k.c, kMomentum,
                                  kEps, act);
      // The statistics are fp32 reductions of the same (exact) values: the fp32 test's bounds.
      EXPECT_ALL_CLOSE(mg.download(), mean, 1e-6, 2e-6);
      EXPECT_ALL_CLOSE(ig.download(), invstd, 1e-5, 0);
      EXPECT_ALL_CLOSE(rmg.download(), rm, 1e-5, 1e-6);
      EXPECT_ALL_CLOSE(rvg.download(), rv, 1e-5, 1e-6);
      const std::vector<bf16> y_gpu = yg.download();
      const std::vector<float> y_gpu_f = floats(y_gpu);
      EXPECT_ALL_CLOSE(y_gpu_f, floats(y), kBf16Rtol, 2e-5);
      if (act == BnActivation::relu) {
        EXPECT_GT(testing_bn::clamped(y_gpu_f), 0u);
        EXPECT_LT(testing_bn::clamped(y_gpu_f), y_gpu_f.size());
      }

      // Backward from the GPU's statistics and (fused ReLU) its output, on both sides.
      const std::vector<float> gm = mg.download(), gi = ig.download();
      const bf16* mask_gpu = act == BnActivation::relu ? yg.get() : nullptr;
      const bf16* mask_cpu = act == BnActivation::relu ? y_gpu.data() : nullptr;
      batchnorm_backward(xg.get(), dyg.get(), mask_gpu, gg.get(), mg.get(), ig.get(), dxg.get(),
                         dgg.get(), dbg.get(), k.rows(), k.c, 0.f, nullptr);
      std::vector<bf16> dx(k.size());
      std::vector<float> dgamma(k.c), dbeta(k.c);
      batchnorm_backward_cpu(x.data(), dy.data(), mask_cpu, gamma.data(), gm.data(), gi.data(),
                             dx.data(), dgamma.data(), dbeta.data(), k.rows(), k.c, 0.f);
      const std::vector<float> g =
          act == BnActivation::relu ? testing_bn::relu_grad_of(y_gpu_f, dyf) : dyf;
      // dx: the bf16 rule above on the fp32 test's bound; dgamma, dbeta: fp32 sums of the same
      // values, the fp32 test's bounds.
      EXPECT_ALL_CLOSE(floats(dxg.download()), floats(dx), kBf16Rtol,
                       4e-6 * dx_term_scale(xf, g, gamma, gm, gi, k.c));
      std::vector<float> xhat(k.size());
      for (size_t i = 0; i < xhat.size(); ++i) xhat[i] = (xf[i] - gm[i % k.c]) * gi[i % k.c];
      EXPECT_ALL_CLOSE(dbg.download(), dbeta, 1e-5, 2e-7 * max_channel_abs_sum(g, k.c));
      EXPECT_ALL_CLOSE(dgg.download(), dgamma, 1e-5, 2e-7 * max_channel_abs_sum(g, k.c, xhat));
    }
  }
}

// Fused ReLU == ReLU after the plain forward, and masked backward == the plain backward of a
// gradient that ReLU's backward masked first, bit for bit on the GPU, for f32 and bf16 storage,
// after a training and after an evaluation forward.
template <typename T>
void expect_fused_relu_is_relu_gpu(const BnCase& k, uint64_t seed) {
  const std::vector<T> x = stored<T>(bn_input(k, seed, 1.f));
  const std::vector<T> dy = stored<T>(testing::random_vector(k.size(), seed + 1));
  const std::vector<float> gamma = testing::random_vector(k.c, seed + 2, 0.5f, 1.5f);
  const std::vector<float> beta = testing::random_vector(k.c, seed + 3, -0.5f, 0.5f);
  const std::vector<float> rm0 = testing::random_vector(k.c, seed + 4),
                           rv0 = testing::random_vector(k.c, seed + 5, 0.5f, 2.f);
  const DeviceBuffer<T> xg(x), dyg(dy);
  const DeviceBuffer<float> gg(gamma), bg(beta);
  for (const bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "evaluation");
    DeviceBuffer<T> y(k.size()), y_relu(k.size()), dx1(k.size()), dx2(k.size());
    DeviceBuffer<float> rm1(rm0), rv1(rv0), rm2(rm0), rv2(rv0), m1(k.c), i1(k.c), m2(k.c), i2(k.c),
        dg1(k.c), db1(k.c), dg2(k.c), db2(k.c);
    if (training) {
      batchnorm_forward_train(xg.get(), y.get(), gg.get(), bg.get(), rm1.get(), rv1.get(), m1.get(),
                              i1.get(), k.rows(), k.c, kMomentum, kEps, BnActivation::none,
                              nullptr);
      batchnorm_forward_train(xg.get(), y_relu.get(), gg.get(), bg.get(), rm2.get(), rv2.get(),
                              m2.get(), i2.get(), k.rows(), k.c, kMomentum, kEps,
                              BnActivation::relu, nullptr);
      for (auto [a, b] :
           {std::pair{&rm1, &rm2}, std::pair{&rv1, &rv2}, std::pair{&m1, &m2}, std::pair{&i1, &i2}})
        EXPECT_TRUE(bitwise_equal(a->download(), b->download()));
    } else {
      batchnorm_forward_eval(xg.get(), y.get(), gg.get(), bg.get(), rm1.get(), rv1.get(), k.rows(),
                             k.c, kEps, BnActivation::none, nullptr);
      batchnorm_forward_eval(xg.get(), y_relu.get(), gg.get(), bg.get(), rm1.get(), rv1.get(),
                             k.rows(), k.c, kEps, BnActivation::relu, nullptr);
    }
    const std::vector<float> yr = floats(y_relu.download());
    ASSERT_GT(testing_bn::clamped(yr), yr.size() / 8);
    ASSERT_LT(testing_bn::clamped(yr), yr.size() * 7 / 8);
    EXPECT_TRUE(bitwise_equal(yr, testing_bn::relu_of(floats(y.download()))));

    const DeviceBuffer<T> dy_masked(stored<T>(testing_bn::relu_grad_of(yr, floats(dy))));
    if (training) {
      batchnorm_backward(xg.get(), dyg.get(), y_relu.get(), gg.get(), m2.get(), i2.get(), dx1.get(),
                         dg1.get(), db1.get(), k.rows(), k.c, 0.f, nullptr);
      batchnorm_backward(xg.get(), dy_masked.get(), nullptr, gg.get(), m2.get(), i2.get(),
                         dx2.get(), dg2.get(), db2.get(), k.rows(), k.c, 0.f, nullptr);
    } else {
      batchnorm_backward_eval(xg.get(), dyg.get(), y_relu.get(), gg.get(), rm1.get(), rv1.get(),
                              dx1.get(), dg1.get(), db1.get(), k.rows(), k.c, kEps, 0.f, nullptr);
      batchnorm_backward_eval(xg.get(), dy_masked.get(), nullptr, gg.get(), rm1.get(), rv1.get(),
                              dx2.get(), dg2.get(), db2.get(), k.rows(), k.c, kEps, 0.f, nullptr);
    }
    EXPECT_TRUE(bitwise_equal(floats(dx1.download()), floats(dx2.download())));
    EXPECT_TRUE(bitwise_equal(dg1.download(), dg2.download()));
    EXPECT_TRUE(bitwise_equal(db1.download(), db2.download()));
  }
}

TEST_P(BatchNormPathGpu, FusedReluIsReluBitForBit) {
  CUDP_REQUIRE_GPU();
  for (const BnCase& k : {BnCase{3, 7, 7, 5}, BnCase{2, 5, 7, 12}, BnCase{4, 56, 56, 256}}) {
    SCOPED_TRACE(describe(k));
    {
      SCOPED_TRACE("f32");
      expect_fused_relu_is_relu_gpu<float>(k, 171);
    }
    {
      SCOPED_TRACE("bf16");
      expect_fused_relu_is_relu_gpu<__nv_bfloat16>(k, 181);
    }
  }
}

// The backward of an evaluation forward (frozen statistics) against the CPU reference: dx = dy *
// gamma * invstd is one fp32 product of a coefficient a few ulps off (2e-7 relative); dgamma and
// dbeta are fp32 sums as in training (the same bounds). bf16 adds the rule above.
template <typename T>
void expect_eval_backward_matches_cpu(const BnCase& k, uint64_t seed, double rtol) {
  const std::vector<float> xf = floats(stored<T>(bn_input(k, seed, 2.f)));
  const std::vector<float> dyf = floats(stored<T>(testing::random_vector(k.size(), seed + 1)));
  const std::vector<T> x = stored<T>(xf), dy = stored<T>(dyf);
  const std::vector<float> gamma = testing::random_vector(k.c, seed + 2, 0.5f, 1.5f);
  const std::vector<float> beta = testing::random_vector(k.c, seed + 3, -0.5f, 0.5f);
  const std::vector<float> rm = testing::random_vector(k.c, seed + 4, -2.f, 2.f);
  const std::vector<float> rv = testing::random_vector(k.c, seed + 5, 0.25f, 4.f);
  const DeviceBuffer<T> xg(x), dyg(dy);
  DeviceBuffer<T> yg(k.size()), dxg(k.size());
  const DeviceBuffer<float> gg(gamma), bg(beta), rmg(rm), rvg(rv);
  DeviceBuffer<float> dgg(testing::random_vector(k.c, seed + 6)),
      dbg(testing::random_vector(k.c, seed + 7));
  std::vector<float> dgamma = dgg.download(), dbeta = dbg.download();
  batchnorm_forward_eval(xg.get(), yg.get(), gg.get(), bg.get(), rmg.get(), rvg.get(), k.rows(),
                         k.c, kEps, BnActivation::relu, nullptr);
  std::vector<T> y(k.size());
  batchnorm_forward_eval_cpu(x.data(), y.data(), gamma.data(), beta.data(), rm.data(), rv.data(),
                             k.rows(), k.c, kEps, BnActivation::relu);
  // One fp32 formula per element on values below ~10: a few ulps (as EvalMatchesCpu).
  const std::vector<T> y_gpu = yg.download();
  EXPECT_ALL_CLOSE(floats(y_gpu), floats(y), rtol, 1e-5);
  // Accumulating (beta 1) onto random gradients, masked by the GPU's fused output.
  batchnorm_backward_eval(xg.get(), dyg.get(), yg.get(), gg.get(), rmg.get(), rvg.get(), dxg.get(),
                          dgg.get(), dbg.get(), k.rows(), k.c, kEps, 1.f, nullptr);
  std::vector<T> dx(k.size());
  batchnorm_backward_eval_cpu(x.data(), dy.data(), y_gpu.data(), gamma.data(), rm.data(), rv.data(),
                              dx.data(), dgamma.data(), dbeta.data(), k.rows(), k.c, kEps, 1.f);
  EXPECT_ALL_CLOSE(floats(dxg.download()), floats(dx), rtol, 0);
  const std::vector<float> g = testing_bn::relu_grad_of(floats(y_gpu), dyf);
  std::vector<float> xhat(k.size());
  for (size_t i = 0; i < xhat.size(); ++i)
    xhat[i] = (xf[i] - rm[i % k.c]) / std::sqrt(rv[i % k.c] + kEps);
  EXPECT_ALL_CLOSE(dbg.download(), dbeta, 1e-5, 2e-7 * max_channel_abs_sum(g, k.c));
  EXPECT_ALL_CLOSE(dgg.download(), dgamma, 1e-5, 2e-7 * max_channel_abs_sum(g, k.c, xhat));
}

TEST(BatchNormGpu, EvalBackwardMatchesCpu) {
  CUDP_REQUIRE_GPU();
  for (const BnCase& k : kBf16Cases) {
    SCOPED_TRACE(describe(k));
    expect_eval_backward_matches_cpu<float>(k, 191, 1e-5);
    expect_eval_backward_matches_cpu<__nv_bfloat16>(k, 201, kBf16Rtol);
  }
}

TEST_P(BatchNormPathGpu, Bf16WithReluIsBitwiseDeterministic) {
  CUDP_REQUIRE_GPU();
  using bf16 = __nv_bfloat16;
  for (const BnCase& k : {BnCase{16, 112, 112, 64}, BnCase{3, 7, 7, 5}, BnCase{2, 9, 9, 264}}) {
    SCOPED_TRACE(describe(k));
    const DeviceBuffer<bf16> xg(stored<bf16>(bn_input(k, 211, 2.f))),
        dyg(stored<bf16>(testing::random_vector(k.size(), 212)));
    const DeviceBuffer<float> gg(testing::random_vector(k.c, 213, 0.5f, 1.5f)),
        bg(testing::random_vector(k.c, 214));
    std::vector<std::vector<float>> first;
    for (int run = 0; run < 2; ++run) {
      DeviceBuffer<bf16> y(k.size()), dx(k.size());
      DeviceBuffer<float> rm(std::vector<float>(k.c, 0.f)), rv(std::vector<float>(k.c, 1.f)),
          m(k.c), i(k.c), dg(k.c), db(k.c);
      batchnorm_forward_train(xg.get(), y.get(), gg.get(), bg.get(), rm.get(), rv.get(), m.get(),
                              i.get(), k.rows(), k.c, kMomentum, kEps, BnActivation::relu, nullptr);
      batchnorm_backward(xg.get(), dyg.get(), y.get(), gg.get(), m.get(), i.get(), dx.get(),
                         dg.get(), db.get(), k.rows(), k.c, 0.f, nullptr);
      std::vector<std::vector<float>> out = {floats(y.download()), floats(dx.download())};
      for (auto* b : {&rm, &rv, &m, &i, &dg, &db}) out.push_back(b->download());
      if (run == 0) {
        first = out;
      } else {
        for (size_t j = 0; j < out.size(); ++j)
          EXPECT_TRUE(bitwise_equal(out[j], first[j])) << "output " << j;
      }
    }
  }
}

// The column sums of dx taken by the dx pass (batchnorm_backward's input_grad_sums, the bias
// gradient of the convolution before a BatchNorm): dx the same bits as without them; the sums
// added (+=) to what the buffer held, within 2e-7 of sum |dx| of the channel of a double sum of
// the dx written; the same bits on a second call. f32 and bf16 (the sums of the rounded values),
// with and without a mask. 2e-7 (~3.4 fp32 roundings of sum |dx|) is dbeta's tolerance above, for
// the same summation structure (per thread, a tree per block, the blocks in order): not a
// worst-case bound, which for chains of up to ~1,000 additions (200,704 rows) would be ~6e-5 of
// sum |dx| and too loose to see a lost term; terms of random sign err like the square root of
// the chain.
template <typename T>
void expect_dx_column_sums(const BnCase& k, uint64_t seed) {
  const std::vector<T> x = stored<T>(bn_input(k, seed, 2.f));
  const std::vector<T> dy = stored<T>(testing::random_vector(k.size(), seed + 1));
  const DeviceBuffer<T> xg(x), dyg(dy);
  const DeviceBuffer<float> gg(testing::random_vector(k.c, seed + 2, 0.5f, 1.5f)),
      bg(testing::random_vector(k.c, seed + 3));
  const std::vector<float> init = testing::random_vector(k.c, seed + 4);
  for (const BnActivation act : {BnActivation::none, BnActivation::relu}) {
    SCOPED_TRACE(act == BnActivation::relu ? "relu mask" : "no mask");
    DeviceBuffer<T> y(k.size()), dx_plain(k.size()), dx(k.size());
    DeviceBuffer<float> rm(std::vector<float>(k.c, 0.f)), rv(std::vector<float>(k.c, 1.f)), m(k.c),
        i(k.c), dg(k.c), db(k.c), sums(init), again(init);
    batchnorm_forward_train(xg.get(), y.get(), gg.get(), bg.get(), rm.get(), rv.get(), m.get(),
                            i.get(), k.rows(), k.c, kMomentum, kEps, act, nullptr);
    const T* mask = act == BnActivation::relu ? y.get() : nullptr;
    batchnorm_backward(xg.get(), dyg.get(), mask, gg.get(), m.get(), i.get(), dx_plain.get(),
                       dg.get(), db.get(), k.rows(), k.c, 0.f, nullptr);
    batchnorm_backward(xg.get(), dyg.get(), mask, gg.get(), m.get(), i.get(), dx.get(), dg.get(),
                       db.get(), k.rows(), k.c, 0.f, nullptr, sums.get());
    const std::vector<float> written = floats(dx.download());
    EXPECT_TRUE(bitwise_equal(written, floats(dx_plain.download())));
    std::vector<double> exact(init.begin(), init.end()), scale(k.c, 0.0);
    for (size_t j = 0; j < written.size(); ++j) {
      exact[j % k.c] += written[j];
      scale[j % k.c] += std::fabs(written[j]);
    }
    const std::vector<float> got = sums.download();
    for (int ch = 0; ch < k.c; ++ch) {
      EXPECT_NEAR(got[ch], exact[ch], 2e-7 * (scale[ch] + std::fabs(init[ch]))) << "channel " << ch;
    }
    batchnorm_backward(xg.get(), dyg.get(), mask, gg.get(), m.get(), i.get(), dx.get(), dg.get(),
                       db.get(), k.rows(), k.c, 0.f, nullptr, again.get());
    EXPECT_TRUE(bitwise_equal(again.download(), got));
  }
}

TEST_P(BatchNormPathGpu, DxColumnSumsAreTheBiasGradientBefore) {
  CUDP_REQUIRE_GPU();
  for (const BnCase& k :
       {BnCase{3, 7, 7, 5}, BnCase{2, 5, 7, 12}, BnCase{2, 9, 9, 264}, BnCase{2, 3, 3, 513},
        BnCase{256, 4, 4, 256}, BnCase{4, 56, 56, 256}, BnCase{16, 112, 112, 64}}) {
    SCOPED_TRACE(describe(k));
    {
      SCOPED_TRACE("f32");
      expect_dx_column_sums<float>(k, 221);
    }
    {
      SCOPED_TRACE("bf16");
      expect_dx_column_sums<__nv_bfloat16>(k, 231);
    }
  }
}

}  // namespace
}  // namespace cudp::kernels
